"""``POST /v1/models/{name}/ntk``: the kernel Θ(x1, x2) of a registered model version.

Inputs come inline (JSON tensors, or ``x1``/``x2`` tensors of an .npy / safetensors body with the options as
query parameters) or as row ranges of stored data sets. They are checked against the model's input shape and
dtype before anything is computed; the computation runs off the event loop under the compute limiter. How the
sides are read, checked and cached is ``server/kernel_inputs.py`` (shared with the kernel-family and analysis
routes); the request model is ``KernelOptions`` / ``KernelRequest`` in ``server/schemas.py``.

The shared side cache holds data-set rows only, so a repeated request against the same data set reuses that side;
inline tensors are not keyed. With the cache off (``NTK_SIDE_CACHE_BYTES=0``) the engine never sees it.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ntk_service import wire
from ntk_service.errors import InvalidInput, format_bytes
from ntk_service.kernels import NtkGroupsResult, NtkImplementation, NtkResult
from ntk_service.kernels.modes import parse_any_mode, result_shape
from ntk_service.server.deps import ReadAccess
from ntk_service.server.group_kernels import (
    GROUP_RESPONSE_TYPES,
    MAX_GROUPS_QUERY_LENGTH,
    KernelGroupsPublic,
    check_group_options,
    encode_groups,
    parse_groups_query,
    run_group_kernel,
)
from ntk_service.server.kernel_inputs import (
    MIN_JSON_BYTES_PER_VALUE,
    ComputeContextDep,
    Side,
    load_sides,
    parse_sides,
    read_object,
    run_kernel,
)
from ntk_service.server.media import (
    BINARY_TENSOR_TYPES,
    content_type,
    encode_theta,
    json_too_large,
    negotiate,
    read_tensors,
    take_tensor,
)
from ntk_service.server.params import INT64_MAX, MAX_GLOBS, Glob, NamePath
from ntk_service.server.schemas import (
    KernelModeValue,
    KernelOptions,
    KernelPublic,
    KernelRequest,
    openapi_body,
    validate_body,
)

__all__ = ["router"]

router = APIRouter(tags=["kernels"])

RESPONSE_TYPES = (wire.MEDIA_JSON, wire.MEDIA_NPY, wire.MEDIA_SAFETENSORS)
"""What a kernel response can be, JSON first (the default without ``Accept``)."""


async def _read_request(
    request: Request, query: KernelOptions | None, *, operation: str
) -> tuple[Side, Side | None, KernelOptions]:
    """x1, x2 and the options, from a JSON body or from a binary body plus the query."""
    if content_type(request) in BINARY_TENSOR_TYPES:
        tensors = await read_tensors(request, operation=operation, npy_name="x1")
        x1: Side = take_tensor(tensors, "x1", operation=operation)
        x2: Side | None = tensors.pop("x2", None)
        if tensors:
            raise InvalidInput(f"{operation}: unexpected tensors {sorted(tensors)} in the body; send only x1 and x2")
        return x1, x2, query or KernelOptions()
    data = await read_object(request, operation=operation, expected=" with x1 (and x2, mode, ...)")
    if query is not None:
        raise InvalidInput(
            f"{operation}: with a JSON body, put mode/implementation/params/dtype/version in the body, "
            "not in the query string (query options are for binary bodies)"
        )
    if "x1" not in data:
        raise InvalidInput(f'{operation}: the body needs x1 (a tensor or {{"dataset": id, "start", "stop"}})')
    x1_raw, x2_raw = data.pop("x1"), data.pop("x2", None)
    options = validate_body(KernelOptions, data, operation=operation)
    x1, x2, _ = await parse_sides(request, x1_raw, x2_raw, operation=operation)
    return x1, x2, options


@router.post(
    "/v1/models/{name}/ntk",
    response_model=KernelPublic | KernelGroupsPublic,
    summary="Compute the empirical NTK of a model version on x1 (and x2), or one per parameter group",
    responses={200: {"content": {wire.MEDIA_NPY: {}, wire.MEDIA_SAFETENSORS: {}}}},
    openapi_extra=openapi_body(
        KernelRequest,
        binary={
            wire.MEDIA_SAFETENSORS: "Tensors x1 (and optional x2); options as query parameters.",
            wire.MEDIA_NPY: "x1 alone (x2 = x1); options as query parameters.",
        },
    ),
)
async def compute_kernel(
    name: NamePath,
    request: Request,
    _: ReadAccess,
    ctx: ComputeContextDep,
    mode: Annotated[KernelModeValue | None, Query(description="Binary bodies only. Default: full.")] = None,
    implementation: Annotated[NtkImplementation | None, Query(description="Binary bodies only.")] = None,
    params: Annotated[
        list[Glob] | None, Query(max_length=MAX_GLOBS, description="Binary bodies only; repeat for several globs.")
    ] = None,
    dtype: Annotated[Literal["float32", "float64"] | None, Query(description="Binary bodies only.")] = None,
    version: Annotated[
        int | None, Query(ge=1, le=INT64_MAX, description="Binary bodies only. Default: latest.")
    ] = None,
    groups: Annotated[
        str | None,
        Query(
            max_length=MAX_GROUPS_QUERY_LENGTH,
            description='Binary bodies only: "modules" or a JSON object {"name": ["glob", ...]}.',
        ),
    ] = None,
    rest: Annotated[bool | None, Query(description="Binary bodies only; with groups.")] = None,
) -> Response:
    operation = f"ntk of model {name!r}"
    given = {
        "mode": mode,
        "implementation": implementation,
        "params": params,
        "dtype": dtype,
        "version": version,
        "groups": parse_groups_query(groups, operation=operation),
        "rest": rest,
    }
    chosen = {key: value for key, value in given.items() if value is not None}
    query = validate_body(KernelOptions, chosen, operation=operation) if chosen else None
    x1_raw, x2_raw, options = await _read_request(request, query, operation=operation)
    check_group_options(options, operation=operation)
    offered = RESPONSE_TYPES if options.groups is None else GROUP_RESPONSE_TYPES
    response_type = negotiate(request, offered, operation=operation)

    record, x1, x2 = await load_sides(ctx, name, options.version, x1_raw, x2_raw, operation=operation)
    settings = ctx.settings
    cap = settings.max_json_response_bytes
    if response_type == wire.MEDIA_JSON:
        n = x1.array.shape[0]
        m = n if x2 is None else x2.array.shape[0]
        numel = math.prod(result_shape(parse_any_mode(options.mode), n, m, record.output_dim))
        if isinstance(options.groups, dict):  # at least one kernel per group ("modules": known after the compute)
            numel *= len(options.groups) + int(options.rest)
        if numel * MIN_JSON_BYTES_PER_VALUE > cap:
            raise json_too_large(f"at least {format_bytes(numel * MIN_JSON_BYTES_PER_VALUE)}", cap, operation=operation)

    def run() -> tuple[Response, NtkResult | NtkGroupsResult, float]:
        # compute and encode in one worker-thread hop: each hop costs milliseconds on a loaded machine
        _, module = ctx.registry.load_module(record.name, record.version)
        compute = run_kernel if options.groups is None else run_group_kernel
        result, seconds = compute(
            module,
            x1,
            x2,
            options,
            record=record,
            budget=settings.memory_budget_bytes,
            side_cache=ctx.side_cache,
            operation=operation,
            device=settings.device,  # the registry keeps the module there (one copy per version)
            allow_tf32=settings.allow_tf32,
        )
        meta = {
            "mode": result.mode.value,
            "implementation": result.implementation.value,
            "model": record.name,
            "version": record.version,
            "elapsed_ms": round(seconds * 1000, 3),
        }
        if isinstance(result, NtkGroupsResult):
            return encode_groups(result, response_type, meta, cap=cap, operation=operation), result, seconds
        return (
            encode_theta(result.theta.detach().cpu().numpy(), response_type, meta, cap=cap, operation=operation),
            result,
            seconds,
        )

    response, result, seconds = await ctx.limiter.run(run, operation=operation)
    ctx.metrics.compute_seconds.labels(result.implementation.value, result.mode.value).observe(seconds)
    return response
