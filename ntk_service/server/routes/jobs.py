"""Batch kernel jobs over HTTP: submit, watch (polling or Server-Sent Events), download, cancel.

    POST   /v1/jobs                       202 + Location: the queued job
    GET    /v1/jobs                       {"data": [job, ...], "count"}
    GET    /v1/jobs/{id}                  the job, with progress and ETA
    GET    /v1/jobs/{id}/events           text/event-stream: a "progress" event per change, "end" when finished
    GET    /v1/jobs/{id}/result           the kernel, whole or ?rows=a:b&cols=c:d, by Accept (409 until succeeded);
                                          .npy streams row block by row block
    GET    /v1/jobs/{id}/zarr             the result's Zarr group as a zip, streamed (jobs/result_archive.py)
    DELETE /v1/jobs/{id}                  a queued/running job: cancel (running tiles finish, no new tile starts);
                                          a finished one: delete its result (?keep_record=true keeps the record)

The JobManager (jobs of every kind) is built in the app's lifespan and reached through ``JobsDep``; this module is
the kernel job's routes (``jobs/kinds/kernel.py``), which keep the JSON form they always had. With the local
executor every panel takes a slot of the same ComputeLimiter interactive kernels use (see ``executors/local.py``).
"""

from __future__ import annotations

import io
import math
import pathlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import anyio.to_thread
import numpy as np
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response, StreamingResponse

from ntk_service import wire
from ntk_service.config import Settings
from ntk_service.errors import InvalidInput, NotAcceptable, ResultNotFound, format_bytes
from ntk_service.jobs import JobManager, JobRecord
from ntk_service.jobs.kinds.kernel import KERNEL_KIND, KernelRequest
from ntk_service.jobs.result_archive import ZIP_MEDIA, zip_stream
from ntk_service.jobs.results import RESULT_GROUP_NAME, ResultArray, parse_range
from ntk_service.kernels import KernelMode, NtkImplementation
from ntk_service.server import job_routes
from ntk_service.server.deps import JobsDep, ReadAccess, WriteAccess
from ntk_service.server.job_routes import RESULT_TYPES
from ntk_service.server.media import (
    MIN_JSON_BYTES_PER_VALUE,
    encode_theta,
    json_response,
    json_too_large,
    negotiate,
    read_json,
)
from ntk_service.server.params import ID_MAX_LENGTH, INT64_MAX, MAX_GLOBS, QUERY_MAX_LENGTH, Glob
from ntk_service.server.schemas import openapi_body, validate_body

__all__ = [
    "JobCreate",
    "JobDeleted",
    "JobIdParam",
    "JobPublic",
    "JobsPublic",
    "job_public",
    "router",
    "stream_pieces",
]

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

JobIdParam = Annotated[str, Path(max_length=ID_MAX_LENGTH, description="The id returned by POST /v1/jobs.")]


class JobDataset(BaseModel):
    """A stored data set (or a row range of it) as one side of a job."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Data set id from POST /v1/datasets.")
    start: int | None = Field(None, ge=0, le=INT64_MAX, description="First row. Default: 0.")
    stop: int | None = Field(
        None, ge=1, le=INT64_MAX, description="One past the last row. Default: the data set's rows."
    )

    def rows(self, manager: JobManager) -> tuple[int, int] | None:
        if self.start is None and self.stop is None:
            return None
        size = int(manager.datasets.get(self.dataset).shape[0])
        return (self.start or 0, size if self.stop is None else self.stop)


class JobCreate(BaseModel):
    """``POST /v1/jobs``: the kernel of whole data sets, computed in tiles."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Registered model name.")
    version: int | None = Field(None, ge=1, le=INT64_MAX, description="Model version. Default: the latest.")
    x1: JobDataset = Field(description="The data set (or its rows) of x1: N examples.")
    x2: JobDataset | None = Field(None, description="null: x2 = x1 (only tiles on/above the diagonal computed).")
    mode: KernelMode = Field(KernelMode.FULL, description="As for /ntk (pseudo excepted).")
    implementation: NtkImplementation = Field(
        NtkImplementation.AUTO, description="How to compute each tile; auto picks by cost."
    )
    dtype: Literal["float32", "float64"] = Field("float32", description="Compute and storage dtype.")
    params: list[Glob] | None = Field(
        None, max_length=MAX_GLOBS, description="Glob patterns over parameter names; null = all."
    )
    tile_size: int | None = Field(None, ge=1, le=65536, description="Examples per tile side. Default: server's.")
    panel_tiles: int | None = Field(
        None, ge=1, le=4096, description="Tiles per panel side (the work unit). Default: from the cost model."
    )
    output: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description='Where the model returns a mapping: the output to differentiate, e.g. "logits" or '
        '"logits[:, 0]" (as compute_ntk\'s output=). null: the model returns a tensor.',
        examples=["logits"],
    )


class JobPublic(BaseModel):
    """A job and where it stands."""

    id: str = Field(description="The job's id, for GET /v1/jobs/{job_id} and its result.")
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"] = Field(
        description="Where it stands; succeeded, failed and cancelled never change again."
    )
    model: str = Field(description="The model's name.")
    version: int = Field(description="The model version, resolved at submission.")
    x1: JobDataset = Field(description="The rows of x1.")
    x2: JobDataset | None = Field(description="The rows of x2; null: x2 = x1 (symmetric).")
    mode: KernelMode = Field(description="The kernel mode stored.")
    implementation: NtkImplementation = Field(description="The implementation asked for.")
    implementation_used: list[str] = Field(description="The implementations the tiles ran (auto resolved).")
    dtype: str = Field(description="Compute and storage dtype.")
    params: list[str] | None = Field(description="Parameter globs; null = all.")
    tile_size: int = Field(description="Examples per tile side.")
    panel_tiles: int = Field(
        description="Tiles per panel side: each panel (up to panel_tiles² tiles) is one unit of work."
    )
    output: str | None = Field(description="The output path differentiated; null: the model returns a tensor.")
    tiles_done: int = Field(description="Tiles computed so far.")
    tiles_total: int = Field(description="Tiles in all (on and above the diagonal for a symmetric job).")
    progress: float = Field(description="tiles_done / tiles_total, 0 to 1.")
    eta_s: float | None = Field(description="Estimated seconds left; null until a tile has finished.")
    error: str | None = Field(description="Why it failed; null otherwise.")
    result_shape: list[int] = Field(description="The stored kernel's shape, e.g. (N, M) for trace.")
    estimate_bytes: int = Field(description="The result's size on disk.")
    result_path: str | None = Field(
        default=None,
        description="Where the result group lies on the server's disk (xarray.open_zarr opens it there; elsewhere "
        "download GET /v1/jobs/{job_id}/zarr); null once deleted.",
    )
    executor: str = Field(description='"local" or "ray".')
    created_at: str = Field(description="Submission time (UTC, ISO 8601).")
    started_at: str | None = Field(description="When the first tile started; null while queued.")
    finished_at: str | None = Field(description="When it ended; null while it runs.")
    result_deleted_at: str | None = Field(description="When its result was deleted (the record kept); null if not.")


class JobDeleted(BaseModel):
    """``DELETE /v1/jobs/{id}`` of a finished job: what was removed."""

    id: str = Field(description="The job's id.")
    deleted: Literal["result", "job"] = Field(description='"job": record and result; "result": the record is kept.')
    freed_bytes: int = Field(description="Bytes removed from disk.")


class JobsPublic(BaseModel):
    data: list[JobPublic] = Field(description="Every job, newest first.")
    count: int = Field(description="How many items data holds.")


def _iso(timestamp: float | None) -> str | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, UTC).isoformat()


def job_public(
    record: JobRecord[Any, Any, Any], eta_s: float | None, folder: pathlib.Path | None = None
) -> dict[str, Any]:
    """The JSON form of a job (``JobPublic``); ``folder`` (``manager.folder(record)``) gives ``result_path``."""
    spec = record.spec
    x1 = {"dataset": spec.x1_dataset, "start": spec.x1_start, "stop": spec.x1_start + spec.n}
    x2 = {"dataset": spec.x2_dataset, "start": spec.x2_start, "stop": spec.x2_start + spec.m}
    return {
        "id": record.id,
        "status": record.status.value,
        "model": spec.model,
        "version": spec.version,
        "x1": x1,
        "x2": None if spec.x2_dataset is None else x2,
        "mode": spec.mode.value,
        "implementation": spec.implementation.value,
        "implementation_used": record.implementations,
        "dtype": spec.dtype,
        "params": None if spec.params is None else list(spec.params),
        "tile_size": spec.tile_size,
        "panel_tiles": spec.panel_tiles,
        "output": spec.output,
        "tiles_done": record.tiles_done,
        "tiles_total": record.tiles_total,
        "progress": round(record.progress, 6),
        "eta_s": None if eta_s is None else round(eta_s, 3),
        "error": record.error,
        "result_shape": record.result_shape,
        "estimate_bytes": record.estimate_bytes,
        "result_path": None
        if folder is None or record.result_deleted_at is not None
        else str(folder / RESULT_GROUP_NAME),
        "executor": record.executor,
        "created_at": _iso(record.created_at),
        "started_at": _iso(record.started_at),
        "finished_at": _iso(record.finished_at),
        "result_deleted_at": _iso(record.result_deleted_at),
    }


def _describe(manager: JobManager, job_id: str) -> dict[str, Any]:
    record = manager.get(job_id, KERNEL_KIND)
    return job_public(record, manager.eta_s(record), manager.folder(record))


async def _existing_job(job_id: JobIdParam, manager: JobsDep) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(_describe, manager, job_id)


ExistingJob = Annotated[dict[str, Any], Depends(_existing_job)]
"""The job's JSON form; 404 (JobNotFound) before any response starts. Declare it after the access dependency, so a
caller without a key learns nothing about which jobs exist (dependencies resolve in parameter order)."""


# -- routes ---------------------------------------------------------------------------------------------------------


@router.post(
    "",
    status_code=202,
    response_model=JobPublic,
    summary="Submit a batch kernel job",
    responses={404: {"description": "The model, version or a data set does not exist."}},
    openapi_extra=openapi_body(JobCreate),
)
async def submit_job(request: Request, _: WriteAccess, manager: JobsDep) -> Response:
    operation = "submit job"
    body = validate_body(JobCreate, await read_json(request, operation=operation), operation=operation)

    def submit() -> JobRecord[Any, Any, Any]:
        x1, x2, fields = body.x1, body.x2, body.model_dump(exclude={"x1", "x2"})
        return manager.create(
            KernelRequest(
                **fields,
                x1_dataset=x1.dataset,
                x1_rows=x1.rows(manager),
                x2_dataset=None if x2 is None else x2.dataset,
                x2_rows=None if x2 is None else x2.rows(manager),
            )  # fmt: skip
        )

    record = await anyio.to_thread.run_sync(submit)  # off the limiter: NOTE [planning off the limiter]
    return json_response(
        job_public(record, None, manager.folder(record)), status_code=202, headers={"Location": f"/v1/jobs/{record.id}"}
    )


@router.get("", response_model=JobsPublic, summary="List jobs, newest first")
async def list_jobs(_: ReadAccess, manager: JobsDep) -> Response:
    records = await anyio.to_thread.run_sync(manager.list, KERNEL_KIND)
    return json_response(
        {"data": [job_public(r, manager.eta_s(r), manager.folder(r)) for r in records], "count": len(records)}
    )


@router.get("/{job_id}", response_model=JobPublic, summary="Show a job: status, progress, ETA")
async def get_job(_: ReadAccess, job: ExistingJob) -> Response:
    return json_response(job)


@router.get(
    "/{job_id}/events",
    response_class=EventSourceResponse,
    summary="Progress as Server-Sent Events until the job ends",
    description='A "progress" event (data: the job as JSON) at every change, then one "end" event.',
)
async def job_events(
    job_id: JobIdParam, _: ReadAccess, job: ExistingJob, manager: JobsDep
) -> AsyncIterator[ServerSentEvent]:
    async for event in job_routes.job_events(manager, job_id, job, lambda job_id: _describe(manager, job_id)):
        yield event


@router.get(
    "/{job_id}/result",
    summary="Download the kernel of a succeeded job, whole or a slice (.npy streams)",
    responses={200: {"content": {wire.MEDIA_NPY: {}, wire.MEDIA_SAFETENSORS: {}}}, 409: {}},
)
async def job_result(
    job_id: JobIdParam,
    request: Request,
    _: ReadAccess,
    manager: JobsDep,
    rows: Annotated[
        str | None,
        Query(max_length=QUERY_MAX_LENGTH, description="Row range a:b (either end may be omitted). Default: all."),
    ] = None,
    cols: Annotated[
        str | None, Query(max_length=QUERY_MAX_LENGTH, description="Column range c:d. Default: all.")
    ] = None,
) -> Response:
    operation = f"result of job {job_id}"
    media = negotiate(request, RESULT_TYPES, operation=operation)
    settings: Settings = request.app.state.settings
    cap = settings.max_json_response_bytes

    def prepare() -> _Download:
        record, array = manager.open_result(job_id)
        spec = record.spec
        r = parse_range(rows, spec.n, axis="rows")
        pairs = spec.mode.spec.pairs
        if not pairs and cols is not None:
            raise InvalidInput(f"job result: mode {spec.mode.value!r} has no column axis; omit cols")
        c = parse_range(cols, spec.m, axis="cols") if pairs else None
        shape = list(record.result_shape)
        shape[0] = r[1] - r[0]
        if c is not None:
            shape[1] = c[1] - c[0]
        meta = {
            "job": record.id,
            "model": spec.model,
            "version": spec.version,
            "mode": spec.mode.value,
            "implementation": ",".join(record.implementations),
            "rows": f"{r[0]}:{r[1]}",
            "cols": "" if c is None else f"{c[0]}:{c[1]}",
        }
        return _Download(record.id, array, r, c, tuple(shape), meta)

    download = await anyio.to_thread.run_sync(prepare)
    values = math.prod(download.shape)
    if media == wire.MEDIA_NPY:
        return _stream_npy(manager, download, settings.job_stream_block_bytes)
    if media == wire.MEDIA_JSON and values * MIN_JSON_BYTES_PER_VALUE > cap:
        size = f"at least {format_bytes(values * MIN_JSON_BYTES_PER_VALUE)}"
        raise json_too_large(size, cap, operation="job result", hint=_SLICE_HINT)
    nbytes = values * download.array.dtype.itemsize
    if media == wire.MEDIA_SAFETENSORS and nbytes > settings.max_binary_response_bytes:
        raise NotAcceptable(
            f"job result: the safetensors answer would be {format_bytes(nbytes)}, over the server's limit of "
            f"{format_bytes(settings.max_binary_response_bytes)} for answers built in one piece "
            f"(NTK_MAX_BINARY_RESPONSE_BYTES); stream it with 'Accept: {wire.MEDIA_NPY}' (client.download_result(job, "
            "path) writes it to a file), or download a slice with ?rows=a:b&cols=c:d"
        )

    def read() -> Response:
        with manager.reading(download.job_id):
            theta = download.array.read(rows=download.rows, cols=download.cols)
            _check_still_there(download)
        return encode_theta(theta, media, download.meta, cap=cap, operation="job result", hint=_SLICE_HINT)

    return await anyio.to_thread.run_sync(read)


_SLICE_HINT = ", or download a slice with ?rows=a:b&cols=c:d"


@router.get(
    "/{job_id}/zarr",
    summary="Download a succeeded job's result as its Zarr group, zipped (xarray opens it)",
    description="The same group as on the server's disk (dimension names, attributes, tile ledger), stored "
    "uncompressed and streamed: open it with xarray.open_zarr(zarr.storage.ZipStore(path)) or "
    "client.result_array(job).to_xarray(path). A symmetric result holds only the tiles on and above the diagonal.",
    response_class=Response,
    responses={200: {"content": {ZIP_MEDIA: {"schema": {"type": "string", "format": "binary"}}}}, 409: {}},
)
async def job_result_zarr(job_id: JobIdParam, _: ReadAccess, manager: JobsDep) -> Response:
    _record, array = await anyio.to_thread.run_sync(manager.open_result, job_id)
    pieces = zip_stream(array.path)

    async def body() -> AsyncIterator[bytes]:
        with manager.reading(job_id):
            while (piece := await anyio.to_thread.run_sync(next, pieces, None)) is not None:
                yield piece

    disposition = f'attachment; filename="{job_id}.zarr.zip"'
    return StreamingResponse(body(), media_type=ZIP_MEDIA, headers={"Content-Disposition": disposition})


@dataclass(frozen=True, slots=True)
class _Download:
    """A result block about to be sent: the job, its open array, the ranges, the block's shape, the metadata."""

    job_id: str
    array: ResultArray
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    shape: tuple[int, ...]
    meta: dict[str, Any]


def _check_still_there(download: _Download) -> None:
    # A deletion renames the job's folder before removing it; a block read across that instant may hold fill values,
    # so it is only sent if the folder is still there after the read.
    if not download.array.path.exists():
        raise ResultNotFound(f"jobs: the result of job {download.job_id} was deleted while it was being read")


Piece = tuple[tuple[int, int], tuple[int, int] | None]
"""The rows and columns of one read of a streamed download."""


def stream_pieces(
    rows: tuple[int, int],
    cols: tuple[int, int] | None,
    entry_shape: tuple[int, ...],
    itemsize: int,
    tile_size: int,
    block_bytes: int,
) -> Iterator[Piece]:
    """The reads of a streamed download of ``rows × cols``, in the order of the ``.npy`` body (C order).

    Each read is at most ``block_bytes`` (at least one entry ``(k, k)``), cut at tile boundaries so it touches whole
    tiles: blocks of whole rows, or, when one row is wider than ``block_bytes`` (a wide FULL kernel), pieces of one
    row (a row's entries are contiguous in the body).

    Args:
        rows, cols: the block; cols None for EXAMPLE_DIAGONAL.
        entry_shape: the shape of one (row, col) entry: (k, k) FULL, () TRACE, (k,) OUTPUT_DIAGONAL; for
            EXAMPLE_DIAGONAL the shape of one row, (k, k).
        itemsize: bytes per value. tile_size: the result's tile size. block_bytes: the most one read may take.
    """
    r0, r1 = rows
    entry_bytes = math.prod(entry_shape) * itemsize
    row_bytes = entry_bytes * (1 if cols is None else cols[1] - cols[0])
    if cols is None or row_bytes <= block_bytes:
        step = max(1, min(tile_size, block_bytes // max(row_bytes, 1)))
        start = r0
        while start < r1:
            stop = min(r1, (start // tile_size + 1) * tile_size, start + step)
            yield (start, stop), cols
            start = stop
        return
    width = max(1, block_bytes // max(entry_bytes, 1))
    for row in range(r0, r1):
        start = cols[0]
        while start < cols[1]:
            stop = min(cols[1], (start // tile_size + 1) * tile_size, start + width)
            yield (row, row + 1), (start, stop)
            start = stop


def _stream_npy(manager: JobManager, download: _Download, block_bytes: int) -> Response:
    """The block as a streamed ``.npy``: the header (shape and dtype are known up front), then row blocks in order.

    ``Content-Length`` is exact, so a client can tell a complete download from a cut one.
    """
    dtype = download.array.dtype.newbyteorder("=")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": download.shape}
    )
    head = header.getvalue()
    length = len(head) + math.prod(download.shape) * dtype.itemsize

    def read_piece(piece: Piece) -> bytes:
        theta = download.array.read(rows=piece[0], cols=piece[1])
        _check_still_there(download)
        return np.ascontiguousarray(theta, dtype=dtype).tobytes()

    entry_shape = download.shape[1:] if download.cols is None else download.shape[2:]
    plan = download.array.plan
    pieces = stream_pieces(download.rows, download.cols, entry_shape, dtype.itemsize, plan.tile_size, block_bytes)

    async def body() -> AsyncIterator[bytes]:
        with manager.reading(download.job_id):
            yield head
            for piece in pieces:
                yield await anyio.to_thread.run_sync(read_piece, piece)

    headers = {f"X-NTK-{key.replace('_', '-').title()}": str(value) for key, value in download.meta.items()}
    headers["Content-Length"] = str(length)
    return StreamingResponse(body(), media_type=wire.MEDIA_NPY, headers=headers)


@router.delete(
    "/{job_id}",
    response_model=JobPublic | JobDeleted,
    summary="Cancel a queued or running job; delete a finished job's result",
    description="A queued or running job is cancelled (running tiles finish). A finished job's result is removed "
    "from disk (its bytes return to the disk budget); the record goes too unless keep_record=true.",
)
async def delete_job(
    job_id: JobIdParam,
    _: WriteAccess,
    manager: JobsDep,
    keep_record: Annotated[
        bool, Query(description="Keep the finished job's record (result_deleted_at is set). Default: false.")
    ] = False,
    cancel_only: Annotated[
        bool, Query(description="Only cancel: a finished job is left as it is. Default: false.")
    ] = False,
) -> Response:
    def act() -> Response:
        record = manager.get(job_id, KERNEL_KIND)
        if cancel_only or not record.is_finished:
            cancelled = manager.cancel(job_id, KERNEL_KIND)
            return json_response(job_public(cancelled, manager.eta_s(cancelled), manager.folder(cancelled)))
        deletion = manager.delete(job_id, keep_record=keep_record, kind=KERNEL_KIND)
        kind = "result" if deletion.record_kept else "job"
        return json_response({"id": job_id, "deleted": kind, "freed_bytes": deletion.freed_bytes})

    return await anyio.to_thread.run_sync(act)
