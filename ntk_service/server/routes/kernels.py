"""``POST /v1/models/{name}/ntk``: the kernel Θ(x1, x2) of a registered model version.

Inputs come inline (JSON tensors, or ``x1``/``x2`` tensors of an .npy / safetensors body with the options as
query parameters) or as row ranges of stored data sets. They are checked against the model's input shape and
dtype before anything is computed; the computation runs off the event loop under the compute limiter. The request
is read once into the sides and the engine's two values, ``KernelSpec`` (what) and ``NtkOptions`` (how)
(``server/reading.py``); the record is read once, the sides loaded and checked (``server/computing.py``: inline
sides in the compute hop itself while a slot is free, else and for data-set rows in a hop of their own before
queueing), and the module comes from the record already read. The wire schema is ``KernelOptions`` /
``KernelRequest`` in ``server/schemas.py``.

The shared side cache holds data-set rows only, so a repeated request against the same data set reuses that side;
inline tensors are not keyed. With the cache off (``NTK_SIDE_CACHE_BYTES=0``) the engine never sees it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ntk_service import wire
from ntk_service.errors import operation_name
from ntk_service.kernels import NtkGroupsResult, NtkImplementation
from ntk_service.server.computing import (
    ComputeContextDep,
    load_kernel_sides,
    prepare_kernel_sides,
    reads_sides,
    run_kernel,
)
from ntk_service.server.deps import ReadAccess
from ntk_service.server.group_kernels import (
    GROUP_RESPONSE_TYPES,
    MAX_GROUPS_QUERY_LENGTH,
    encode_groups,
)
from ntk_service.server.media import encode_theta, negotiate
from ntk_service.server.params import INT64_MAX, MAX_GLOBS, Glob, NamePath
from ntk_service.server.precision import downcast_note
from ntk_service.server.reading import read_kernel_request
from ntk_service.server.schemas import (
    MAX_OUTPUT_PATH,
    KernelGroupsPublic,
    KernelModeField,
    KernelPublic,
    KernelRequest,
    openapi_body,
)

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
    mode: Annotated[KernelModeField | None, Query(description="Binary bodies only. Default: full.")] = None,
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
    with operation_name(f"ntk of model {name!r}"):  # NOTE [operation names] in errors.py
        given = {
            "mode": mode,
            "implementation": implementation,
            "params": params,
            "dtype": dtype,
            "version": version,
            "groups": groups,
            "rest": rest,
            "output": output,
        }
        query = {key: value for key, value in given.items() if value is not None}
        call = await read_kernel_request(request, query, ctx.settings)
        spec = call.spec
        offered = RESPONSE_TYPES if spec.groups is None else GROUP_RESPONSE_TYPES
        response_type = negotiate(request, offered)

        cap = ctx.settings.max_json_response_bytes
        json_cap = cap if response_type == wire.MEDIA_JSON else None
        # Inline sides are loaded (the record read, the sides checked) in the compute hop itself while a slot is
        # free: a hop costs 0.2-0.4 ms. Data-set rows (a read of stored data), or a full limiter, get a hop of their
        # own first, outside the slot: a request with a bad input or model is refused then without queueing.
        limiter = ctx.limiter
        separate = reads_sides(call) or limiter.pending >= limiter.concurrency
        loaded = await load_kernel_sides(ctx, name, call, json_cap=json_cap) if separate else None

        def run() -> tuple[Response, NtkImplementation, str, float]:
            record, x1, x2 = loaded or prepare_kernel_sides(ctx, name, call, json_cap=json_cap)
            module = ctx.registry.module(record)  # the record read above, not read again
            result, seconds = run_kernel(module, x1, x2, spec, call.options, record=record, side_cache=ctx.side_cache)
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
                response = encode_groups(result, response_type, meta, cap=cap)
            else:
                theta = result.theta.detach().cpu().numpy()
                response = encode_theta(theta, response_type, meta, cap=cap)
            return response, result.implementation, result.mode.value, seconds

        response, implementation_ran, mode_ran, seconds = await ctx.limiter.run(run)
        ctx.metrics.compute_seconds.labels(implementation_ran.value, mode_ran).observe(seconds)
        return response
