"""Data set routes: upload inputs once (.npy, safetensors, .npz or JSON; one array or several named arrays with
one N, see server/dataset_uploads.py), then reference rows of them in kernel requests and jobs."""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Path, Query, Request
from starlette.responses import Response

from ntk_service import wire
from ntk_service.registry.datasets import MAX_ARRAYS
from ntk_service.server.dataset_uploads import read_dataset
from ntk_service.server.deps import DatasetsDep, ReadAccess, SettingsDep, WriteAccess
from ntk_service.server.media import collection_response, json_response
from ntk_service.server.params import ID_MAX_LENGTH, MAX_JSON_TENSOR_VALUES
from ntk_service.server.schemas import DatasetPublic, DatasetsPublic

__all__ = ["router"]

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

DatasetIdParam = Annotated[str, Path(max_length=ID_MAX_LENGTH, description="The id returned by POST /v1/datasets.")]

_NAMED_EXAMPLE = {"input_ids": [[101, 7592, 102], [101, 2088, 102]], "attention_mask": [[1, 1, 1], [1, 1, 0]]}


@router.post(
    "",
    status_code=201,
    response_model=DatasetPublic,
    summary="Upload a data set: one array (.npy, or safetensors tensor 'x') or named arrays with one N "
    "(safetensors, .npz or JSON {name: nested list})",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                wire.MEDIA_NPY: {"schema": {"type": "string", "format": "binary"}},
                wire.MEDIA_SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
                wire.MEDIA_NPZ: {"schema": {"type": "string", "format": "binary"}},
                wire.MEDIA_JSON: {
                    "schema": {
                        "type": "object",
                        "maxProperties": MAX_ARRAYS,
                        "additionalProperties": {"type": "array", "maxItems": MAX_JSON_TENSOR_VALUES},
                    },
                    "example": _NAMED_EXAMPLE,
                },
            },
        }
    },
)
async def upload_dataset(
    request: Request,
    _: WriteAccess,
    datasets: DatasetsDep,
    settings: SettingsDep,
    name: Annotated[str | None, Query(max_length=128, description="Optional human-readable name.")] = None,
) -> Response:
    operation = "upload data set"
    x = await read_dataset(request, operation=operation, max_bytes=settings.max_body_bytes)
    record = await anyio.to_thread.run_sync(lambda: datasets.create(x, name=name))
    public = record.to_public()
    return json_response(public, status_code=201, headers={"Location": f"/v1/datasets/{public['id']}"})


@router.get("", response_model=DatasetsPublic, summary="List data sets")
async def list_datasets(_: ReadAccess, datasets: DatasetsDep) -> Response:
    records = await anyio.to_thread.run_sync(datasets.list)
    return collection_response([r.to_public() for r in records])


@router.get("/{dataset_id}", response_model=DatasetPublic, summary="Show a data set")
async def get_dataset(dataset_id: DatasetIdParam, _: ReadAccess, datasets: DatasetsDep) -> Response:
    record = await anyio.to_thread.run_sync(lambda: datasets.get(dataset_id))
    return json_response(record.to_public())


@router.delete("/{dataset_id}", status_code=204, summary="Delete a data set")
async def delete_dataset(dataset_id: DatasetIdParam, _: WriteAccess, datasets: DatasetsDep) -> Response:
    await anyio.to_thread.run_sync(lambda: datasets.delete(dataset_id))
    return Response(status_code=204)
