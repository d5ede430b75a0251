"""The kernel family over HTTP: ``POST /v1/models/{name}/nngp``, ``.../monte_carlo`` and ``.../operator/matvec``.

JSON bodies (x1/x2 inline tensors or data set slices, as for ``/ntk``); the answer is JSON, or safetensors with
``Accept: application/x-safetensors`` (tensors ``kernel`` / ``mean`` and ``stderr`` / ``product``, the rest as
metadata). Inputs are checked against the model's input shape and dtype before anything is computed; the
computation runs off the event loop under the compute limiter. The pseudo-NTK is ``/ntk`` with mode "pseudo".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from ntk_service import wire
from ntk_service.errors import InvalidInput, UnsupportedModel, format_bytes, operation_name
from ntk_service.kernels import KernelSpec, compute_nngp, monte_carlo_ntk, ntk_operator
from ntk_service.kernels.spec import MODES_BY_VALUE
from ntk_service.registry import ModelRecord
from ntk_service.registry.exported import EXPORTED_FAMILY
from ntk_service.registry.zoo import build_model
from ntk_service.server.computing import ComputeContext, ComputeContextDep, KernelInput, load_sides, run_model
from ntk_service.server.deps import ReadAccess
from ntk_service.server.media import json_too_large, negotiate
from ntk_service.server.params import NamePath
from ntk_service.server.reading import engine_options, parse_sides, read_object
from ntk_service.server.schemas import (
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

OptionsT = TypeVar("OptionsT", bound=NngpOptions | MonteCarloOptions | MatvecOptions)


@dataclass(frozen=True)
class _Call(Generic[OptionsT]):
    """What a request brings, read and checked: the record, both sides, extra tensors, options, answer type."""

    record: ModelRecord
    x1: KernelInput
    x2: KernelInput | None
    tensors: dict[str, np.ndarray]
    options: OptionsT
    media: str


async def _begin(
    request: Request,
    ctx: ComputeContext,
    name: str,
    options_model: type[OptionsT],
    *,
    extra: tuple[str, ...] = (),
) -> _Call[OptionsT]:
    """Read x1, x2, the tensors named in ``extra`` and the options from the JSON body, negotiate the answer type,
    then read the model record and load both sides, checked against the model and ``output`` against its outputs
    (in a worker thread)."""
    data = await read_object(request, expected=" with x1 (and x2, ...)")
    for key in ("x1", *extra):
        if key not in data:
            raise InvalidInput(detail=f"the body needs {key}")
    raw = {key: data.pop(key) for key in ("x1", "x2", *extra) if key in data}
    options = validate_body(options_model, data)
    x1, x2, tensors = await parse_sides(request, raw["x1"], raw.get("x2"), extra={key: raw[key] for key in extra})
    media = negotiate(request, RESPONSE_TYPES)
    output = getattr(options, "output", None)  # the Monte Carlo options have none
    record, first, second = await load_sides(ctx, name, options.version, x1, x2, output=output)
    return _Call(record, first, second, tensors, options, media)


def _encode(tensors: dict[str, np.ndarray | None], media: str, meta: dict[str, Any], *, cap: int) -> Response:
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
        raise json_too_large(format_bytes(len(body)), cap)
    return Response(body, media_type=wire.MEDIA_JSON)


def _check_exported(record: ModelRecord, *, layer: str | None, monte_carlo: bool) -> None:
    """Refuse, with what to do instead, what a torch.export program cannot give: a fresh network per seed (it holds
    weights, not an initializer) and a layer's features (its graph calls ATen ops, never its submodules, so a
    forward hook on one would see nothing).

    Raises:
        UnsupportedModel: monte_carlo, or a layer, on an exported model.
    """
    if record.architecture.get("family") != EXPORTED_FAMILY:
        return
    if monte_carlo:
        raise UnsupportedModel(
            detail=f"model {record.name!r} is an exported torch.export program, which holds weights but no "
            "initializer, so there is no fresh network per seed to average over; average the kernels of your own "
            "checkpoints instead (one upload_weights version per initialization, then /ntk or /nngp per version), "
            "or register the architecture with a family that initializes (sequential, mlp, cnn, transformer)"
        )
    if layer is not None:
        raise UnsupportedModel(
            detail=f"layer {layer!r}: model {record.name!r} is an exported torch.export program, whose graph "
            "calls ATen operators and never its submodules, so a layer's features cannot be read; leave layer out "
            "for the NNGP of the outputs, or register the model with the sequential family to name its layers"
        )


def _array(x: KernelInput | None, record: ModelRecord) -> Any:
    """A side as the model takes it (a tensor, a tuple or a dict of named inputs); None stays None."""
    return None if x is None else x.to_torch(record)


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
    ctx: ComputeContextDep,
) -> Response:
    with operation_name(f"nngp of model {name!r}"):  # NOTE [operation names] in errors.py
        call = await _begin(request, ctx, name, NngpOptions)
        record, x1, x2, options, media, settings = call.record, call.x1, call.x2, call.options, call.media, ctx.settings
        _check_exported(record, layer=options.layer, monte_carlo=False)
        spec = KernelSpec(mode=options.mode, layer=options.layer, output=options.output)
        how = engine_options(settings, dtype=options.dtype)

        def run() -> Response:
            module = ctx.registry.module(record)

            def call() -> Any:
                return compute_nngp(module, x1.to_torch(record), _array(x2, record), spec=spec, options=how)

            result, seconds = run_model(call, record=record)
            meta = {
                "mode": result.mode.value,
                "layer": result.layer,
                "features": result.features,
                "model": record.name,
                "version": record.version,
                "elapsed_ms": round(seconds * 1000, 3),
            }
            kernel = result.theta.detach().cpu().numpy()
            return _encode({"kernel": kernel}, media, meta, cap=settings.max_json_response_bytes)

        return await ctx.limiter.run(run)


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
    ctx: ComputeContextDep,
) -> Response:
    operation = f"monte_carlo of model {name!r}"
    with operation_name(operation):  # NOTE [operation names] in errors.py
        call = await _begin(request, ctx, name, MonteCarloOptions)
        record, x1, x2, options, media, settings = call.record, call.x1, call.x2, call.options, call.media, ctx.settings
        _check_exported(record, layer=options.layer, monte_carlo=True)
        factories = settings.allowed_factories

        def build(seed: int) -> torch.nn.Module:
            return build_model(record.architecture, seed, allowed_factories=factories, operation=operation)[0]

        spec = KernelSpec(mode=options.mode, params=options.params, layer=options.layer)
        how = engine_options(settings, dtype=options.dtype).replace(device=None)  # computed where build puts them

        def run() -> Response:
            def call() -> Any:
                return monte_carlo_ntk(
                    build,
                    x1.to_torch(record),
                    _array(x2, record),
                    seeds=options.seeds,
                    kernel=options.kernel,
                    spec=spec,
                    options=how,
                )

            result, seconds = run_model(call, record=record)
            meta = {
                "n_samples": result.n_samples,
                "kernel": result.kernel.value,
                "mode": result.mode.value,
                "models_per_chunk": result.models_per_chunk,
                "model": record.name,
                "version": record.version,
                "elapsed_ms": round(seconds * 1000, 3),
            }
            tensors = {
                "mean": result.mean.detach().cpu().numpy(),
                "stderr": None if result.stderr is None else result.stderr.detach().cpu().numpy(),
            }
            return _encode(tensors, media, meta, cap=settings.max_json_response_bytes)

        return await ctx.limiter.run(run)


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
    ctx: ComputeContextDep,
) -> Response:
    with operation_name(f"operator matvec of model {name!r}"):  # NOTE [operation names] in errors.py
        call = await _begin(request, ctx, name, MatvecOptions, extra=("v",))
        record, x1, x2, options, media, settings = call.record, call.x1, call.x2, call.options, call.media, ctx.settings
        v = torch.from_numpy(call.tensors["v"])
        spec = KernelSpec(mode=MODES_BY_VALUE[options.mode], params=options.params, output=options.output)
        how = engine_options(settings, dtype=options.dtype)

        def run() -> Response:
            module = ctx.registry.module(record)

            def call() -> torch.Tensor:
                op = ntk_operator(module, x1.to_torch(record), _array(x2, record), spec=spec, options=how)
                return op.rmatvec(v) if options.transpose else op.matvec(v)

            product, seconds = run_model(call, record=record)
            meta = {
                "mode": options.mode,
                "model": record.name,
                "version": record.version,
                "elapsed_ms": round(seconds * 1000, 3),
            }
            out = product.detach().cpu().numpy()
            return _encode({"product": out}, media, meta, cap=settings.max_json_response_bytes)

        return await ctx.limiter.run(run)
