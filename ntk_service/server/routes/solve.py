"""``POST /v1/models/{name}/solve``: kernel ridge, GP mean or linearized (t = ∞) predictions by the solver table
on inline examples (or data set slices), answered in the request: the small-N form of a solve job.

The same ``run_solve`` as a solve job (``jobs/solve_job.py``; ``solver`` "auto" by default), on the request's
arrays, under the compute limiter. Before anything is computed the targets are checked against the train rows and
the solver's memory estimate (O(P + N·k + its preconditioner); a dense solve's n² matrix) against the budget, with
the test predictions' m·k numbers. A solve that does not converge answers 200 with ``converged: false`` and its
``stop_reason``.

``POST /v1/models/{name}/ridge-estimate`` scores a grid of ridges by GCV and leave-one-out error from one Nyström
basis of the same operator (``estimate_ridge``, NOTE [ridge estimate]), no solve: the λ to send to a solve.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import anyio.to_thread
import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from ntk_service import wire
from ntk_service.analysis.solve import estimate_ridge
from ntk_service.errors import InvalidInput, operation_name
from ntk_service.jobs.solve_job import SolveOptions, check_targets, local_operators, run_solve, solve_estimate_bytes
from ntk_service.kernels.operators.streaming_operator import dataset_operator
from ntk_service.registry import ModelRecord
from ntk_service.server.computing import ComputeContextDep, KernelInput, answer_json, check_budget, load_side
from ntk_service.server.deps import ReadAccess
from ntk_service.server.params import INT64_MAX, MAX_GLOBS, Glob, NamePath
from ntk_service.server.reading import parse_side, read_object
from ntk_service.server.routes.solve_jobs import SolveFields
from ntk_service.server.schemas import openapi_body, validate_body

__all__ = ["RidgeEstimateFields", "router"]

router = APIRouter(tags=["analysis"])

_FIELDS = (
    "kind", "mode", "dtype", "params", "ridge", "rtol", "max_iterations", "preconditioner", "landmarks", "solver",
    "block_size", "inner_steps", "max_passes", "max_seconds", "seed",
)  # fmt: skip


@router.post(
    "/v1/models/{name}/solve",
    summary="Kernel ridge / GP mean / linearized (t = ∞) predictions by CG on the matrix-free kernel",
    openapi_extra=openapi_body(SolveFields),
)
async def solve(name: NamePath, request: Request, _: ReadAccess, ctx: ComputeContextDep) -> Response:
    with operation_name(f"solve of model {name!r}"):  # NOTE [operation names] in errors.py
        data = await read_object(request)
        raw = {key: data.pop(key) for key in ("x_train", "y_train", "x_test") if key in data}
        if raw.get("x_train") is None or raw.get("y_train") is None:
            raise InvalidInput(detail="the body needs x_train (a tensor or data set slice) and y_train (N, k)")
        body = validate_body(SolveFields, data)
        y = wire.tensor_from_json(raw["y_train"], name="y_train")
        settings = ctx.settings

        def prepare() -> tuple[ModelRecord, KernelInput, KernelInput | None]:
            record = ctx.registry.get(name, body.version)
            train = load_side(parse_side(raw["x_train"], side="x_train"), record, ctx.datasets,
                              side="x_train")  # fmt: skip
            test = None
            if raw.get("x_test") is not None:
                test = load_side(parse_side(raw["x_test"], side="x_test"), record, ctx.datasets,
                                 side="x_test")  # fmt: skip
            n, k = train.n, int(record.output_dim)
            m = 0 if test is None else test.n
            check_targets(y, n=n, k=k, name="y_train")
            _, module = ctx.registry.load_module(record.name, record.version)
            estimate = solve_estimate_bytes(options, local_operators(module, options)(train.array, None), n, k)
            check_budget(
                estimate + 16 * m * k,
                settings.memory_budget_bytes,
                what=f"a {options.solver} solve on {n} examples x {k} outputs",
                mode=body.mode,
            )
            return record, train, test

        options = SolveOptions(
            **{field: getattr(body, field) for field in _FIELDS}, memory_budget_bytes=settings.memory_budget_bytes
        )
        record, train, test = await anyio.to_thread.run_sync(prepare)

        def run() -> dict[str, Any]:
            _, module = ctx.registry.load_module(record.name, record.version)
            k = int(record.output_dim)
            targets = np.asarray(y, dtype=np.float64)
            outcome = run_solve(options, module, train.array, targets, None if test is None else test.array, k=k)
            return outcome.summary() | {
                "alpha": wire.tensor_to_json(outcome.alpha),
                "predictions": None if outcome.predictions is None else wire.tensor_to_json(outcome.predictions),
                "model": record.name,
                "version": record.version,
                "kind": options.kind,
                "mode": options.mode,
            }

        hint = "send fewer examples per request, or submit a solve job (POST /v1/solve-jobs)"
        return await answer_json(ctx.limiter, run, cap=settings.max_json_response_bytes, hint=hint)


class RidgeEstimateFields(BaseModel):
    """``POST /v1/models/{name}/ridge-estimate``: how to read the kernel and which ridges to score."""

    model_config = ConfigDict(extra="forbid")

    version: int | None = Field(None, ge=1, le=INT64_MAX, description="Model version. Default: the latest.")
    mode: Literal["full", "trace"] = Field("full", description="FULL kernel, or TRACE read as (Θ/k) ⊗ I_k.")
    dtype: Literal["float32", "float64"] = Field("float64", description="The operator products' dtype.")
    params: list[Glob] | None = Field(None, max_length=MAX_GLOBS, description="Parameter globs; null = all.")
    ridges: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(
        None, min_length=1, max_length=1000, description="Absolute λ's to score. Default: 1e-6 … 1 × Θ's mean diagonal."
    )
    rank: int | None = Field(None, ge=1, le=100_000, description="Nyström rank cap. Default: adaptive.")
    seed: int = Field(0, ge=0, le=INT64_MAX, description="The pivots' generator.")


@router.post(
    "/v1/models/{name}/ridge-estimate",
    summary="GCV and leave-one-out error along a grid of ridges, from one Nyström basis (no solve)",
    openapi_extra=openapi_body(RidgeEstimateFields),
)
async def ridge_estimate(name: NamePath, request: Request, _: ReadAccess, ctx: ComputeContextDep) -> Response:
    """``estimate_ridge`` (docs/analysis.md, "Choosing the ridge") on ``x_train`` (a JSON tensor or a data set
    slice) and ``y_train`` (N, k): the ridge to pass to a solve, chosen without a dense kernel or a solve."""
    with operation_name(f"ridge estimate of model {name!r}"):  # NOTE [operation names] in errors.py
        data = await read_object(request)
        raw = {key: data.pop(key) for key in ("x_train", "y_train") if key in data}
        if raw.get("x_train") is None or raw.get("y_train") is None:
            raise InvalidInput(detail="the body needs x_train (a tensor or data set slice) and y_train (N, k)")
        body = validate_body(RidgeEstimateFields, data)
        y = wire.tensor_from_json(raw["y_train"], name="y_train")
        settings = ctx.settings

        def prepare() -> tuple[ModelRecord, KernelInput]:
            record = ctx.registry.get(name, body.version)
            train = load_side(parse_side(raw["x_train"], side="x_train"), record, ctx.datasets, side="x_train")
            check_targets(y, n=train.n, k=int(record.output_dim), name="y_train")
            return record, train

        record, train = await anyio.to_thread.run_sync(prepare)

        def run() -> dict[str, Any]:
            _, module = ctx.registry.load_module(record.name, record.version)
            op = dataset_operator(module, train.array, mode=body.mode, params=body.params, dtype=body.dtype,
                                  memory_budget_bytes=settings.memory_budget_bytes)  # fmt: skip
            targets = check_targets(y, n=train.n, k=int(record.output_dim), name="y_train")
            est = estimate_ridge(op, targets, ridges=body.ridges, rank=body.rank, seed=body.seed,
                                 memory_budget_bytes=settings.memory_budget_bytes)  # fmt: skip
            return {
                "ridges": est.ridges.tolist(),
                "gcv": est.gcv.tolist(),
                "loo": est.loo.tolist(),
                "best_gcv": est.best_gcv,
                "best_loo": est.best_loo,
                "method": est.method,
                "rank": est.rank,
                "floor": est.floor,
                "mean_diagonal": est.mean_diagonal,
                "model": record.name,
                "version": record.version,
                "mode": body.mode,
            }

        return await answer_json(ctx.limiter, run, cap=settings.max_json_response_bytes, hint="use fewer ridges")
