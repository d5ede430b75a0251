"""Solve jobs over HTTP: kernel ridge, GP mean or linearized predictions at t = ∞ on stored data sets, by the
solver table (``jobs/kinds/solve.py``; ``solver`` "auto" by default): the route schema, the standard job routes
(``server/job_routes.py``) and the result.

    POST   /v1/solve-jobs              202 + Location: the queued job
    GET    /v1/solve-jobs              {"data": [job, ...], "count"}
    GET    /v1/solve-jobs/{id}         the job: progress {solver, iterations, epochs, residual, passes, heldout,
                                       heldout_curve, elapsed_s, ...} while it runs; result {converged,
                                       stop_reason, solver, attempts, iterations, passes, residual, heldout_curve,
                                       time_s, memory_bytes, peak_rss_bytes, ...} after
    GET    /v1/solve-jobs/{id}/events  text/event-stream: a "progress" event per change, "end" when finished
    GET    /v1/solve-jobs/{id}/result  alpha (n, k) and predictions (m, k): JSON (with the CG report) or
                                       safetensors (the report in its metadata); 409 until succeeded
    DELETE /v1/solve-jobs/{id}         cancel a queued or running job (the solve stops before its next pass);
                                       delete a finished one with its arrays (?cancel_only=true: only cancel)

A solve stopped with the server goes on from its last checkpoint at the next start, to the bits of an uninterrupted
run (NOTE [solve resume]).

A solve that did not converge is a succeeded job whose result says ``converged: false`` and its ``stop_reason``;
the result route repeats both beside the arrays, so no download hides it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import anyio.to_thread
import numpy as np
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ntk_service import wire
from ntk_service.analysis.solve.block import DEFAULT_BLOCK_SIZE, DEFAULT_INNER_STEPS, MAX_BLOCK_ROWS
from ntk_service.analysis.solve.problem import FLOAT32_FLOOR
from ntk_service.errors import PayloadTooLarge, ResultNotFound, format_bytes
from ntk_service.jobs.kinds.rows import DataRows
from ntk_service.jobs.kinds.solve import SOLVE_KIND, HeldOutRequest, SolveRequest, read_solution
from ntk_service.server.deps import JobsDep, ReadAccess, SettingsDep
from ntk_service.server.job_routes import JSON_BYTES_PER_VALUE, JobIdPath, JobRouteText, job_router
from ntk_service.server.media import json_response, negotiate
from ntk_service.server.params import ID_MAX_LENGTH, INT64_MAX, MAX_GLOBS, Glob

__all__ = ["SolveFields", "SolveHeldOut", "SolveJobCreate", "SolveRows", "router"]

MAX_PROGRESS_EVERY = 100_000
"""The most CG iterations one segment may take (a larger value is the same single run)."""

MAX_INNER_STEPS = 1000
"""The most CG steps on one block's system (each a JVP and a VJP over the block)."""

MAX_LANDMARKS = 100_000
"""The largest Nyström rank or landmark count."""


class SolveRows(BaseModel):
    """A stored data set, or a row range of it."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Data set id from POST /v1/datasets.")
    start: int | None = Field(None, ge=0, le=INT64_MAX, description="First row. Default: 0.")
    stop: int | None = Field(None, ge=1, le=INT64_MAX, description="One past the last row. Default: all rows.")

    def rows(self) -> DataRows:
        return DataRows(self.dataset, self.start, self.stop)


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
    ridge: float = Field(
        gt=0, allow_inf_nan=False, description="λ > 0 added to Θ's diagonal (absolute); e.g. 1e-3 × Θ's mean diagonal."
    )
    solver: Literal["auto", "dense", "pcg", "block", "cg", "direct"] = Field(
        "auto",
        description="auto (dense where it fits, then preconditioned CG, then the parameter-space block method: "
        "docs/analysis.md), dense (Cholesky), pcg (CG with an adaptive Nyström preconditioner), block (the "
        "parameter-space block method, FULL). cg and direct: older names of pcg and dense.",
    )
    rtol: float | None = Field(
        None,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="True relative residual to stop at. Default: 1e-8 for float64 products, 1e-4 for float32 "
        f"(below {FLOAT32_FLOOR:g} refused for float32: the products' rounding floor).",
    )
    max_passes: float | None = Field(
        None, gt=0, le=1e7, allow_inf_nan=False, description="Passes over the train rows at most. Default: none."
    )
    max_seconds: float | None = Field(
        None, gt=0, le=1e7, allow_inf_nan=False, description="Wall time at most (stop_reason time_limit)."
    )
    block_size: int | None = Field(
        None, ge=1, le=MAX_BLOCK_ROWS, description=f"Examples per block (block). Default: {DEFAULT_BLOCK_SIZE}."
    )
    inner_steps: int | None = Field(
        None, ge=1, le=MAX_INNER_STEPS, description=f"CG steps per block (block). Default: {DEFAULT_INNER_STEPS}."
    )
    seed: int = Field(0, ge=0, le=INT64_MAX, description="Block order and landmark choice.")
    max_iterations: int | None = Field(
        None, ge=0, le=10_000_000, description="CG iterations at most (pcg). Default: min(10·rows, 2000)."
    )
    preconditioner: Literal["auto", "nystrom", "none"] = Field(
        "auto", description="pcg's: auto (the adaptive Nyström factor from the model), nystrom (m landmarks), none."
    )
    landmarks: int | None = Field(
        None, ge=1, le=MAX_LANDMARKS, description="Nyström rank cap (pcg) or landmarks per block (block)."
    )


class SolveHeldOut(BaseModel):
    """A held-out set scored after every epoch (CG: iteration): its curve is in the live progress and the result."""

    model_config = ConfigDict(extra="forbid")

    inputs: SolveRows = Field(description="The held-out inputs: M rows, the train rows' shape.")
    targets: SolveRows = Field(description="Their targets: M rows of (k,), or (M,) class indices for accuracy.")
    metric: Literal["accuracy", "mse"] = Field("accuracy", description="accuracy (argmax) or mse.")
    patience: int | None = Field(
        None, ge=1, le=1_000_000, description="Stop when the metric has not improved in this many evaluations."
    )
    every: int = Field(1, ge=1, le=1_000_000, description="Score every this many epochs (CG: iterations).")


class SolveJobCreate(SolveFields):
    """``POST /v1/solve-jobs``: solve (Θ + λI) α = y − f0 on the train rows, predict on the test rows."""

    model: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Registered model name.")
    train: SolveRows = Field(description="The train rows: N examples.")
    targets: SolveRows = Field(description="y: N rows of shape (k,) (or scalars for k = 1), aligned with train.")
    test: SolveRows | None = Field(None, description="The test rows (M examples); null: alpha only.")
    heldout: SolveHeldOut | None = Field(None, description="A held-out set scored per epoch; null: none.")
    progress_every: int | None = Field(
        None, ge=1, le=MAX_PROGRESS_EVERY, description="CG iterations between checkpoints (pcg's warm restarts)."
    )
    examples_per_chunk: int | None = Field(None, ge=1, le=1_000_000, description="Rows per read of the data sets.")


def _request(body: SolveJobCreate) -> SolveRequest:
    fields = body.model_dump(exclude={"train", "targets", "test", "heldout"})
    test = None if body.test is None else body.test.rows()
    held = body.heldout
    heldout = None
    if held is not None:
        heldout = HeldOutRequest(held.inputs.rows(), held.targets.rows(), held.metric, held.patience, held.every)
    return SolveRequest(**fields, train=body.train.rows(), targets=body.targets.rows(), test=test, heldout=heldout)


router = job_router(
    SOLVE_KIND,
    create=SolveJobCreate,
    request_of=_request,
    text=JobRouteText(
        noun="solve",
        tag="solve jobs",
        progress="its solver progress and held-out curve",
        cancel="the solve stops before its next pass",
        delete="its arrays",
    ),
)


@router.get("/{job_id}/result", summary="A solve job's alpha and test predictions")
async def solve_job_result(
    request: Request, job_id: JobIdPath, _: ReadAccess, manager: JobsDep, settings: SettingsDep
) -> Response:
    operation = f"GET /v1/solve-jobs/{job_id}/result"
    media = negotiate(request, (wire.MEDIA_JSON, wire.MEDIA_SAFETENSORS), operation=operation)

    def read() -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        with manager.reading(job_id):
            record, folder = manager.succeeded(job_id, SOLVE_KIND)
            alpha, predictions = read_solution(folder)
        arrays = {"alpha": alpha} | ({} if predictions is None else {"predictions": predictions})
        if record.result is None:  # written with the status, so only a store edited by hand lacks it
            raise ResultNotFound(f"{operation}: the report of solve job {job_id} is missing; submit the job again")
        return SOLVE_KIND.encode_result(record.result), arrays

    report, arrays = await anyio.to_thread.run_sync(read)
    if media == wire.MEDIA_SAFETENSORS:
        metadata = {"result": wire.json_dumps(report).decode()}
        return Response(wire.encode_safetensors(arrays, metadata), media_type=wire.MEDIA_SAFETENSORS)
    values = sum(math.prod(a.shape) for a in arrays.values())
    limit = settings.max_json_response_bytes
    if values * JSON_BYTES_PER_VALUE > limit:
        raise PayloadTooLarge(
            f"{operation}: the result holds {values} numbers (about {format_bytes(values * JSON_BYTES_PER_VALUE)} "
            f"as JSON), over the JSON response limit of {format_bytes(limit)}; ask for Accept: "
            "application/x-safetensors"
        )
    return json_response(report | {name: wire.tensor_to_json(array) for name, array in arrays.items()})
