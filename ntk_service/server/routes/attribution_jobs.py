"""Attribution jobs over HTTP: which training examples drove each prediction of a test set, scored against the
training sides of attribution features jobs, one per checkpoint (``jobs/kinds/attribution.py``).

    POST   /v1/attribution-jobs                        202 + Location: the queued job
    GET    /v1/attribution-jobs                        {"data": [job, ...], "count"}, newest first
    GET    /v1/attribution-jobs/{id}                   the job: progress {stage, units_done, ...}; result {n_train,
                                                       n_test, answers, lam, ...} once succeeded
    GET    /v1/attribution-jobs/{id}/events            text/event-stream: "progress" per change, "end" at the end
    GET    /v1/attribution-jobs/{id}/result?rows=a:b   the top-k proponents and opponents of test rows a:b and their
                                                       scores, the total and self influence: JSON or safetensors
    GET    /v1/attribution-jobs/{id}/scores?rows&cols  a block of the dense scores (when kept): .npy, safetensors, JSON
    GET    /v1/attribution-jobs/{id}/examples/{i}      test example i, its top training examples with their scores,
                                                       inputs and labels (what the console draws)
    DELETE /v1/attribution-jobs/{id}                   cancel a queued or running job (it stops between units);
                                                       delete a finished one with its arrays (?cancel_only=true)

Every answer is sized before it is read: over the response limits is a 413 with the size and the limit.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import anyio.to_thread
import numpy as np
from fastapi import Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ntk_service import wire
from ntk_service.attribution import DEFAULT_RIDGE
from ntk_service.errors import InvalidInput, ResultNotFound
from ntk_service.jobs import JobManager
from ntk_service.jobs.kinds.attribution import (
    ATTRIBUTION_KIND,
    DEFAULT_TOP_K,
    MAX_CHECKPOINTS,
    AttributionRequest,
    AttributionSpec,
    read_answers,
    read_scores,
)
from ntk_service.jobs.kinds.attribution_features import input_layout, read_inputs
from ntk_service.jobs.results import parse_range
from ntk_service.registry import DatasetStore
from ntk_service.server.deps import DatasetsDep, JobsDep, ReadAccess, SettingsDep
from ntk_service.server.job_routes import (
    RESULT_TYPES,
    JobIdPath,
    JobRouteText,
    array_response,
    check_answer_size,
    job_router,
)
from ntk_service.server.media import json_response, negotiate
from ntk_service.server.params import ID_MAX_LENGTH, INT64_MAX, QUERY_MAX_LENGTH
from ntk_service.server.routes.solve_jobs import SolveRows

__all__ = ["AttributionJobCreate", "router"]

RowsQuery = Annotated[
    str | None, Query(max_length=QUERY_MAX_LENGTH, description="Test rows a:b (an end may be omitted). Default: all.")
]


class AttributionJobCreate(BaseModel):
    """``POST /v1/attribution-jobs``: scores τ(x*, x_n) of a test set against an ensemble of stored training sides."""

    model_config = ConfigDict(extra="forbid")

    features: list[Annotated[str, Field(min_length=1, max_length=ID_MAX_LENGTH)]] = Field(
        min_length=1,
        max_length=MAX_CHECKPOINTS,
        description="The succeeded attribution features jobs, one per checkpoint of the ensemble (one training set, "
        "loss, feature kind and D).",
    )
    test: SolveRows | None = Field(None, description="The test inputs: M examples. Null: only the self-influence.")
    test_labels: SolveRows | None = Field(
        None,
        description="Their labels: class indices (M,) for cross_entropy (null: the predicted class), targets "
        "(M, *out) for mse (required).",
    )
    ridge: float = Field(
        DEFAULT_RIDGE, ge=0, allow_inf_nan=False, description="λ relative to the mean diagonal of the training kernel."
    )
    ensemble: Literal["trak", "mean"] = Field("trak", description="How the checkpoints' scores combine.")
    top_k: int | None = Field(
        None,
        ge=0,
        le=1000,
        description=f"Proponents and opponents per test example (0: none). Default: {DEFAULT_TOP_K}, at most N.",
    )
    store_scores: bool = Field(False, description="Keep the dense (M, N) float32 scores on disk (4·M·N bytes).")
    total_influence: bool = Field(True, description="Each training example's total influence on the test set.")
    self_influence: bool = Field(False, description="Each training example's self-influence (label-noise suspects).")
    train_rows: int | None = Field(
        None, ge=1, le=INT64_MAX, description="Training rows per scoring unit. Default: the most the memory holds."
    )
    test_rows_per_chunk: int | None = Field(None, ge=1, le=1_000_000, description="Test rows per unit of features.")


def _request(body: AttributionJobCreate) -> AttributionRequest:
    fields = body.model_dump(exclude={"test", "test_labels"})
    test = None if body.test is None else body.test.rows()
    labels = None if body.test_labels is None else body.test_labels.rows()
    return AttributionRequest(**fields, test=test, test_labels=labels)


router = job_router(
    ATTRIBUTION_KIND,
    create=AttributionJobCreate,
    request_of=_request,
    text=JobRouteText(
        noun="attribution",
        tag="attribution",
        progress="its stage, units and rows",
        cancel="it stops between units",
        delete="its arrays",
    ),
)

_ANSWER_TYPES = (wire.MEDIA_JSON, wire.MEDIA_SAFETENSORS)


def _succeeded(manager: JobManager, job_id: str) -> tuple[AttributionSpec, Any, Any]:
    record, folder = manager.succeeded(job_id, ATTRIBUTION_KIND)
    return cast(AttributionSpec, record.spec), record, folder


@router.get(
    "/{job_id}/result",
    summary="An attribution job's answers: top-k proponents and opponents, total and self influence",
    responses={404: {"description": "No attribution job with this id."}, 409: {"description": "Not succeeded."}},
)
async def attribution_result(
    request: Request, job_id: JobIdPath, _: ReadAccess, manager: JobsDep, settings: SettingsDep, rows: RowsQuery = None
) -> Response:
    operation = f"GET /v1/attribution-jobs/{job_id}/result"
    media = negotiate(request, _ANSWER_TYPES, operation=operation)

    def read() -> Response:
        with manager.reading(job_id):
            spec, record, folder = _succeeded(manager, job_id)
            span = parse_range(rows, spec.m, axis="rows") if spec.m else (0, 0)
            values = (span[1] - span[0]) * spec.top_k * 4 + spec.n * (spec.total_influence + spec.self_influence)
            check_answer_size(media, (values,), 8, settings, operation)
            arrays = read_answers(folder, spec, span if spec.m else None)
        summary = ATTRIBUTION_KIND.encode_result(record.result) if record.result is not None else {}
        return array_response(media, arrays, {**summary, "rows": list(span)})

    return await anyio.to_thread.run_sync(read)


@router.get(
    "/{job_id}/scores",
    summary="A block of an attribution job's dense scores (M, N) float32, when the job kept them",
    responses={404: {"description": "No such job, or it did not keep the dense scores."}},
)
async def attribution_scores(
    request: Request,
    job_id: JobIdPath,
    _: ReadAccess,
    manager: JobsDep,
    settings: SettingsDep,
    rows: RowsQuery = None,
    cols: Annotated[
        str | None, Query(max_length=QUERY_MAX_LENGTH, description="Training columns c:d. Default: all.")
    ] = None,
) -> Response:
    operation = f"GET /v1/attribution-jobs/{job_id}/scores"
    media = negotiate(request, RESULT_TYPES, operation=operation)

    def read() -> np.ndarray:
        with manager.reading(job_id):
            spec, _, folder = _succeeded(manager, job_id)
            if not spec.store_scores:
                raise ResultNotFound(
                    f"{operation}: job {job_id} kept no dense scores (it ran with store_scores=false); read its top-k "
                    "from /result, or submit it again with store_scores=true"
                )
            r, c = parse_range(rows, spec.m, axis="rows"), parse_range(cols, spec.n, axis="cols")
            check_answer_size(media, (r[1] - r[0], c[1] - c[0]), 4, settings, operation)
            return read_scores(folder, r, c)

    return array_response(media, {"scores": await anyio.to_thread.run_sync(read)})


def _labels(datasets: DatasetStore, dataset: str | None, start: int, rows: list[int]) -> list[Any]:
    if dataset is None:
        return [None] * len(rows)
    out = []
    for row in rows:
        value = datasets.load(dataset, start + row, start + row + 1)
        array = np.asarray(value)[0]
        out.append(array.item() if array.ndim == 0 else array.tolist())
    return out


def _inputs(datasets: DatasetStore, dataset: str, start: int, rows: list[int]) -> list[Any]:
    out = []
    for row in rows:
        x = read_inputs(datasets, dataset, start + row, start + row + 1)
        if isinstance(x, dict):
            out.append({name: wire.tensor_to_json(t[0].numpy()) for name, t in x.items()})
        else:
            out.append(wire.tensor_to_json(x[0].numpy()))
    return out


@router.get(
    "/{job_id}/examples/{index}",
    summary="A test example and its top training examples: scores, inputs and labels",
    responses={404: {"description": "No attribution job with this id."}, 409: {"description": "Not succeeded."}},
)
async def attribution_example(
    job_id: JobIdPath,
    _: ReadAccess,
    manager: JobsDep,
    datasets: DatasetsDep,
    settings: SettingsDep,
    index: Annotated[int, Path(ge=0, le=INT64_MAX, description="The test example: a row of the job's test rows.")],
    k: Annotated[int | None, Query(ge=1, le=1000, description="Training examples per side. Default: top_k.")] = None,
) -> Response:
    operation = f"GET /v1/attribution-jobs/{job_id}/examples/{index}"

    def read() -> dict[str, Any]:
        with manager.reading(job_id):
            spec, _, folder = _succeeded(manager, job_id)
            if not spec.top_k:
                raise InvalidInput(f"{operation}: job {job_id} kept no top-k (top_k=0); submit it with top_k > 0")
            if index >= spec.m:
                raise InvalidInput(f"{operation}: index {index} is outside the job's {spec.m} test examples")
            shown = min(spec.top_k, k or spec.top_k)
            assert spec.test_dataset is not None
            layout = input_layout(datasets.get(spec.test_dataset))
            per_example = sum(int(np.prod(shape)) for _, shape in layout)
            check_answer_size(wire.MEDIA_JSON, ((1 + 2 * shown) * per_example,), 8, settings, operation)
            top = read_answers(folder, spec, (index, index + 1))
        single = layout[0][0] == ""
        shape: Any = list(layout[0][1]) if single else {name: list(shape) for name, shape in layout}
        out: dict[str, Any] = {"job": job_id, "index": index, "example_shape": shape}
        out["test"] = {
            "index": index,
            "input": _inputs(datasets, spec.test_dataset, spec.test_start, [index])[0],
            "label": _labels(datasets, spec.test_labels_dataset, spec.test_labels_start, [index])[0],
        }
        for side, scores in (("proponents", "proponent_scores"), ("opponents", "opponent_scores")):
            rows = [int(r) for r in top[side][0][:shown]]
            inputs = _inputs(datasets, spec.train_dataset, spec.train_start, rows)
            labels = _labels(datasets, spec.labels_dataset, spec.labels_start, rows)
            out[side] = [
                {"index": r, "score": float(s), "input": x, "label": y}
                for r, s, x, y in zip(rows, top[scores][0][:shown], inputs, labels, strict=True)
            ]
        return out

    return json_response(await anyio.to_thread.run_sync(read))
