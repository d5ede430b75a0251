"""Solve jobs over HTTP: kernel ridge, GP mean or linearized predictions at t = ∞ on stored data sets, by operator
CG (``jobs/solve_job.py``), never forming the kernel.

    POST   /v1/solve-jobs              202 + Location: the queued job
    GET    /v1/solve-jobs              {"data": [job, ...], "count"}
    GET    /v1/solve-jobs/{id}         the job: progress {iterations, residual, products, passes, elapsed_s} while
                                       it runs; result {converged, stop_reason, iterations, residual, ...} after
    GET    /v1/solve-jobs/{id}/events  text/event-stream: a "progress" event per change, "end" when finished
    GET    /v1/solve-jobs/{id}/result  alpha (n, k) and predictions (m, k): JSON (with the CG report) or
                                       safetensors (the report in its metadata); 409 until succeeded
    DELETE /v1/solve-jobs/{id}         cancel a queued or running job (the solve stops before its next product);
                                       delete a finished one with its arrays (?cancel_only=true: only cancel)

A solve that did not converge is a succeeded job whose result says ``converged: false`` and its ``stop_reason``;
the result route repeats both beside the arrays, so no download hides it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ntk_service import wire
from ntk_service.config import Settings
from ntk_service.errors import JobNotFound, PayloadTooLarge, ServiceUnavailable, format_bytes
from ntk_service.jobs import JobManager
from ntk_service.jobs.disk import ResultBytes, result_bytes
from ntk_service.jobs.solve_jobs import SolveJobs
from ntk_service.server.deps import ReadAccess, SettingsDep, WriteAccess
from ntk_service.server.media import collection_response, json_response, negotiate, read_json
from ntk_service.server.params import ID_MAX_LENGTH, INT64_MAX, MAX_GLOBS, Glob
from ntk_service.server.schemas import openapi_body, validate_body

__all__ = [
    "CancelOnly",
    "SolveFields",
    "SolveJobCreate",
    "SolveRows",
    "cancel_or_delete",
    "job_events",
    "router",
    "start_solve_jobs",
    "stop_solve_jobs",
]

router = APIRouter(prefix="/v1/solve-jobs", tags=["solve jobs"])

MAX_PROGRESS_EVERY = 100_000
"""The most CG iterations one segment may take (a larger value is the same single run)."""

SolveJobId = Annotated[str, Path(max_length=ID_MAX_LENGTH, description="The id returned by POST /v1/solve-jobs.")]


class SolveRows(BaseModel):
    """A stored data set, or a row range of it."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Data set id from POST /v1/datasets.")
    start: int | None = Field(None, ge=0, le=INT64_MAX, description="First row. Default: 0.")
    stop: int | None = Field(None, ge=1, le=INT64_MAX, description="One past the last row. Default: all rows.")

    def pair(self) -> tuple[str, tuple[int | None, int | None]]:
        return self.dataset, (self.start, self.stop)


class SolveFields(BaseModel):
    """What a solve computes and how: the fields a solve job and an inline ``/solve`` share."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["kernel_ridge", "gp_mean", "linearized"] = Field(
        description="kernel_ridge / gp_mean: α = (Θ + λI)⁻¹ y; linearized: the linearized network at t = ∞ "
        "from its initial outputs f0 (α = (Θ + λI)⁻¹ (y − f0), predictions f0* + Θ* α)."
    )
    version: int | None = Field(None, ge=1, le=INT64_MAX, description="Model version. Default: the latest.")
    mode: Literal["full", "trace"] = Field("full", description="FULL kernel, or TRACE read as (Θ/k) ⊗ I_k.")
    dtype: Literal["float32", "float64"] = Field("float64", description="The operator products' dtype.")
    params: list[Glob] | None = Field(None, max_length=MAX_GLOBS, description="Parameter globs; null = all.")
    ridge: float = Field(0.0, ge=0, allow_inf_nan=False, description="λ ≥ 0 added to Θ's diagonal (absolute).")
    rtol: float = Field(1e-8, gt=0, lt=1, allow_inf_nan=False, description="Relative residual to stop at.")
    max_iterations: int | None = Field(
        None, ge=0, le=10_000_000, description="CG iterations at most. Default: min(10·rows, 2000)."
    )
    preconditioner: Literal["auto", "nystrom", "none"] = Field("auto", description="As CgOptions.")
    landmarks: int | None = Field(None, ge=1, le=100_000, description="Nyström landmarks m. Default: the library's.")


class SolveJobCreate(SolveFields):
    """``POST /v1/solve-jobs``: solve (Θ + λI) α = y − f0 on the train rows by CG, predict on the test rows."""

    model: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Registered model name.")
    train: SolveRows = Field(description="The train rows: N examples.")
    targets: SolveRows = Field(description="y: N rows of shape (k,) (or scalars for k = 1), aligned with train.")
    test: SolveRows | None = Field(None, description="The test rows (M examples); null: alpha only.")
    progress_every: int | None = Field(
        None, ge=1, le=MAX_PROGRESS_EVERY, description="CG iterations between residual reports (warm restarts)."
    )
    examples_per_chunk: int | None = Field(None, ge=1, le=1_000_000, description="Rows per read of the data sets.")


async def _solve_jobs(request: Request) -> SolveJobs:
    jobs: SolveJobs | None = getattr(request.app.state, "solve_jobs", None)
    if jobs is None:
        raise ServiceUnavailable(
            f"{request.method} {request.url.path}: solve jobs are not running (starting or stopping); retry shortly",
            retry_after_s=1,
        )
    return jobs


SolveJobsDep = Annotated[SolveJobs, Depends(_solve_jobs)]

EVENT_POLL_S = 0.25
"""How often an open event stream looks for a change of its job (a counter read, no database query)."""

_FINISHED = ("succeeded", "failed", "cancelled")


async def job_events(jobs: SolveJobs, job: dict[str, Any]) -> AsyncIterator[ServerSentEvent]:
    """The event stream of a solve or features job: ``job`` (found before the response starts, so a wrong id is a
    404) as a "progress" event, again at every change, and an "end" event with the finished job."""
    kind = job["job"]
    while True:
        seen = jobs.version(job["id"])
        finished = job["status"] in _FINISHED
        yield ServerSentEvent(data=job, event="end" if finished else "progress")
        if finished:
            return
        while jobs.version(job["id"]) == seen:
            await asyncio.sleep(EVENT_POLL_S)
        try:
            job = await anyio.to_thread.run_sync(jobs.get, job["id"], kind)
        except JobNotFound:  # finished and deleted between two looks: the stream ends; a GET now says 404
            return


async def _existing_solve_job(job_id: SolveJobId, jobs: SolveJobsDep) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(jobs.get, job_id, "solve")


ExistingSolveJob = Annotated[dict[str, Any], Depends(_existing_solve_job)]
"""The solve job; 404 before any response starts. Declared after the access dependency (resolved in order)."""


def _kernel_results(app: FastAPI) -> ResultBytes:
    """The kernel jobs' results, which share the disk budget (none while their manager is not running)."""
    manager: JobManager | None = getattr(app.state, "jobs", None)
    return ResultBytes() if manager is None else result_bytes(manager.store)


async def start_solve_jobs(app: FastAPI) -> None:
    """Build ``app.state.solve_jobs`` and requeue unfinished solves (in the lifespan, after the registry and data
    sets exist)."""
    settings: Settings = app.state.settings
    jobs = SolveJobs(
        data_dir=settings.data_dir,
        models=app.state.registry,
        datasets=app.state.datasets,
        results_dir=settings.job_results_dir,
        memory_budget_bytes=settings.memory_budget_bytes,
        disk_budget_bytes=settings.job_disk_budget_bytes,
        kernel_results=lambda: _kernel_results(app),
    )
    await anyio.to_thread.run_sync(jobs.start)
    app.state.solve_jobs = jobs


async def stop_solve_jobs(app: FastAPI) -> None:
    """Stop the solve runner: a running solve stops at its next product and runs again at the next start."""
    jobs: SolveJobs | None = getattr(app.state, "solve_jobs", None)
    if jobs is not None:
        app.state.solve_jobs = None
        await anyio.to_thread.run_sync(jobs.stop)


@router.post(
    "",
    status_code=202,
    summary="Submit a solve job",
    openapi_extra=openapi_body(SolveJobCreate),
    responses={404: {"description": "The model, version or a data set does not exist."}},
)
async def submit_solve_job(request: Request, _: WriteAccess, jobs: SolveJobsDep) -> Response:
    operation = "submit solve job"
    body = validate_body(SolveJobCreate, await read_json(request, operation=operation), operation=operation)
    job = await anyio.to_thread.run_sync(
        lambda: jobs.submit(
            kind=body.kind,
            model=body.model,
            version=body.version,
            train=body.train.pair(),
            targets=body.targets.pair(),
            test=None if body.test is None else body.test.pair(),
            mode=body.mode,
            dtype=body.dtype,
            params=body.params,
            ridge=body.ridge,
            rtol=body.rtol,
            max_iterations=body.max_iterations,
            preconditioner=body.preconditioner,
            landmarks=body.landmarks,
            progress_every=body.progress_every,
            examples_per_chunk=body.examples_per_chunk,
        )
    )
    return json_response(job, status_code=202, headers={"Location": f"/v1/solve-jobs/{job['id']}"})


@router.get("", summary="List solve jobs")
async def list_solve_jobs(_: ReadAccess, jobs: SolveJobsDep) -> Response:
    return collection_response(await anyio.to_thread.run_sync(jobs.list, "solve"))


_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No solve job with this id."}}


@router.get("/{job_id}", summary="A solve job and its progress", responses=_NOT_FOUND)
async def get_solve_job(job_id: SolveJobId, _: ReadAccess, job: ExistingSolveJob) -> Response:
    return json_response(job)


@router.get(
    "/{job_id}/events",
    response_class=EventSourceResponse,
    summary="A solve job's progress as Server-Sent Events until it ends",
    description='A "progress" event (data: the job as JSON, its CG progress) at every change, then one "end" event.',
    responses=_NOT_FOUND,
)
async def solve_job_events(
    job_id: SolveJobId, _: ReadAccess, job: ExistingSolveJob, jobs: SolveJobsDep
) -> AsyncIterator[ServerSentEvent]:
    async for event in job_events(jobs, job):
        yield event


CancelOnly = Annotated[
    bool, Query(description="Only cancel: a finished job is left as it is. Default: false (a finished job is deleted).")
]


def cancel_or_delete(jobs: SolveJobs, job_id: str, job: Literal["solve", "features"], cancel_only: bool) -> Any:
    """DELETE of a solve or features job: the cancelled job while it is queued or running (or ``cancel_only``),
    else {"id", "deleted": "job", "freed_bytes"} once its row and files are gone."""
    record = jobs.get(job_id, job)
    if cancel_only or record["status"] not in _FINISHED:
        return jobs.cancel(job_id, job)
    return {"id": job_id, "deleted": "job", "freed_bytes": jobs.delete(job_id, job)}


@router.delete(
    "/{job_id}",
    summary="Cancel a queued or running solve job; delete a finished one and its arrays",
    description="A queued or running job is cancelled (the solve stops before its next product). A finished job "
    "is removed with its alpha and predictions (its bytes return to the disk budget), unless cancel_only=true.",
    responses=_NOT_FOUND,
)
async def delete_solve_job(
    job_id: SolveJobId, _: WriteAccess, jobs: SolveJobsDep, cancel_only: CancelOnly = False
) -> Response:
    return json_response(await anyio.to_thread.run_sync(cancel_or_delete, jobs, job_id, "solve", cancel_only))


@router.get("/{job_id}/result", summary="A solve job's alpha and test predictions")
async def solve_job_result(
    request: Request, job_id: SolveJobId, _: ReadAccess, jobs: SolveJobsDep, settings: SettingsDep
) -> Response:
    operation = f"GET /v1/solve-jobs/{job_id}/result"
    media = negotiate(request, (wire.MEDIA_JSON, wire.MEDIA_SAFETENSORS), operation=operation)
    job, alpha, predictions = await anyio.to_thread.run_sync(jobs.result, job_id)
    report = job["result"]
    arrays = {"alpha": alpha} | ({} if predictions is None else {"predictions": predictions})
    if media == wire.MEDIA_SAFETENSORS:
        metadata = {"result": wire.json_dumps(report).decode()}
        return Response(wire.encode_safetensors(arrays, metadata), media_type=wire.MEDIA_SAFETENSORS)
    values = sum(math.prod(a.shape) for a in arrays.values())
    limit = settings.max_json_response_bytes
    if values * _JSON_BYTES_PER_VALUE > limit:
        raise _too_large(operation, values, limit)
    body = report | {name: wire.tensor_to_json(array) for name, array in arrays.items()}
    return json_response(body)


_JSON_BYTES_PER_VALUE = 24
"""A float64 written by orjson takes up to 24 bytes (``-1.2345678901234567e-123,``)."""


def _too_large(operation: str, values: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"{operation}: the result holds {values} numbers (about {format_bytes(values * _JSON_BYTES_PER_VALUE)} as "
        f"JSON), over the JSON response limit of {format_bytes(limit)}; ask for Accept: application/x-safetensors"
    )
