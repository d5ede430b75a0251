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
from ntk_service.errors import format_bytes
from ntk_service.kernels import NtkGroupsResult, NtkImplementation
from ntk_service.kernels.modes import result_shape
from ntk_service.server.deps import ReadAccess
from ntk_service.server.group_kernels import (
    GROUP_RESPONSE_TYPES,
    MAX_GROUPS_QUERY_LENGTH,
    KernelGroupsPublic,
    check_group_options,
    encode_groups,
    parse_groups_query,
)
from ntk_service.server.kernel_inputs import (
    MIN_JSON_BYTES_PER_VALUE,
    ComputeContextDep,
    engine_options,
    load_sides,
    output_size,
    read_kernel_request,
    run_kernel,
)
from ntk_service.server.media import encode_theta, json_too_large, negotiate
from ntk_service.server.params import INT64_MAX, MAX_GLOBS, Glob, NamePath
from ntk_service.server.precision import downcast_note
from ntk_service.server.schemas import MAX_OUTPUT_PATH, KernelModeValue, KernelPublic, KernelRequest, openapi_body

__all__ = ["router"]

router = APIRouter(tags=["kernels"])

RESPONSE_TYPES = (wire.MEDIA_JSON, wire.MEDIA_NPY, wire.MEDIA_SAFETENSORS)
"""What a kernel response can be, JSON first (the default without ``Accept``)."""


@router.post(
    "/v1/models/{name}/ntk",
    response_model=KernelPublic | KernelGroupsPublic,
    summary="Compute the empirical NTK of a model version on x1 (and x2), or one per parameter group",
    responses={200: {"content": {wire.MEDIA_NPY: {}, wire.MEDIA_SAFETENSORS: {}}}},
    openapi_extra=openapi_body(
        KernelRequest,
        binary={
            wire.MEDIA_SAFETENSORS: "Tensors x1 (and optional x2), or named inputs x1.<name> (x2.<name>) for a model "
            "taking several; options as query parameters.",
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
    output: Annotated[
        str | None, Query(max_length=MAX_OUTPUT_PATH, description='Binary bodies only, e.g. "logits[:, 0]".')
    ] = None,
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
        "output": output,
    }
    query = {key: value for key, value in given.items() if value is not None}
    call = await read_kernel_request(request, query, operation=operation)
    options = call.options
    check_group_options(options, operation=operation)
    offered = RESPONSE_TYPES if options.groups is None else GROUP_RESPONSE_TYPES
    response_type = negotiate(request, offered, operation=operation)

    record, x1, x2 = await load_sides(ctx, name, options.version, call.x1, call.x2, operation=operation)
    settings = ctx.settings
    cap = settings.max_json_response_bytes
    if response_type == wire.MEDIA_JSON:
        n = x1.n
        m = n if x2 is None else x2.n
        k = output_size(options.output, record, operation=operation)
        numel = math.prod(result_shape(call.mode, n, m, k))
        if isinstance(options.groups, dict):  # at least one kernel per group ("modules": known after the compute)
            numel *= len(options.groups) + int(options.rest)
        if numel * MIN_JSON_BYTES_PER_VALUE > cap:
            raise json_too_large(f"at least {format_bytes(numel * MIN_JSON_BYTES_PER_VALUE)}", cap, operation=operation)
    engine = engine_options(options, settings)  # the registry keeps the module on settings.device

    def run() -> tuple[Response, NtkImplementation, str, float]:
        # compute and encode in one worker-thread hop: each hop costs milliseconds on a loaded machine
        _, module = ctx.registry.load_module(record.name, record.version)
        result, seconds = run_kernel(
            module, x1, x2, call, record=record, options=engine, side_cache=ctx.side_cache, operation=operation
        )
        computed = str(result.stacked.dtype if isinstance(result, NtkGroupsResult) else result.theta.dtype)
        computed = computed.removeprefix("torch.")
        meta: dict[str, str | int | float] = {
            "mode": result.mode.value,
            "implementation": result.implementation.value,
            "model": record.name,
            "version": record.version,
            "elapsed_ms": round(seconds * 1000, 3),
            "dtype": computed,
        }
        note = downcast_note({"x1": x1.array, "x2": None if x2 is None else x2.array}, computed)
        if note is not None:
            meta["note"] = note
        if isinstance(result, NtkGroupsResult):
            response = encode_groups(result, response_type, meta, cap=cap, operation=operation)
        else:
            theta = result.theta.detach().cpu().numpy()
            response = encode_theta(theta, response_type, meta, cap=cap, operation=operation)
        return response, result.implementation, result.mode.value, seconds

    response, implementation_ran, mode_ran, seconds = await ctx.limiter.run(run, operation=operation)
    ctx.metrics.compute_seconds.labels(implementation_ran.value, mode_ran).observe(seconds)
    return response
