"""Feature jobs over HTTP: sketched NTK features Φ (N, k, D) of a data set as a zarr array, and kernels from them.

    POST   /v1/feature-jobs                 202 + Location: the queued job (dim D, seed, params, sketch)
    GET    /v1/feature-jobs                 {"data": [job, ...], "count"}, newest first
    GET    /v1/feature-jobs/{id}            the job, progress {rows_done, rows_total}
    GET    /v1/feature-jobs/{id}/events     text/event-stream: a "progress" event per change, "end" when finished
    GET    /v1/feature-jobs/{id}/result     Φ rows ?start=a&stop=b, (rows, k, D), as .npy, safetensors or JSON
    DELETE /v1/feature-jobs/{id}            cancel a queued or running job (stops between chunks); delete a
                                            finished one with its Φ (?cancel_only=true: only cancel)
    POST   /v1/feature-jobs/kernel          Φ1[rows] Φ2[rows]ᵀ of two finished jobs (same model, D, seed):
                                            (r, c, k, k) FULL or (r, c) TRACE, an unbiased estimate of Θ

The same seed, D, params and sketch give the same Φ on any worker (``jobs/features_job.py``). Every answer is sized
before it is built: over the response limits is a 413 with the size and the limit. The job itself is
``jobs/kinds/features.py``; its standard routes come from ``server/job_routes.py``, and a kernel from features is
computed under the compute limiter like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

import anyio.to_thread
import numpy as np
import zarr
from fastapi import Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ntk_service.errors import InvalidInput
from ntk_service.jobs import JobManager, JobRecord
from ntk_service.jobs.features_job import check_pairable, feature_block
from ntk_service.jobs.kinds.features import FEATURES_KIND, FeaturesRequest, read_features
from ntk_service.kernels.sketch.features import DEFAULT_SKETCH, MAX_FEATURE_DIM, SketchKind
from ntk_service.server.deps import ComputeDep, JobsDep, ReadAccess, SettingsDep
from ntk_service.server.job_routes import (
    RESULT_TYPES,
    JobIdPath,
    JobRouteText,
    array_response,
    check_answer_size,
    job_router,
)
from ntk_service.server.media import negotiate, read_json
from ntk_service.server.params import ID_MAX_LENGTH, INT64_MAX, MAX_GLOBS, Glob
from ntk_service.server.routes.solve_jobs import SolveRows
from ntk_service.server.schemas import openapi_body, validate_body

__all__ = ["FeatureJobCreate", "FeatureKernelCreate", "FeatureRows", "router"]


class FeatureJobCreate(BaseModel):
    """``POST /v1/feature-jobs``: Φ of the rows with E[Φ Φᵀ] = Θ, sketched from the seed (``ntk_features``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Registered model name.")
    version: int | None = Field(None, ge=1, le=INT64_MAX, description="Model version. Default: the latest.")
    dataset: SolveRows = Field(description="The rows to sketch: N examples.")
    dim: int = Field(ge=1, le=MAX_FEATURE_DIM, description=f"D, features per output, 1 to {MAX_FEATURE_DIM}.")
    seed: int = Field(0, ge=0, le=INT64_MAX, description="Picks R: the same seed, D and params give the same Φ.")
    params: list[Glob] | None = Field(None, max_length=MAX_GLOBS, description="Parameter globs; null = all.")
    dtype: Literal["float32", "float64"] = Field("float32", description="Compute and storage dtype.")
    sketch: SketchKind = Field(
        DEFAULT_SKETCH,
        description="structured: a Kronecker sketch of δ ⊗ a for Linear / Conv / Embedding weights (much faster, "
        "a few % more error at equal D); gaussian: Φ = J R / √D, one forward-mode pass per feature.",
    )
    rows_per_chunk: int | None = Field(None, ge=1, le=1_000_000, description="Rows per stored chunk (~8 MiB).")


class FeatureRows(BaseModel):
    """A finished features job, or a row range of its Φ."""

    model_config = ConfigDict(extra="forbid")

    job: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="A succeeded features job's id.")
    start: int | None = Field(None, ge=0, le=INT64_MAX, description="First row. Default: 0.")
    stop: int | None = Field(None, ge=1, le=INT64_MAX, description="One past the last row. Default: all rows.")


class FeatureKernelCreate(BaseModel):
    """``POST /v1/feature-jobs/kernel``: the kernel of two feature arrays (x2 null: x2 = x1)."""

    model_config = ConfigDict(extra="forbid")

    x1: FeatureRows = Field(description="Rows of Φ1.")
    x2: FeatureRows | None = Field(None, description="Rows of Φ2; null: the rows of x1.")
    mode: Literal["full", "trace"] = Field("full", description="(r, c, k, k) FULL or (r, c) TRACE (sum over outputs).")


def _range(start: int | None, stop: int | None, size: int, what: str) -> tuple[int, int]:
    lo, hi = (0 if start is None else start), (size if stop is None else stop)
    if not 0 <= lo < hi <= size:
        raise InvalidInput(
            f"feature jobs: {what} rows [{start}, {stop}) are outside Φ's {size} rows; expected 0 ≤ start < stop ≤ "
            f"{size}"
        )
    return lo, hi


def _request(body: FeatureJobCreate) -> FeaturesRequest:
    return FeaturesRequest(**body.model_dump(exclude={"dataset"}), dataset=body.dataset.rows())


router = job_router(
    FEATURES_KIND,
    create=FeatureJobCreate,
    request_of=_request,
    text=JobRouteText(
        noun="feature",
        tag="feature jobs",
        progress="rows done",
        cancel="it stops between chunks",
        delete="its stored Φ",
    ),
)


@contextmanager
def _phi(manager: JobManager, job_id: str) -> Iterator[tuple[JobRecord[Any, Any, Any], zarr.Array[Any]]]:
    """(job, Φ (n, k, D) read only) of a succeeded features job, for the ``with`` block: a deletion of the job
    waits (409) until the block has ended.

    Raises:
        JobNotFound: no such features job. JobNotFinished: the job has not succeeded.
    """
    with manager.reading(job_id):
        record, folder = manager.succeeded(job_id, FEATURES_KIND)
        yield record, read_features(folder)


@router.post(
    "/kernel",
    summary="A kernel from two features jobs",
    openapi_extra=openapi_body(FeatureKernelCreate),
    responses={404: {"description": "A features job does not exist."}},
)
async def feature_kernel_route(
    request: Request, _: ReadAccess, manager: JobsDep, limiter: ComputeDep, settings: SettingsDep
) -> Response:
    operation = "POST /v1/feature-jobs/kernel"
    body = validate_body(FeatureKernelCreate, await read_json(request, operation=operation), operation=operation)
    media = negotiate(request, RESULT_TYPES, operation=operation)
    right = body.x2 or body.x1

    def compute() -> np.ndarray:
        with _phi(manager, body.x1.job) as (job1, phi1), _phi(manager, right.job) as (job2, phi2):
            check_pairable(job1.spec.to_dict(), job2.spec.to_dict())
            rows = _range(body.x1.start, body.x1.stop, int(phi1.shape[0]), "x1")
            cols = _range(right.start, right.stop, int(phi2.shape[0]), "x2")
            k = int(phi1.shape[1])
            shape = (rows[1] - rows[0], cols[1] - cols[0]) + ((k, k) if body.mode == "full" else ())
            check_answer_size(media, shape, 8, settings, operation)  # before any block is formed
            return feature_block(phi1, phi2, rows, cols, mode=body.mode)

    return array_response(media, {"theta": await limiter.run(compute, operation=operation)})


@router.get(
    "/{job_id}/result",
    summary="Rows of a features job's Φ (rows, k, D)",
    responses={404: {"description": "No features job with this id."}},
)
async def feature_job_result(
    request: Request,
    job_id: JobIdPath,
    _: ReadAccess,
    manager: JobsDep,
    settings: SettingsDep,
    start: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="First row. Default: 0.")] = None,
    stop: Annotated[int | None, Query(ge=1, le=INT64_MAX, description="One past the last row.")] = None,
) -> Response:
    operation = f"GET /v1/feature-jobs/{job_id}/result"
    media = negotiate(request, RESULT_TYPES, operation=operation)

    def read() -> np.ndarray:
        with _phi(manager, job_id) as (_, phi):
            lo, hi = _range(start, stop, int(phi.shape[0]), "result")
            check_answer_size(media, (hi - lo, *phi.shape[1:]), phi.dtype.itemsize, settings, operation)
            return np.asarray(phi[lo:hi])

    return array_response(media, {"phi": await anyio.to_thread.run_sync(read)})
