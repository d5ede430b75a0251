"""``POST /v1/models/{name}/solve``: kernel ridge, GP mean or linearized (t = ∞) predictions by the solver table
on inline examples (or data set slices), answered in the request: the small-N form of a solve job.

The same ``run_solve`` as a solve job (``jobs/solve_job.py``; ``solver`` "auto" by default), on the request's
arrays, under the compute limiter. Before anything is computed the targets are checked against the train rows and
the solver's memory estimate (O(P + N·k + its preconditioner); a dense solve's n² matrix) against the budget, with
the test predictions' m·k numbers. A solve that does not converge answers 200 with ``converged: false`` and its
``stop_reason``.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from ntk_service import wire
from ntk_service.errors import InvalidInput, operation_name
from ntk_service.jobs.solve_job import SolveOptions, check_targets, local_operators, run_solve, solve_estimate_bytes
from ntk_service.registry import ModelRecord
from ntk_service.server.computing import ComputeContextDep, KernelInput, answer_json, check_budget, load_side
from ntk_service.server.deps import ReadAccess
from ntk_service.server.params import NamePath
from ntk_service.server.reading import parse_side, read_object
from ntk_service.server.routes.solve_jobs import SolveFields
from ntk_service.server.schemas import openapi_body, validate_body

__all__ = ["router"]

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
