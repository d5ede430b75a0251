"""``POST /v1/jobs/{job_id}/spectrum | alignment | distance``: analyses of a finished job's stored kernel.

The kernel is never loaded whole unless the caller asks for a dense eigh: Lanczos reads it through
``stored_kernel_operator`` and alignment / distance stream it, ``block_rows`` rows at a time (the lower half of a
symmetric job is mirrored on read, so each block is exact). Memory is then one row block of each kernel (twice for
a symmetric job's mirrored read), checked against the memory budget before anything is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ntk_service import analysis, wire
from ntk_service.config import Settings
from ntk_service.errors import InvalidInput, ShapeMismatch, operation_name
from ntk_service.jobs.results import ResultArray
from ntk_service.kernels import KernelMode
from ntk_service.server.analysis_schemas import spectrum_fields
from ntk_service.server.compute import ComputeLimiter
from ntk_service.server.computing import check_budget
from ntk_service.server.deps import ComputeDep, JobsDep, ReadAccess, SettingsDep
from ntk_service.server.media import json_response
from ntk_service.server.params import ID_MAX_LENGTH, INT64_MAX
from ntk_service.server.reading import read_object
from ntk_service.server.routes.jobs import JobIdParam
from ntk_service.server.schemas import TensorJson, openapi_body, validate_body

__all__ = ["router"]

router = APIRouter(tags=["jobs"])

_BLOCK_ROWS = 256
"""Rows of a stored kernel read at a time (memory: rows · M · k² float64, twice for a symmetric job)."""


class _RowReader:
    """``shape`` and ``[i:j]`` row slices of a job's result, the interface the analysis streams through."""

    def __init__(self, array: ResultArray) -> None:
        self.array = array
        self.shape = tuple(int(s) for s in array.shape)

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop = rows.start or 0, min(rows.stop if rows.stop is not None else self.shape[0], self.shape[0])
        return self.array.read(rows=(start, stop))


class JobSpectrumOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top: int | None = Field(
        default=20, ge=1, le=INT64_MAX, description="Top eigenvalues (Lanczos). null: all (dense eigh)."
    )
    method: Literal["auto", "eigh", "lanczos"] = Field(
        default="auto", description="lanczos: the top eigenvalues over row reads; eigh: load it whole; auto: by top."
    )


class JobAlignmentOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    variant: Literal["uncentered", "centered", "centered_vec_y", "rayleigh"] = Field(
        description="The kernel-target alignment variant."
    )


class JobAlignmentRequest(JobAlignmentOptions):
    """``POST /v1/jobs/{job_id}/alignment`` (documentation; the route decodes y with ``wire``)."""

    y: TensorJson = Field(description="Labels (N,) int64 or targets (N, c).")


class JobDistanceOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    other: str = Field(
        min_length=1,
        max_length=ID_MAX_LENGTH,
        description="The job whose kernel to compare with (same shape and mode).",
    )


def _open(manager: Any, job_id: str, *, square: bool) -> _RowReader:
    _, array = manager.open_result(job_id)
    mode = array.plan.mode
    if mode not in (KernelMode.FULL, KernelMode.TRACE):
        raise InvalidInput(detail=f"job {job_id} stored a {mode.value} kernel; analyses need a full or trace kernel")
    reader = _RowReader(array)
    if square and reader.shape[0] != reader.shape[1]:
        raise ShapeMismatch(
            detail=f"job {job_id} holds a {reader.shape} kernel; this analysis needs Θ(x, x) (N = M): "
            "submit the job without x2"
        )
    return reader


def _block_bytes(reader: _RowReader) -> int:
    per_row = int(np.prod(reader.shape[1:]))
    return 8 * _BLOCK_ROWS * per_row * 2  # a symmetric job's read also holds the mirrored band


async def _options(request: Request, model: type[BaseModel]) -> tuple[Any, dict[str, Any]]:
    """The body's options (``model``) and its arrays (``y``); the route's boundary names the errors."""
    data = await read_object(request)
    extra = {key: data.pop(key) for key in ("y",) if key in data}
    return validate_body(model, data), extra


_Plan = tuple[int, str, Callable[[], dict[str, Any]]]
"""What an analysis of a stored kernel needs before it runs: its memory estimate, what that estimate is of (for
the refusal), and the computation (returning the answer without its time)."""


async def _run(limiter: ComputeLimiter, settings: Settings, operation: str, plan: Callable[[], _Plan]) -> Response:
    """parse (done by the route) -> check the budget -> run, under the limiter: ``plan`` opens the job's kernel
    and returns its estimate and computation (errors named ``operation``); the answer gets ``analysis_ms``."""

    def run() -> dict[str, Any]:
        with operation_name(operation):
            estimate, what, compute = plan()
            check_budget(estimate, settings.memory_budget_bytes, what=what)
        start = time.perf_counter()
        answer = compute()
        return {**answer, "analysis_ms": round((time.perf_counter() - start) * 1000, 3)}

    return json_response(await limiter.run(run, operation=operation))


@router.post(
    "/v1/jobs/{job_id}/spectrum",
    summary="Spectrum of a finished job's kernel (Lanczos over row reads)",
    openapi_extra=openapi_body(JobSpectrumOptions),
)
async def job_spectrum(
    job_id: JobIdParam, request: Request, _: ReadAccess, manager: JobsDep, limiter: ComputeDep, settings: SettingsDep
) -> Response:
    operation = f"spectrum of job {job_id}"
    with operation_name(operation):
        options, _extra = await _options(request, JobSpectrumOptions)

    def plan() -> _Plan:
        reader = _open(manager, job_id, square=True)
        n = reader.shape[0] * (reader.shape[2] if len(reader.shape) == 4 else 1)
        dense = options.top is None or options.method == "eigh" or options.top >= n
        estimate = 8 * 4 * n * n if dense else _block_bytes(reader) + 8 * n * (2 * options.top + 2)

        def compute() -> dict[str, Any]:
            if dense:
                s = analysis.spectrum(reader[0 : reader.shape[0]], top=options.top, method="eigh")
            else:
                operator = analysis.stored_kernel_operator(reader, block_rows=_BLOCK_ROWS)
                s = analysis.spectrum(operator, top=options.top, method="lanczos")
            return {**spectrum_fields(s), "job": job_id}

        return estimate, f"the spectrum of a {n}x{n} kernel", compute

    return await _run(limiter, settings, operation, plan)


@router.post(
    "/v1/jobs/{job_id}/alignment",
    summary="Alignment of a finished job's kernel with labels or targets",
    openapi_extra=openapi_body(JobAlignmentRequest),
)
async def job_alignment(
    job_id: JobIdParam, request: Request, _: ReadAccess, manager: JobsDep, limiter: ComputeDep, settings: SettingsDep
) -> Response:
    operation = f"alignment of job {job_id}"
    with operation_name(operation):
        options, extra = await _options(request, JobAlignmentOptions)
        if "y" not in extra:
            raise InvalidInput(detail="the body needs y (labels (N,) int64 or targets (N, c)) and variant")
    y = wire.tensor_from_json(extra["y"], name="y")

    def plan() -> _Plan:
        reader = _open(manager, job_id, square=True)

        def compute() -> dict[str, Any]:
            value = analysis.alignment(reader, y, variant=options.variant, block_rows=_BLOCK_ROWS)
            return {"alignment": value, "variant": options.variant, "job": job_id}

        return _block_bytes(reader), "one row block", compute

    return await _run(limiter, settings, operation, plan)


@router.post(
    "/v1/jobs/{job_id}/distance",
    summary="Kernel distance and relative change to another job's kernel",
    openapi_extra=openapi_body(JobDistanceOptions),
)
async def job_distance(
    job_id: JobIdParam, request: Request, _: ReadAccess, manager: JobsDep, limiter: ComputeDep, settings: SettingsDep
) -> Response:
    operation = f"distance of job {job_id}"
    with operation_name(operation):
        options, _extra = await _options(request, JobDistanceOptions)

    def plan() -> _Plan:
        first = _open(manager, job_id, square=False)
        other = _open(manager, options.other, square=False)
        if first.shape != other.shape:
            raise ShapeMismatch(
                detail=f"job {job_id} holds {first.shape}, job {options.other} holds {other.shape}; compare "
                "kernels of the same inputs in the same mode"
            )

        def compute() -> dict[str, Any]:
            distance = analysis.kernel_distance(first, other, block_rows=_BLOCK_ROWS)
            change = analysis.relative_change(first, other, block_rows=_BLOCK_ROWS)
            return {"distance": distance, "relative_change": change, "job": job_id, "other": options.other}

        return 2 * _block_bytes(first), "two row blocks", compute

    return await _run(limiter, settings, operation, plan)
