"""Model registry routes: register, list, show, delete, upload and download weight versions."""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Request
from starlette.responses import Response

from ntk_service import wire
from ntk_service.server.deps import ReadAccess, RegistryDep, WriteAccess
from ntk_service.server.media import collection_response, json_response, read_json, require_content_type
from ntk_service.server.params import NamePath, VersionPath
from ntk_service.server.schemas import ModelCreate, ModelPublic, ModelsPublic, openapi_body, validate_body

__all__ = ["router"]

router = APIRouter(prefix="/v1/models", tags=["models"])

NameParam = NamePath
VersionParam = VersionPath


@router.post(
    "",
    status_code=201,
    response_model=ModelPublic,
    summary="Register a model from an architecture spec and a seed (version 1)",
    responses={409: {"description": "A model with this name exists."}},
    openapi_extra=openapi_body(ModelCreate),
)
async def register_model(request: Request, _: WriteAccess, registry: RegistryDep) -> Response:
    operation = "register model"
    body = validate_body(ModelCreate, await read_json(request, operation=operation), operation=operation)
    record = await anyio.to_thread.run_sync(lambda: registry.register(body.name, body.architecture, seed=body.seed))
    return json_response(record.to_public(), status_code=201, headers={"Location": f"/v1/models/{body.name}"})


@router.get("", response_model=ModelsPublic, summary="List models (latest version of each)")
async def list_models(_: ReadAccess, registry: RegistryDep) -> Response:
    records = await anyio.to_thread.run_sync(registry.list)
    return collection_response([r.to_public() for r in records])


@router.get("/{name}", response_model=ModelPublic, summary="Show a model's latest version")
async def get_model(name: NameParam, _: ReadAccess, registry: RegistryDep) -> Response:
    record = await anyio.to_thread.run_sync(lambda: registry.get(name))
    return json_response(record.to_public())


@router.delete("/{name}", status_code=204, summary="Delete a model and all its versions")
async def delete_model(name: NameParam, _: WriteAccess, registry: RegistryDep) -> Response:
    await anyio.to_thread.run_sync(lambda: registry.delete(name))
    return Response(status_code=204)


@router.get("/{name}/versions", response_model=ModelsPublic, summary="List a model's versions, oldest first")
async def list_versions(name: NameParam, _: ReadAccess, registry: RegistryDep) -> Response:
    records = await anyio.to_thread.run_sync(lambda: registry.versions(name))
    return collection_response([r.to_public() for r in records])


@router.post(
    "/{name}/versions",
    status_code=201,
    response_model=ModelPublic,
    summary="Upload weights (safetensors) as a new immutable version",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                wire.MEDIA_SAFETENSORS: {
                    "schema": {"type": "string", "format": "binary"},
                    "description": "Every parameter by its named_parameters() name, shapes and dtypes as registered.",
                }
            },
        }
    },
)
async def upload_version(name: NameParam, request: Request, _: WriteAccess, registry: RegistryDep) -> Response:
    operation = f"upload weights of model {name!r}"
    require_content_type(request, (wire.MEDIA_SAFETENSORS,), operation=operation)
    body = await request.body()
    record = await anyio.to_thread.run_sync(lambda: registry.add_version(name, body))
    location = f"/v1/models/{name}/versions/{record.version}"
    return json_response(record.to_public(), status_code=201, headers={"Location": location})


@router.get("/{name}/versions/{version}", response_model=ModelPublic, summary="Show one version")
async def get_version(name: NameParam, version: VersionParam, _: ReadAccess, registry: RegistryDep) -> Response:
    record = await anyio.to_thread.run_sync(lambda: registry.get(name, version))
    return json_response(record.to_public())


@router.get(
    "/{name}/versions/{version}/weights",
    summary="Download a version's weights (safetensors)",
    response_class=Response,  # never JSON: the document lists only safetensors
    responses={200: {"content": {wire.MEDIA_SAFETENSORS: {}}}},
)
async def get_weights(name: NameParam, version: VersionParam, _: ReadAccess, registry: RegistryDep) -> Response:
    data = await anyio.to_thread.run_sync(lambda: registry.weights_bytes(name, version))
    return Response(data, media_type=wire.MEDIA_SAFETENSORS)
