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
from torch.func import functional_call

from ntk_service import analysis, wire
from ntk_service.analysis.spectrum import DENSE_MAX_SIZE
from ntk_service.errors import (
    InvalidInput,
    MalformedRequest,
    MemoryEstimateExceeded,
    PayloadTooLarge,
    ShapeMismatch,
    format_bytes,
)
from ntk_service.kernels import default_memory_budget
from ntk_service.registry import DatasetStore, ModelRecord, ModelRegistry
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
)
from ntk_service.server.deps import ComputeDep, DatasetsDep, ReadAccess, RegistryDep, SettingsDep, SideCacheDep
from ntk_service.server.media import json_response, read_json
from ntk_service.server.params import NamePath
from ntk_service.server.routes.kernels import _check_input, _compute, _from_dataset, _inline, _Input, _parse_x
from ntk_service.server.schemas import DatasetRef, KernelOptions, openapi_body, validate_body

__all__ = ["router"]

router = APIRouter(tags=["analysis"])

_MIN_JSON_BYTES_PER_VALUE = 4
"""The shortest a float can be in JSON ("0.0,"): an answer whose value count times this exceeds the JSON cap is
refused before computing."""

_PREDICT_COPIES = 5
"""n×n float64 arrays alive at the peak of /predict: the engine's kernel, the analysis's matrix, and eigh's copy,
eigenvectors and workspace (LAPACK's divide and conquer needs ~2·n² more); Θ(test, train) counts twice (the
engine's and the matrix)."""

_SPECTRUM_COPIES = {"eigh": 3, "lanczos": 2}
"""n×n float64 arrays alive in /spectrum: the engine's kernel and the matrix, plus eigvalsh's copy for eigh."""


async def _read(request: Request, tensors: tuple[str, ...], *, operation: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The raw tensor fields named in ``tensors`` (absent ones omitted) and the remaining option fields."""
    data = await read_json(request, operation=operation)
    if not isinstance(data, dict):
        raise MalformedRequest(f"{operation}: expected a JSON object, got {type(data).__name__}")
    raw = {key: data.pop(key) for key in tensors if data.get(key) is not None}
    for key in tensors:
        data.pop(key, None)
    return raw, data


def _side(raw: Any, label: str, record: ModelRecord, datasets: DatasetStore, operation: str) -> _Input:
    parsed = _parse_x(raw, side=label, operation=operation)
    item = _from_dataset(parsed, record, datasets) if isinstance(parsed, DatasetRef) else _inline(parsed)
    _check_input(item.array, record, side=label, operation=operation)
    return item


def _check_budget(estimate: int, budget: int | None, *, what: str, operation: str) -> None:
    limit = default_memory_budget() if budget is None else budget
    if estimate > limit:
        raise MemoryEstimateExceeded(
            f"{operation}: {what} needs about {format_bytes(estimate)} in float64, over the memory budget of "
            f"{format_bytes(limit)} (NTK_MEMORY_BUDGET_BYTES); use fewer examples or mode 'trace'",
            estimate_bytes=estimate,
            budget_bytes=limit,
        )


def _kernel_options(options: AnalysisKernelOptions | CompareOptions, version: int | None) -> KernelOptions:
    return KernelOptions(
        mode=options.mode,  # "full" | "trace", wire values of KernelMode
        implementation=options.implementation,
        params=options.params,
        dtype="float64",
        version=version,
    )


def _theta(module: torch.nn.Module, x1: _Input, x2: _Input | None, options: KernelOptions, **kw: Any) -> np.ndarray:
    result, _ = _compute(module, x1, x2, options, **kw)
    return np.asarray(result.theta.detach().cpu().numpy(), dtype=np.float64)


def _forward64(module: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    """f(x) in float64, (N, k), without touching the shared module (float copies of its tensors)."""
    tensors = {
        name: t.detach().to(torch.float64) if t.is_floating_point() else t.detach()
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    }
    xt = torch.from_numpy(x)
    xt = xt.to(torch.float64) if xt.is_floating_point() else xt
    with torch.no_grad():
        out = functional_call(module, tensors, (xt,))
    return np.asarray(out.reshape(x.shape[0], -1).numpy(), dtype=np.float64)


def _respond(body: dict[str, Any], cap: int, *, operation: str, hint: str) -> Response:
    response = json_response(body)
    if len(response.body) > cap:
        raise PayloadTooLarge(
            f"{operation}: the response would be {format_bytes(len(response.body))}, over the server's JSON limit "
            f"of {format_bytes(cap)} (NTK_MAX_JSON_RESPONSE_BYTES); {hint}"
        )
    return response


@router.post(
    "/v1/models/{name}/predict",
    summary="Outputs of the linearized network trained by gradient flow / descent, at the given times",
    openapi_extra=openapi_body(PredictRequest),
)
async def predict(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    registry: RegistryDep,
    datasets: DatasetsDep,
    limiter: ComputeDep,
    side_cache: SideCacheDep,
    settings: SettingsDep,
) -> Response:
    operation = f"predict of model {name!r}"
    raw, rest = await _read(request, ("x_train", "y_train", "x_test"), operation=operation)
    if "x_train" not in raw or "y_train" not in raw:
        raise InvalidInput(f"{operation}: the body needs x_train (a tensor or data set slice) and y_train (N, k)")
    options = validate_body(PredictOptions, rest, operation=operation)
    y_train = wire.tensor_from_json(raw["y_train"], name="y_train")

    def prepare() -> tuple[ModelRecord, _Input, _Input | None]:
        record = registry.get(name, options.version)
        train = _side(raw["x_train"], "x_train", record, datasets, operation)
        test = _side(raw["x_test"], "x_test", record, datasets, operation) if "x_test" in raw else None
        n, k = train.array.shape[0], record.output_dim
        if y_train.shape not in ((n, k),) + (((n,),) if k == 1 else ()):
            raise ShapeMismatch(
                f"{operation}: y_train has shape {y_train.shape}; x_train has {n} examples and model {name!r} "
                f"{k} outputs, so send y_train of shape ({n}, {k})"
            )
        m = 0 if test is None else test.array.shape[0]
        size = n * k if options.mode == "full" else n
        cross = m * k * n * k if options.mode == "full" else m * n
        values = (len(options.times) + 1) * (n + m) * k  # train/test at each time, plus f0
        if values * _MIN_JSON_BYTES_PER_VALUE > settings.max_json_response_bytes:
            raise PayloadTooLarge(
                f"{operation}: {values} output values would take at least "
                f"{format_bytes(values * _MIN_JSON_BYTES_PER_VALUE)} of JSON, over the server's limit of "
                f"{format_bytes(settings.max_json_response_bytes)} (NTK_MAX_JSON_RESPONSE_BYTES); ask for fewer "
                "times or fewer examples per request"
            )
        _check_budget(
            8 * (_PREDICT_COPIES * size * size + 2 * cross),
            settings.memory_budget_bytes,
            what=f"the analysis of a {size}x{size} kernel",
            operation=operation,
        )
        return record, train, test

    record, train, test = await anyio.to_thread.run_sync(prepare)
    kernel_options = _kernel_options(options, record.version)

    def run() -> dict[str, Any]:
        _, module = registry.load_module(record.name, record.version)
        kw = {
            "record": record,
            "budget": settings.memory_budget_bytes,
            "side_cache": side_cache,
            "operation": operation,
        }
        start = time.perf_counter()
        theta = _theta(module, train, None, kernel_options, **kw)
        theta_test = None if test is None else _theta(module, test, train, kernel_options, **kw)
        f0_train = _forward64(module, train.array)
        f0_test = None if test is None else _forward64(module, test.array)
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
            "mode": options.mode,
            "model": record.name,
            "version": record.version,
            "kernel_ms": round(kernel_s * 1000, 3),
            "analysis_ms": round(analysis_s * 1000, 3),
        }

    hint = "ask for fewer times or fewer test examples per request"
    cap = settings.max_json_response_bytes
    # encoded in the worker thread too: each hop back to the loop with a big body would stall it
    return await limiter.run(lambda: _respond(run(), cap, operation=operation, hint=hint), operation=operation)


@router.post(
    "/v1/models/{name}/spectrum",
    summary="Eigenvalues, condition number and effective ranks of Θ(x, x)",
    openapi_extra=openapi_body(SpectrumRequest),
)
async def kernel_spectrum(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    registry: RegistryDep,
    datasets: DatasetsDep,
    limiter: ComputeDep,
    side_cache: SideCacheDep,
    settings: SettingsDep,
) -> Response:
    operation = f"spectrum of model {name!r}"
    raw, rest = await _read(request, ("x",), operation=operation)
    if "x" not in raw:
        raise InvalidInput(f"{operation}: the body needs x (a tensor or data set slice)")
    options = validate_body(SpectrumOptions, rest, operation=operation)
    if options.ridges and options.top is not None:
        raise InvalidInput(f"{operation}: ridges (effective_dof) need every eigenvalue; drop top or the ridges")

    def prepare() -> tuple[ModelRecord, _Input]:
        record = registry.get(name, options.version)
        x = _side(raw["x"], "x", record, datasets, operation)
        size = x.array.shape[0] * (record.output_dim if options.mode == "full" else 1)
        dense = options.top is None or options.method == "eigh" or (options.method == "auto" and size <= DENSE_MAX_SIZE)
        _check_budget(
            8 * _SPECTRUM_COPIES["eigh" if dense else "lanczos"] * size * size,
            settings.memory_budget_bytes,
            what=f"the spectrum of a {size}x{size} kernel",
            operation=operation,
        )
        return record, x

    record, x = await anyio.to_thread.run_sync(prepare)

    def run() -> dict[str, Any]:
        _, module = registry.load_module(record.name, record.version)
        start = time.perf_counter()
        theta = _theta(
            module,
            x,
            None,
            _kernel_options(options, record.version),
            record=record,
            budget=settings.memory_budget_bytes,
            side_cache=side_cache,
            operation=operation,
        )
        kernel_s = time.perf_counter() - start
        start = time.perf_counter()
        s = analysis.spectrum(theta, top=options.top, method=options.method)
        body = {
            "eigenvalues": wire.tensor_to_json(s.eigenvalues),
            "n": s.n,
            "method": s.method,
            "lambda_max": s.lambda_max,
            "lambda_min": s.lambda_min,
            "condition_number": None if s.condition_number is None else json_float(s.condition_number),
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

    cap = settings.max_json_response_bytes
    hint = "ask for the top eigenvalues"
    return await limiter.run(lambda: _respond(run(), cap, operation=operation, hint=hint), operation=operation)


def _rekey(x: _Input, record: ModelRecord) -> _Input:
    """The same inputs keyed for another version: side-cache keys start with the version's 4-part cache_key.
    Inline inputs have no key (they are never cached) and stay as they are."""
    if x.key is None:
        return x
    return _Input(x.array, (*record.cache_key, *tuple(x.key)[len(record.cache_key) :]))  # type: ignore[arg-type]


def _resolve(name: str, versions: list[int | VersionRef], registry: ModelRegistry, operation: str) -> list[ModelRecord]:
    """The records to compare; all must share the architecture (same parameters, same outputs)."""
    records = [registry.get(name, v) if isinstance(v, int) else registry.get(v.model, v.version) for v in versions]
    first = records[0]
    for other in records[1:]:
        if other.architecture != first.architecture or other.parameters != first.parameters:
            raise InvalidInput(
                f"{operation}: model {other.name!r} v{other.version} has architecture {other.architecture}, "
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
    registry: RegistryDep,
    datasets: DatasetsDep,
    limiter: ComputeDep,
    side_cache: SideCacheDep,
    settings: SettingsDep,
) -> Response:
    operation = f"compare of model {name!r}"
    raw, rest = await _read(request, ("x", "y"), operation=operation)
    if "x" not in raw:
        raise InvalidInput(f"{operation}: the body needs x (the probe inputs, a tensor or data set slice)")
    options = validate_body(CompareOptions, rest, operation=operation)
    if ("y" in raw) != (options.variant is not None):
        raise InvalidInput(
            f"{operation}: alignment needs both y (labels or targets) and variant "
            "('uncentered' | 'centered' | 'centered_vec_y' | 'rayleigh'); give both or neither"
        )
    y = None if "y" not in raw else wire.tensor_from_json(raw["y"], name="y")

    def prepare() -> tuple[list[ModelRecord], _Input]:
        records = _resolve(name, options.versions, registry, operation)
        x = _side(raw["x"], "x", records[0], datasets, operation)
        n = x.array.shape[0]
        if y is not None and (y.ndim not in (1, 2) or y.shape[0] != n):
            raise ShapeMismatch(f"{operation}: y has shape {y.shape}; x has {n} examples, send y with {n} rows")
        size = n * (records[0].output_dim if options.mode == "full" else 1)
        _check_budget(
            8 * (len(records) + 1) * size * size,
            settings.memory_budget_bytes,
            what=f"{len(records)} kernels of {size}x{size}",
            operation=operation,
        )
        return records, x

    records, x = await anyio.to_thread.run_sync(prepare)

    def run() -> dict[str, Any]:
        start = time.perf_counter()
        kernels = []
        for record in records:
            _, module = registry.load_module(record.name, record.version)
            kernels.append(
                _theta(
                    module,
                    _rekey(x, record),
                    None,
                    _kernel_options(options, record.version),
                    record=record,
                    budget=settings.memory_budget_bytes,
                    side_cache=side_cache,
                    operation=operation,
                )
            )
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

    cap = settings.max_json_response_bytes
    hint = "compare fewer versions"
    return await limiter.run(lambda: _respond(run(), cap, operation=operation, hint=hint), operation=operation)
