"""The kernel family over HTTP: ``POST /v1/models/{name}/nngp``, ``.../monte_carlo`` and ``.../operator/matvec``.

JSON bodies (x1/x2 inline tensors or data set slices, as for ``/ntk``); the answer is JSON, or safetensors with
``Accept: application/x-safetensors`` (tensors ``kernel`` / ``mean`` and ``stderr`` / ``product``, the rest as
metadata). Inputs are checked against the model's input shape and dtype before anything is computed; the
computation runs off the event loop under the compute limiter. The pseudo-NTK is ``/ntk`` with mode "pseudo".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio.to_thread
import numpy as np
import torch
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from ntk_service import wire
from ntk_service.errors import InvalidInput, MalformedRequest, NtkServiceError, format_bytes
from ntk_service.kernels import compute_nngp, monte_carlo_ntk, ntk_operator
from ntk_service.registry import ModelRecord
from ntk_service.registry.zoo import build_model
from ntk_service.server.deps import ComputeDep, DatasetsDep, ReadAccess, RegistryDep, SettingsDep
from ntk_service.server.media import json_too_large, negotiate, parse_off_loop, read_json
from ntk_service.server.params import NamePath
from ntk_service.server.routes.kernels import _check_input, _from_dataset, _inline, _Input, _parse_x, _Side
from ntk_service.server.schemas import (
    DatasetRef,
    MatvecOptions,
    MatvecPublic,
    MatvecRequest,
    MonteCarloOptions,
    MonteCarloPublic,
    MonteCarloRequest,
    NngpOptions,
    NngpPublic,
    NngpRequest,
    openapi_body,
    validate_body,
)

__all__ = ["router"]

router = APIRouter(tags=["kernels"])

RESPONSE_TYPES = (wire.MEDIA_JSON, wire.MEDIA_SAFETENSORS)
"""What these routes answer, JSON first (the default without ``Accept``)."""

OptionsT = TypeVar("OptionsT", bound=BaseModel)
T = TypeVar("T")


async def _read(
    request: Request, options_model: type[OptionsT], *, operation: str, extra: tuple[str, ...] = ()
) -> tuple[_Side, _Side | None, dict[str, np.ndarray], OptionsT]:
    """x1, x2, the tensors named in ``extra`` and the options, from a JSON body."""
    data = await read_json(request, operation=operation)
    if not isinstance(data, dict):
        raise MalformedRequest(f"{operation}: expected a JSON object with x1 (and x2, ...), got {type(data).__name__}")
    for key in ("x1", *extra):
        if key not in data:
            raise InvalidInput(f"{operation}: the body needs {key}")
    raw = {key: data.pop(key) for key in ("x1", "x2", *extra) if key in data}
    options = validate_body(options_model, data, operation=operation)

    def parse() -> tuple[_Side, _Side | None, dict[str, np.ndarray]]:
        x1 = _parse_x(raw["x1"], side="x1", operation=operation)
        x2 = None if raw.get("x2") is None else _parse_x(raw["x2"], side="x2", operation=operation)
        return x1, x2, {key: wire.tensor_from_json(raw[key], name=key) for key in extra}

    x1, x2, tensors = await parse_off_loop(parse, size=len(await request.body()))
    return x1, x2, tensors, options


@dataclass(frozen=True)
class _Call:
    """What a request brings, read and checked: the record, both sides, extra tensors, options, answer type."""

    record: ModelRecord
    x1: _Input
    x2: _Input | None
    tensors: dict[str, np.ndarray]
    media: str


async def _begin(
    request: Request,
    registry: Any,
    datasets: Any,
    name: str,
    options: BaseModel,
    sides: tuple[_Side, _Side | None],
    tensors: dict[str, np.ndarray],
    *,
    operation: str,
) -> _Call:
    """Negotiate the answer type, then load the model record and both sides and check them against the model
    (in a worker thread)."""
    media = negotiate(request, RESPONSE_TYPES, operation=operation)
    version = getattr(options, "version", None)

    def prepare() -> tuple[ModelRecord, _Input, _Input | None]:
        record = registry.get(name, version)

        def side(raw: _Side, label: str) -> _Input:
            item = _from_dataset(raw, record, datasets) if isinstance(raw, DatasetRef) else _inline(raw)
            _check_input(item.array, record, side=label, operation=operation)
            return item

        x1, x2 = sides
        return record, side(x1, "x1"), None if x2 is None else side(x2, "x2")

    record, x1, x2 = await anyio.to_thread.run_sync(prepare)
    return _Call(record, x1, x2, tensors, media)


def _encode(
    tensors: dict[str, np.ndarray | None], media: str, meta: dict[str, Any], *, cap: int, operation: str
) -> Response:
    """JSON ``{name: tensor | null, **meta}`` (406 over ``cap`` bytes) or safetensors (metadata as strings)."""
    if media == wire.MEDIA_SAFETENSORS:
        present = {key: value for key, value in tensors.items() if value is not None}
        return Response(
            wire.encode_safetensors(present, {key: str(value) for key, value in meta.items()}), media_type=media
        )
    body = wire.json_dumps(
        {**{key: None if v is None else wire.tensor_to_json(v) for key, v in tensors.items()}, **meta}
    )
    if len(body) > cap:
        raise json_too_large(format_bytes(len(body)), cap, operation=operation)
    return Response(body, media_type=wire.MEDIA_JSON)


def _timed(fn: Callable[[], T], *, record: ModelRecord, operation: str) -> tuple[T, float]:
    """``fn()`` and its wall time; a model failing on the inputs is the caller's input error, not a 500."""
    start = time.perf_counter()
    try:
        out = fn()
    except NtkServiceError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise InvalidInput(f"{operation}: model {record.name!r} failed on the inputs: {exc}") from exc
    return out, time.perf_counter() - start


def _array(x: _Input | None) -> torch.Tensor | None:
    return None if x is None else torch.from_numpy(x.array)


@router.post(
    "/v1/models/{name}/nngp",
    response_model=NngpPublic,
    summary="The empirical NNGP f(x1) f(x2)ᵀ of a model version, or the conjugate kernel at a layer",
    responses={200: {"content": {wire.MEDIA_SAFETENSORS: {}}}},
    openapi_extra=openapi_body(NngpRequest),
)
async def nngp(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    registry: RegistryDep,
    datasets: DatasetsDep,
    limiter: ComputeDep,
    settings: SettingsDep,
) -> Response:
    operation = f"nngp of model {name!r}"
    x1_raw, x2_raw, tensors, options = await _read(request, NngpOptions, operation=operation)
    call = await _begin(request, registry, datasets, name, options, (x1_raw, x2_raw), tensors, operation=operation)
    record, x1, x2, media = call.record, call.x1, call.x2, call.media

    def run() -> Response:
        _, module = registry.load_module(record.name, record.version)

        def call() -> Any:
            return compute_nngp(
                module,
                torch.from_numpy(x1.array),
                _array(x2),
                layer=options.layer,
                mode=options.mode,
                dtype=options.dtype,
                memory_budget_bytes=settings.memory_budget_bytes,
            )

        result, seconds = _timed(call, record=record, operation=operation)
        meta = {
            "mode": result.mode.value,
            "layer": result.layer,
            "features": result.features,
            "model": record.name,
            "version": record.version,
            "elapsed_ms": round(seconds * 1000, 3),
        }
        kernel = result.kernel.detach().cpu().numpy()
        return _encode({"kernel": kernel}, media, meta, cap=settings.max_json_response_bytes, operation=operation)

    return await limiter.run(run, operation=operation)


@router.post(
    "/v1/models/{name}/monte_carlo",
    response_model=MonteCarloPublic,
    summary="The NTK or NNGP of the model's architecture averaged over initializations (one network per seed)",
    responses={200: {"content": {wire.MEDIA_SAFETENSORS: {}}}},
    openapi_extra=openapi_body(MonteCarloRequest),
)
async def monte_carlo(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    registry: RegistryDep,
    datasets: DatasetsDep,
    limiter: ComputeDep,
    settings: SettingsDep,
) -> Response:
    operation = f"monte_carlo of model {name!r}"
    x1_raw, x2_raw, tensors, options = await _read(request, MonteCarloOptions, operation=operation)
    call = await _begin(request, registry, datasets, name, options, (x1_raw, x2_raw), tensors, operation=operation)
    record, x1, x2, media = call.record, call.x1, call.x2, call.media
    factories = settings.allowed_factories

    def build(seed: int) -> torch.nn.Module:
        return build_model(record.architecture, seed, allowed_factories=factories, operation=operation)[0]

    def run() -> Response:
        def call() -> Any:
            return monte_carlo_ntk(
                build,
                torch.from_numpy(x1.array),
                _array(x2),
                seeds=options.seeds,
                mode=options.mode,
                kernel=options.kernel,
                params=options.params,
                layer=options.layer,
                dtype=options.dtype,
                memory_budget_bytes=settings.memory_budget_bytes,
            )

        result, seconds = _timed(call, record=record, operation=operation)
        meta = {
            "n_samples": result.n_samples,
            "kernel": result.kernel.value,
            "mode": result.mode.value,
            "models_per_chunk": result.models_per_chunk,
            "model": record.name,
            "elapsed_ms": round(seconds * 1000, 3),
        }
        tensors = {
            "mean": result.mean.detach().cpu().numpy(),
            "stderr": None if result.stderr is None else result.stderr.detach().cpu().numpy(),
        }
        return _encode(tensors, media, meta, cap=settings.max_json_response_bytes, operation=operation)

    return await limiter.run(run, operation=operation)


@router.post(
    "/v1/models/{name}/operator/matvec",
    response_model=MatvecPublic,
    summary="One product Θ(x1, x2) v (or Θᵀ w) without building the kernel: one VJP and one JVP pass",
    responses={200: {"content": {wire.MEDIA_SAFETENSORS: {}}}},
    openapi_extra=openapi_body(MatvecRequest),
)
async def operator_matvec(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    registry: RegistryDep,
    datasets: DatasetsDep,
    limiter: ComputeDep,
    settings: SettingsDep,
) -> Response:
    operation = f"operator matvec of model {name!r}"
    x1_raw, x2_raw, tensors, options = await _read(request, MatvecOptions, operation=operation, extra=("v",))
    call = await _begin(request, registry, datasets, name, options, (x1_raw, x2_raw), tensors, operation=operation)
    record, x1, x2, media = call.record, call.x1, call.x2, call.media
    v = torch.from_numpy(call.tensors["v"])

    def run() -> Response:
        _, module = registry.load_module(record.name, record.version)

        def call() -> torch.Tensor:
            op = ntk_operator(
                module,
                torch.from_numpy(x1.array),
                _array(x2),
                mode=options.mode,
                params=options.params,
                dtype=options.dtype,
                memory_budget_bytes=settings.memory_budget_bytes,
            )
            return op.rmatvec(v) if options.transpose else op.matvec(v)

        product, seconds = _timed(call, record=record, operation=operation)
        meta = {
            "mode": options.mode,
            "model": record.name,
            "version": record.version,
            "elapsed_ms": round(seconds * 1000, 3),
        }
        out = product.detach().cpu().numpy()
        return _encode({"product": out}, media, meta, cap=settings.max_json_response_bytes, operation=operation)

    return await limiter.run(run, operation=operation)
