"""``POST /v1/models/{name}/ntk``: the kernel Θ(x1, x2) of a registered model version.

Inputs come inline (JSON tensors, or ``x1``/``x2`` tensors of an .npy / safetensors body with the options as
query parameters) or as row ranges of stored data sets. They are checked against the model's input shape and
dtype before anything is computed; the computation runs off the event loop under the compute limiter.

The shared side cache holds data-set rows only (keyed by model version, data set and row range), so a repeated
request against the same data set reuses that side. Inline tensors are not keyed: hashing them costs time, a
client rarely resends the same bytes, and an unkeyed kernel with x1 and x2 takes the engine's joint pass (one
forward and reverse pass over both sides) instead of two separate ones. With the cache off
(``NTK_SIDE_CACHE_BYTES=0``) the engine never sees it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import anyio.to_thread
import numpy as np
import torch
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ntk_service import wire
from ntk_service.errors import (
    InvalidInput,
    MalformedRequest,
    NtkServiceError,
    ResourceLimit,
    ShapeMismatch,
    format_bytes,
)
from ntk_service.kernels import (
    NtkGroupsResult,
    NtkImplementation,
    NtkResult,
    SideCache,
    compute_ntk,
    compute_ntk_groups,
)
from ntk_service.kernels.modes import parse_any_mode, result_shape
from ntk_service.registry import DatasetStore, ModelRecord
from ntk_service.server.deps import (
    ComputeDep,
    DatasetsDep,
    MetricsDep,
    ReadAccess,
    RegistryDep,
    SettingsDep,
    SideCacheDep,
)
from ntk_service.server.group_kernels import (
    GROUP_RESPONSE_TYPES,
    KernelGroupsPublic,
    check_group_names,
    encode_groups,
    parse_groups_query,
)
from ntk_service.server.media import (
    BINARY_TENSOR_TYPES,
    content_type,
    encode_theta,
    json_too_large,
    negotiate,
    parse_off_loop,
    read_json,
    read_tensors,
    take_tensor,
)
from ntk_service.server.params import INT64_MAX, MAX_GLOBS, Glob, NamePath
from ntk_service.server.schemas import (
    DatasetRef,
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

MAX_GROUPS_QUERY_LENGTH = 16384
"""Longest ``groups`` query value (a JSON object of groups and globs); longer groupings go in a JSON body."""

_MIN_JSON_BYTES_PER_VALUE = 4
"""The shortest a float can be in JSON data ("0.0,"): a result whose element count times this exceeds the JSON
cap is refused before computing; otherwise the encoded length decides."""


@dataclass(frozen=True)
class _Input:
    """One side: the array (N, *input) and the side-cache key naming its content (None: not cached)."""

    array: np.ndarray
    key: Hashable | None


def _inline(array: np.ndarray) -> _Input:
    return _Input(array, None)  # see the module docstring: inline sides are not cached


def _from_dataset(ref: DatasetRef, record: ModelRecord, datasets: DatasetStore) -> _Input:
    array = datasets.load(ref.dataset, ref.start, ref.stop)
    return _Input(array, (*record.cache_key, "dataset", ref.dataset, ref.start, ref.stop))


def _check_input(array: np.ndarray, record: ModelRecord, *, side: str, operation: str) -> None:
    """Refuse inputs the model cannot take (before computing): per-example shape, dtype, token range."""
    expected = tuple(record.input_shape)
    got = tuple(array.shape[1:])
    architecture = record.architecture
    is_sequence = architecture.get("family") == "transformer"
    if array.ndim < 1:
        raise ShapeMismatch(f"{operation}: {side} must be a batch (N, {', '.join(map(str, expected))}), got a scalar")
    if is_sequence:
        max_len = int(architecture["max_len"])
        if len(got) != 1 or not 1 <= got[0] <= max_len:
            raise ShapeMismatch(
                f"{operation}: {side} has per-example shape {got}, model {record.name!r} "
                f"expects token ids (T,) with 1 <= T <= {max_len}; send a batch (N, T)"
            )
    elif got != expected:
        raise ShapeMismatch(
            f"{operation}: {side} has per-example shape {got}, model {record.name!r} expects {expected}; "
            f"send a batch of shape (N, {', '.join(map(str, expected))})"
        )
    is_integer_model = record.input_dtype == "int64"
    wanted = "integer token ids" if is_integer_model else "float32 or float64 values"
    if is_integer_model != (array.dtype.kind in "iu"):
        raise InvalidInput(
            f"{operation}: {side} has dtype {array.dtype}, model {record.name!r} expects "
            f"{record.input_dtype}; send {wanted}"
        )
    if is_sequence and array.size:
        vocab = int(architecture["vocab_size"])
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= vocab:
            raise InvalidInput(
                f"{operation}: {side} has token ids in [{low}, {high}], model {record.name!r} "
                f"has a vocabulary of {vocab} (ids 0..{vocab - 1})"
            )


def _parse_x(raw: Any, *, side: str, operation: str) -> np.ndarray | DatasetRef:
    if isinstance(raw, dict) and "dataset" in raw:
        return validate_body(DatasetRef, raw, operation=f"{operation}: {side}")
    return wire.tensor_from_json(raw, name=side)


_Side = np.ndarray | DatasetRef

_Result = TypeVar("_Result")


async def _read_request(
    request: Request, query: KernelOptions | None, *, operation: str
) -> tuple[_Side, _Side | None, KernelOptions]:
    """x1, x2 and the options, from a JSON body or from a binary body plus the query."""
    if content_type(request) in BINARY_TENSOR_TYPES:
        tensors = await read_tensors(request, operation=operation, npy_name="x1")
        x1: _Side = take_tensor(tensors, "x1", operation=operation)
        x2: _Side | None = tensors.pop("x2", None)
        if tensors:
            raise InvalidInput(f"{operation}: unexpected tensors {sorted(tensors)} in the body; send only x1 and x2")
        return x1, x2, query or KernelOptions()
    data = await read_json(request, operation=operation)
    if not isinstance(data, dict):
        raise MalformedRequest(
            f"{operation}: expected a JSON object with x1 (and x2, mode, ...), got {type(data).__name__}"
        )
    if query is not None:
        raise InvalidInput(
            f"{operation}: with a JSON body, put mode/implementation/params/dtype/version in the body, "
            "not in the query string (query options are for binary bodies)"
        )
    if "x1" not in data:
        raise InvalidInput(f'{operation}: the body needs x1 (a tensor or {{"dataset": id, "start", "stop"}})')
    x1_raw, x2_raw = data.pop("x1"), data.pop("x2", None)
    options = validate_body(KernelOptions, data, operation=operation)

    def parse() -> tuple[_Side, _Side | None]:
        x1 = _parse_x(x1_raw, side="x1", operation=operation)
        return x1, None if x2_raw is None else _parse_x(x2_raw, side="x2", operation=operation)

    x1, x2 = await parse_off_loop(parse, size=len(await request.body()))  # the body is cached by now
    return x1, x2, options


def _compute(
    module: torch.nn.Module,
    x1: _Input,
    x2: _Input | None,
    options: KernelOptions,
    *,
    record: ModelRecord,
    budget: int | None,
    side_cache: SideCache | None,
    operation: str,
    device: str = "cpu",
    allow_tf32: bool = False,
) -> tuple[NtkResult, float]:
    """The engine call (in a worker thread); returns the result and its wall time in seconds."""
    t1, t2, kwargs = _engine_arguments(x1, x2, options, budget, side_cache, device, allow_tf32)
    call = lambda: compute_ntk(module, t1, t2, params=options.params, **kwargs)  # noqa: E731
    return _guarded(call, record=record, operation=operation, device=device)


def _compute_groups(
    module: torch.nn.Module,
    x1: _Input,
    x2: _Input | None,
    options: KernelOptions,
    *,
    record: ModelRecord,
    budget: int | None,
    side_cache: SideCache | None,
    operation: str,
    device: str = "cpu",
    allow_tf32: bool = False,
) -> tuple[NtkGroupsResult, float]:
    """``_compute`` for a request with ``groups``: ``compute_ntk_groups``, one kernel per group."""
    t1, t2, kwargs = _engine_arguments(x1, x2, options, budget, side_cache, device, allow_tf32)
    groups: Any = options.groups
    call = lambda: compute_ntk_groups(module, t1, t2, groups=groups, rest=options.rest, **kwargs)  # noqa: E731
    return _guarded(call, record=record, operation=operation, device=device)


def _engine_arguments(
    x1: _Input,
    x2: _Input | None,
    options: KernelOptions,
    budget: int | None,
    side_cache: SideCache | None,
    device: str,
    allow_tf32: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """x1, x2 as tensors and the engine's keyword arguments shared by both kernel calls."""
    keyed = x1.key is not None or (x2 is not None and x2.key is not None)
    if not keyed or side_cache is None or side_cache.max_bytes <= 0:
        side_cache = None  # nothing to reuse: the engine may then take its joint pass
    kwargs: dict[str, Any] = {
        "mode": options.mode,
        "implementation": options.implementation,
        "dtype": options.dtype,
        "memory_budget_bytes": budget,
        "side_cache": side_cache,
        "device": device,
        "allow_tf32": allow_tf32,
        "x1_key": x1.key,
        "x2_key": None if x2 is None else x2.key,
    }
    return torch.from_numpy(x1.array), None if x2 is None else torch.from_numpy(x2.array), kwargs


def _guarded(call: Callable[[], _Result], *, record: ModelRecord, operation: str, device: str) -> tuple[_Result, float]:
    """``call()`` and its wall time, with the errors a model or a device raises told apart from the engine's."""
    start = time.perf_counter()
    try:
        result = call()
    except NtkServiceError:
        raise
    except torch.OutOfMemoryError as exc:  # the plan fit the budget, the device did not (other processes, fragments)
        raise ResourceLimit(
            f"{operation}: {device} ran out of memory although the plan fit the memory budget; retry, send fewer "
            "examples or a cheaper mode, or lower NTK_MEMORY_BUDGET_BYTES"
        ) from exc
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        # The model's own forward failed on these inputs (e.g. a factory model with other expectations).
        raise InvalidInput(f"{operation}: model {record.name!r} failed on the inputs: {exc}") from exc
    return result, time.perf_counter() - start


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
    registry: RegistryDep,
    datasets: DatasetsDep,
    limiter: ComputeDep,
    side_cache: SideCacheDep,
    settings: SettingsDep,
    metrics: MetricsDep,
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
    if options.groups is not None and options.params is not None:
        raise InvalidInput(f"{operation}: params and groups both select parameters; put the globs in groups")
    if options.rest and options.groups is None:
        raise InvalidInput(f"{operation}: rest=true needs groups")
    check_group_names(options.groups, operation=operation)
    offered = RESPONSE_TYPES if options.groups is None else GROUP_RESPONSE_TYPES
    response_type = negotiate(request, offered, operation=operation)

    def prepare() -> tuple[ModelRecord, _Input, _Input | None]:
        record = registry.get(name, options.version)

        def side(raw: _Side, label: str) -> _Input:
            item = _from_dataset(raw, record, datasets) if isinstance(raw, DatasetRef) else _inline(raw)
            _check_input(item.array, record, side=label, operation=operation)
            return item

        return record, side(x1_raw, "x1"), None if x2_raw is None else side(x2_raw, "x2")

    record, x1, x2 = await anyio.to_thread.run_sync(prepare)
    cap = settings.max_json_response_bytes
    if response_type == wire.MEDIA_JSON:
        n = x1.array.shape[0]
        m = n if x2 is None else x2.array.shape[0]
        numel = math.prod(result_shape(parse_any_mode(options.mode), n, m, record.output_dim))
        if isinstance(options.groups, dict):  # at least one kernel per group ("modules": known after the compute)
            numel *= len(options.groups) + int(options.rest)
        if numel * _MIN_JSON_BYTES_PER_VALUE > cap:
            raise json_too_large(
                f"at least {format_bytes(numel * _MIN_JSON_BYTES_PER_VALUE)}", cap, operation=operation
            )

    def run() -> tuple[Response, NtkResult | NtkGroupsResult, float]:
        # compute and encode in one worker-thread hop: each hop costs milliseconds on a loaded machine
        _, module = registry.load_module(record.name, record.version)
        compute = _compute if options.groups is None else _compute_groups
        result, seconds = compute(
            module,
            x1,
            x2,
            options,
            record=record,
            budget=settings.memory_budget_bytes,
            side_cache=side_cache,
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

    response, result, seconds = await limiter.run(run, operation=operation)
    metrics.compute_seconds.labels(result.implementation.value, result.mode.value).observe(seconds)
    return response
