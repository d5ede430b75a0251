"""``POST /v1/models/{name}/predict | spectrum | compare``: what Θ says, computed next to the model.

The server computes every kernel itself, in float64, through the same engine path as ``/ntk`` (off the event loop
under the compute limiter, with the side cache and the memory budget), then runs ``ntk_service.analysis``: nothing
N×N crosses the wire. Before anything is computed the inputs are checked (shapes, targets' length and width) and
the analysis's own memory (the float64 kernels and the eigh workspace) is compared with the budget.
"""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread
import numpy as np
import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from ntk_service import analysis, wire
from ntk_service.analysis.cross_entropy import check_cross_entropy_plan, class_indices
from ntk_service.errors import InvalidInput, PayloadTooLarge, ShapeMismatch, format_bytes, operation_name
from ntk_service.kernels import KernelSpec, NtkResult, ntk_operator
from ntk_service.kernels.spec import SpecKeywords, resolve_spec
from ntk_service.registry import DatasetStore, ModelRecord, ModelRegistry
from ntk_service.registry.input_contract import check_output, output_size
from ntk_service.server.analysis_schemas import (
    AnalysisKernelOptions,
    CompareOptions,
    CompareRequest,
    PredictOptions,
    PredictRequest,
    SpectrumOptions,
    SpectrumRequest,
    VersionRef,
    json_float,
    spectrum_fields,
)
from ntk_service.server.computing import (
    ComputeContext,
    ComputeContextDep,
    KernelInput,
    answer_json,
    check_budget,
    load_side,
    run_kernel,
    run_model,
)
from ntk_service.server.deps import ReadAccess
from ntk_service.server.media import MIN_JSON_BYTES_PER_VALUE
from ntk_service.server.params import NamePath
from ntk_service.server.reading import engine_options, parse_side, read_object
from ntk_service.server.schemas import openapi_body, validate_body

__all__ = ["router"]

router = APIRouter(tags=["analysis"])


async def _read(request: Request, tensors: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The raw tensor fields named in ``tensors`` (absent or null ones omitted) and the remaining option fields."""
    data = await read_object(request)
    raw = {key: data.pop(key) for key in tensors if data.get(key) is not None}
    for key in tensors:
        data.pop(key, None)
    return raw, data


def _side(raw: Any, label: str, record: ModelRecord, datasets: DatasetStore) -> KernelInput:
    parsed = parse_side(raw, side=label)
    return load_side(parsed, record, datasets, side=label)


def _kernel_spec(options: AnalysisKernelOptions | CompareOptions) -> KernelSpec:
    """What an analysis's kernel is: the request's mode ("full" | "trace"), params and output."""
    output = getattr(options, "output", None)  # compare's records all return one tensor
    return resolve_spec(None, SpecKeywords(mode=options.mode, params=options.params, output=output))


def _theta(
    ctx: ComputeContext,
    module: torch.nn.Module,
    x1: KernelInput,
    x2: KernelInput | None,
    options: AnalysisKernelOptions | CompareOptions,
    *,
    record: ModelRecord,
) -> np.ndarray:
    """Θ(x1, x2) of ``record`` in float64 through the engine path of ``/ntk`` (side cache, memory budget), on the
    CPU without TF32 (the analyses' float64 linear algebra runs there)."""
    how = engine_options(ctx.settings, implementation=options.implementation, dtype="float64")
    how = how.replace(device="cpu", allow_tf32=False)
    spec = _kernel_spec(options)
    result, _ = run_kernel(module, x1, x2, spec, how, record=record, side_cache=ctx.side_cache)
    assert isinstance(result, NtkResult)  # no groups in an analysis
    return np.asarray(result.theta.detach().cpu().numpy(), dtype=np.float64)


@router.post(
    "/v1/models/{name}/predict",
    summary="Outputs of the linearized network trained by gradient flow / descent, at the given times",
    openapi_extra=openapi_body(PredictRequest),
)
async def predict(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    ctx: ComputeContextDep,
) -> Response:
    operation = f"predict of model {name!r}"
    with operation_name(operation):  # NOTE [operation names] in errors.py
        raw, rest = await _read(request, ("x_train", "y_train", "x_test"))
        if "x_train" not in raw or "y_train" not in raw:
            raise InvalidInput(
                detail="the body needs x_train (a tensor or data set slice) and y_train (N, k), or (N,) int64 "
                "class indices for loss='cross_entropy'"
            )
        options = validate_body(PredictOptions, rest)
        y_train = wire.tensor_from_json(raw["y_train"], name="y_train")
        path = _kernel_spec(options).output_path

        settings = ctx.settings

        def prepare() -> tuple[ModelRecord, KernelInput, KernelInput | None]:
            record = ctx.registry.get(name, options.version)
            check_output(options.output, record)
            train = _side(raw["x_train"], "x_train", record, ctx.datasets)
            test = _side(raw["x_test"], "x_test", record, ctx.datasets) if "x_test" in raw else None
            n, k = train.n, output_size(path, record)
            m = 0 if test is None else test.n
            if options.loss == "cross_entropy":  # class indices, checked before any kernel is computed
                class_indices(y_train, n=n, k=k, name="y_train", operation=operation)
                check_cross_entropy_plan(
                    options.time_values(), options.flow, n=n, m=m, k=k, full=options.mode == "full", operation=operation
                )
            elif y_train.shape not in ((n, k),) + (((n,),) if k == 1 else ()):
                raise ShapeMismatch(
                    detail=f"y_train has shape {y_train.shape}; x_train has {n} examples and model {name!r} "
                    f"{k} outputs, so send y_train of shape ({n}, {k})"
                )
            values = (len(options.times) + 1) * (n + m) * k  # train/test at each time, plus f0
            if values * MIN_JSON_BYTES_PER_VALUE > settings.max_json_response_bytes:
                raise PayloadTooLarge(
                    detail=f"{values} output values would take at least "
                    f"{format_bytes(values * MIN_JSON_BYTES_PER_VALUE)} of JSON, over the server's limit of "
                    f"{format_bytes(settings.max_json_response_bytes)} (NTK_MAX_JSON_RESPONSE_BYTES); ask for fewer "
                    "times or fewer examples per request"
                )
            size = n * k if options.mode == "full" else n
            check_budget(
                analysis.linearized_memory_bytes(n, m, k, full=options.mode == "full"),
                settings.memory_budget_bytes,
                what=f"the analysis of a {size}x{size} kernel",
                mode=options.mode,
            )
            return record, train, test

        record, train, test = await anyio.to_thread.run_sync(prepare)

        def run() -> dict[str, Any]:
            module = ctx.registry.module(record)
            start = time.perf_counter()
            theta = _theta(ctx, module, train, None, options, record=record)
            theta_test = None
            if test is not None:
                theta_test = _theta(ctx, module, test, train, options, record=record)
            f0_train = analysis.outputs_float64(module, train.to_torch(record), output=path)
            f0_test = None if test is None else analysis.outputs_float64(module, test.to_torch(record), output=path)
            kernel_s = time.perf_counter() - start
            start = time.perf_counter()
            out = analysis.linearized_predictions(
                theta,
                y_train,
                times=options.time_values(),
                learning_rate=options.learning_rate,
                loss=options.loss,
                k_test_train=theta_test,
                f0_train=f0_train,
                f0_test=f0_test,
                ridge=options.ridge,
                ridge_scale=options.ridge_scale,
                flow=options.flow,
            )
            analysis_s = time.perf_counter() - start
            return {
                "train": wire.tensor_to_json(out.train),
                "test": None if out.test is None else wire.tensor_to_json(out.test),
                "f0_train": wire.tensor_to_json(f0_train),
                "f0_test": None if f0_test is None else wire.tensor_to_json(f0_test),
                "times": [json_float(t) for t in out.times.tolist()],
                "lambda_min": out.lambda_min,
                "lambda_max": out.lambda_max,
                "frozen_modes": out.frozen_modes,
                "tol": out.tol,
                "path": out.path,
                "max_learning_rate": json_float(out.max_learning_rate),
                "rtol": out.rtol,
                "atol": out.atol,
                "mode": options.mode,
                "model": record.name,
                "version": record.version,
                "kernel_ms": round(kernel_s * 1000, 3),
                "analysis_ms": round(analysis_s * 1000, 3),
            }

        hint = "ask for fewer times or fewer test examples per request"
        return await answer_json(ctx.limiter, run, cap=settings.max_json_response_bytes, hint=hint)


@router.post(
    "/v1/models/{name}/spectrum",
    summary="Eigenvalues, condition number and effective ranks of Θ(x, x)",
    openapi_extra=openapi_body(SpectrumRequest),
)
async def kernel_spectrum(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    ctx: ComputeContextDep,
) -> Response:
    with operation_name(f"spectrum of model {name!r}"):  # NOTE [operation names] in errors.py
        raw, rest = await _read(request, ("x",))
        if "x" not in raw:
            raise InvalidInput(detail="the body needs x (a tensor or data set slice)")
        options = validate_body(SpectrumOptions, rest)
        if options.ridges and options.top is not None:
            raise InvalidInput(detail="ridges (effective_dof) need every eigenvalue; drop top or the ridges")
        if options.method == "operator" and options.top is None:
            raise InvalidInput(detail="method 'operator' finds the top eigenvalues only; give top (e.g. top=10)")
        spec = _kernel_spec(options)
        settings = ctx.settings

        def prepare() -> tuple[ModelRecord, KernelInput]:
            record = ctx.registry.get(name, options.version)
            check_output(options.output, record)
            x = _side(raw["x"], "x", record, ctx.datasets)
            size = x.n * (output_size(spec.output_path, record) if options.mode == "full" else 1)
            matrix_free = options.method == "operator"  # the operator's own plan is checked when it is built
            if matrix_free and options.top is not None and options.top >= size:
                raise InvalidInput(
                    detail=f"top={options.top} must be below the kernel's size {size} for method 'operator'; "
                    "for every eigenvalue use method 'eigh'"
                )
            estimate = analysis.spectrum_memory_bytes(
                size, top=options.top, method=options.method, operator=matrix_free
            )
            what = (
                f"the Lanczos basis of a {size}x{size} operator"
                if matrix_free
                else f"the spectrum of a {size}x{size} kernel"
            )
            check_budget(estimate, settings.memory_budget_bytes, what=what, mode=options.mode)
            return record, x

        record, x = await anyio.to_thread.run_sync(prepare)

        def run() -> dict[str, Any]:
            module = ctx.registry.module(record)
            start = time.perf_counter()
            if options.method == "operator":

                def matrix_free() -> analysis.Spectrum:
                    # float64 products, as the dense path's float64 kernel; the Lanczos steps are all the cost
                    how = engine_options(settings, dtype="float64").replace(device=None)  # where the module is
                    op = ntk_operator(module, x.to_torch(record), spec=spec, options=how)
                    return analysis.spectrum(op, top=options.top)

                s, _ = run_model(matrix_free, record=record)
                kernel_s = 0.0  # never formed
            else:
                theta = _theta(ctx, module, x, None, options, record=record)
                kernel_s = time.perf_counter() - start
                start = time.perf_counter()
                s = analysis.spectrum(theta, top=options.top, method=options.method)
            body = {
                **spectrum_fields(s),
                "ranks": {
                    "entropy": s.entropy,
                    "participation_ratio": s.participation_ratio,
                    "stable_rank": s.stable_rank,
                    "numerical_rank": s.numerical_rank,
                },
                "effective_dof": [{"ridge": r, "value": s.effective_dof(r)} for r in options.ridges],
                "mode": options.mode,
                "model": record.name,
                "version": record.version,
                "kernel_ms": round(kernel_s * 1000, 3),
                "analysis_ms": round((time.perf_counter() - start) * 1000, 3),
            }
            return body

        hint = "ask for the top eigenvalues"
        return await answer_json(ctx.limiter, run, cap=settings.max_json_response_bytes, hint=hint)


def _rekey(x: KernelInput, record: ModelRecord) -> KernelInput:
    """The same inputs keyed for another version: side-cache keys start with the version's 4-part cache_key.
    Inline inputs have no key (they are never cached) and stay as they are."""
    if x.key is None:
        return x
    return KernelInput(x.array, (*record.cache_key, *tuple(x.key)[len(record.cache_key) :]))  # type: ignore[arg-type]


def _resolve(name: str, versions: list[int | VersionRef], registry: ModelRegistry) -> list[ModelRecord]:
    """The records to compare; all must share the architecture (same parameters, same outputs)."""
    records = [registry.get(name, v) if isinstance(v, int) else registry.get(v.model, v.version) for v in versions]
    first = records[0]
    for other in records[1:]:
        if other.architecture != first.architecture or other.parameters != first.parameters:
            raise InvalidInput(
                detail=f"model {other.name!r} v{other.version} has architecture {other.architecture}, "
                f"model {first.name!r} v{first.version} has {first.architecture}; compare versions of one "
                "architecture (checkpoints of one model)"
            )
    return records


@router.post(
    "/v1/models/{name}/compare",
    summary="Kernel distances between versions (checkpoints), relative change from the first, and alignment",
    openapi_extra=openapi_body(CompareRequest),
)
async def compare(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    ctx: ComputeContextDep,
) -> Response:
    with operation_name(f"compare of model {name!r}"):  # NOTE [operation names] in errors.py
        raw, rest = await _read(request, ("x", "y"))
        if "x" not in raw:
            raise InvalidInput(detail="the body needs x (the probe inputs, a tensor or data set slice)")
        options = validate_body(CompareOptions, rest)
        if ("y" in raw) != (options.variant is not None):
            raise InvalidInput(
                detail="alignment needs both y (labels or targets) and variant "
                "('uncentered' | 'centered' | 'centered_vec_y' | 'rayleigh'); give both or neither"
            )
        y = None if "y" not in raw else wire.tensor_from_json(raw["y"], name="y")

        settings = ctx.settings

        def prepare() -> tuple[list[ModelRecord], KernelInput]:
            records = _resolve(name, options.versions, ctx.registry)
            x = _side(raw["x"], "x", records[0], ctx.datasets)
            n = x.n
            if y is not None and (y.ndim not in (1, 2) or y.shape[0] != n):
                raise ShapeMismatch(detail=f"y has shape {y.shape}; x has {n} examples, send y with {n} rows")
            size = n * (records[0].output_dim if options.mode == "full" else 1)
            check_budget(
                analysis.distances_memory_bytes(len(records), size),
                settings.memory_budget_bytes,
                what=f"{len(records)} kernels of {size}x{size}",
                mode=options.mode,
            )
            return records, x

        records, x = await anyio.to_thread.run_sync(prepare)

        def run() -> dict[str, Any]:
            start = time.perf_counter()
            kernels = []
            for record in records:
                module = ctx.registry.module(record)
                kernels.append(_theta(ctx, module, _rekey(x, record), None, options, record=record))
            kernel_s = time.perf_counter() - start
            start = time.perf_counter()
            count = len(kernels)
            distance = np.zeros((count, count))
            for i in range(count):
                for j in range(i + 1, count):
                    distance[i, j] = distance[j, i] = analysis.kernel_distance(kernels[i], kernels[j])
            change = [analysis.relative_change(kernels[0], kernel) for kernel in kernels]
            aligned = None
            if y is not None and options.variant is not None:
                aligned = [analysis.alignment(kernel, y, variant=options.variant) for kernel in kernels]
            return {
                "versions": [{"model": r.name, "version": r.version} for r in records],
                "distance": wire.tensor_to_json(distance),
                "relative_change": change,
                "alignment": aligned,
                "variant": options.variant,
                "mode": options.mode,
                "kernel_ms": round(kernel_s * 1000, 3),
                "analysis_ms": round((time.perf_counter() - start) * 1000, 3),
            }

        hint = "compare fewer versions"
        return await answer_json(ctx.limiter, run, cap=settings.max_json_response_bytes, hint=hint)
