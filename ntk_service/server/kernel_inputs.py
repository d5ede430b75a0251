"""What the routes computing on a model version share: reading the sides, checking them, running, answering.

``/ntk`` (``routes/kernels.py``), the kernel family (``routes/kernel_family.py``), the analyses
(``routes/analysis.py``) and the job analyses (``routes/job_analysis.py``) take their inputs the same way: a side
comes inline (a JSON tensor, or a tensor of a binary body) or as a row range of a stored data set, and is checked
against the model's input shape and dtype before anything is computed. The model runs off the event loop under
the compute limiter; its failures on the inputs are the caller's 422, not a 500.

The shared side cache holds data-set rows only (keyed by model version, data set and row range). Inline sides
are not keyed: hashing them costs time, a client rarely resends the same bytes, and an unkeyed kernel with x1 and
x2 takes the engine's joint pass (one forward and reverse pass over both sides) instead of two separate ones.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import anyio.to_thread
import numpy as np
import torch
from fastapi import Depends, Request
from starlette.responses import Response

from ntk_service import wire
from ntk_service.config import Settings
from ntk_service.errors import (
    InvalidInput,
    MalformedRequest,
    MemoryEstimateExceeded,
    NtkServiceError,
    PayloadTooLarge,
    ResourceLimit,
    ShapeMismatch,
    format_bytes,
)
from ntk_service.kernels import (
    NtkGroupsResult,
    NtkOptions,
    NtkResult,
    SideCache,
    compute_ntk,
    compute_ntk_groups,
    default_memory_budget,
)
from ntk_service.kernels.modes import DerivedMode, KernelMode, parse_any_mode
from ntk_service.kernels.options import DTYPES
from ntk_service.registry import DatasetStore, ModelRecord, ModelRegistry
from ntk_service.server.compute import ComputeLimiter
from ntk_service.server.deps import ComputeDep, DatasetsDep, MetricsDep, RegistryDep, SettingsDep, SideCacheDep
from ntk_service.server.media import (
    BINARY_TENSOR_TYPES,
    content_type,
    json_response,
    parse_off_loop,
    read_json,
    read_tensors,
    take_tensor,
)
from ntk_service.server.metrics import Metrics
from ntk_service.server.schemas import DatasetRef, KernelOptions, validate_body

__all__ = [
    "MIN_JSON_BYTES_PER_VALUE",
    "ComputeContext",
    "ComputeContextDep",
    "KernelCall",
    "KernelInput",
    "SideSource",
    "answer_json",
    "check_budget",
    "check_input",
    "engine_options",
    "from_dataset",
    "inline",
    "load_side",
    "load_sides",
    "parse_side",
    "parse_sides",
    "read_kernel_request",
    "read_object",
    "run_kernel",
    "run_model",
]

T = TypeVar("T")

MIN_JSON_BYTES_PER_VALUE = 4
"""The shortest a float can be in JSON data ("0.0,"): an answer whose value count times this exceeds the JSON cap
is refused before computing; otherwise the encoded length decides."""

SideSource = np.ndarray | DatasetRef
"""Where one side of a request comes from: an inline array (N, *input) or rows of a stored data set. (The
engine's ``kernels.algorithm.Side`` is another thing: what an implementation keeps from a block of examples.)"""


def __getattr__(name: str) -> Any:
    """``Side``, this module's old name of :data:`SideSource`, kept for one release with a DeprecationWarning."""
    if name == "Side":
        warnings.warn(
            "ntk_service.server.kernel_inputs.Side is deprecated; use SideSource (kernels.algorithm.Side is the "
            "engine's per-block intermediates, an unrelated type)",
            DeprecationWarning,
            stacklevel=2,
        )
        return SideSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class KernelInput:
    """One side, loaded: the array (N, *input) and the side-cache key naming its content (None: not cached)."""

    array: np.ndarray
    key: Hashable | None


@dataclass(frozen=True)
class ComputeContext:
    """The lifespan's objects a computing route needs (one dependency instead of six parameters)."""

    registry: ModelRegistry
    datasets: DatasetStore
    limiter: ComputeLimiter
    side_cache: SideCache
    settings: Settings
    metrics: Metrics


async def _compute_context(
    registry: RegistryDep,
    datasets: DatasetsDep,
    limiter: ComputeDep,
    side_cache: SideCacheDep,
    settings: SettingsDep,
    metrics: MetricsDep,
) -> ComputeContext:
    return ComputeContext(registry, datasets, limiter, side_cache, settings, metrics)


ComputeContextDep = Annotated[ComputeContext, Depends(_compute_context)]
"""A route's :class:`ComputeContext`; declare it after the access dependency (auth is checked first)."""


def inline(array: np.ndarray) -> KernelInput:
    """An inline side: never keyed (see the module docstring)."""
    return KernelInput(array, None)


def from_dataset(ref: DatasetRef, record: ModelRecord, datasets: DatasetStore) -> KernelInput:
    """Rows ``ref.start:ref.stop`` of a stored data set, keyed by the model version, data set and row range."""
    array = datasets.load(ref.dataset, ref.start, ref.stop)
    return KernelInput(array, (*record.cache_key, "dataset", ref.dataset, ref.start, ref.stop))


def _vocabulary(architecture: dict[str, Any]) -> int | None:
    """How many token ids the model's input embedding takes: a transformer's ``vocab_size``, or the
    ``num_embeddings`` of the Embedding an int64 ``sequential`` model starts with, an int64 ``exported`` model's
    ``vocab_size`` (its embedding's rows); None when not known (float inputs, factory models)."""
    if architecture.get("family") in ("transformer", "exported") and "vocab_size" in architecture:
        return int(architecture["vocab_size"])
    layers = architecture.get("layers") if architecture.get("family") == "sequential" else None
    if architecture.get("input_dtype") == "int64" and layers and layers[0].get("type") == "Embedding":
        return int(layers[0]["num_embeddings"])
    return None


def check_input(array: np.ndarray, record: ModelRecord, *, side: str, operation: str) -> None:
    """Refuse inputs the model cannot take, before computing: per-example shape, dtype, token range.

    Raises:
        ShapeMismatch: not a batch (N, *input_shape), or token ids (N, T) longer than the model's ``max_len``.
        InvalidInput: floats for a token model or integers for a float model; token ids outside the vocabulary.
    """
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
    vocab = _vocabulary(architecture)
    if vocab is not None and array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= vocab:
            raise InvalidInput(
                f"{operation}: {side} has token ids in [{low}, {high}], model {record.name!r} "
                f"has a vocabulary of {vocab} (ids 0..{vocab - 1})"
            )


def parse_side(raw: Any, *, side: str, operation: str) -> SideSource:
    """A JSON side: ``{"dataset": id, "start", "stop"}`` is a :class:`DatasetRef`, anything else a wire tensor."""
    if isinstance(raw, dict) and "dataset" in raw:
        return validate_body(DatasetRef, raw, operation=f"{operation}: {side}")
    return wire.tensor_from_json(raw, name=side)


async def parse_sides(
    request: Request, x1: Any, x2: Any, *, operation: str, extra: dict[str, Any] | None = None
) -> tuple[SideSource, SideSource | None, dict[str, np.ndarray]]:
    """x1, x2 (None: absent) and the ``extra`` JSON tensors of a JSON body, parsed off the loop when it is large."""
    fields = extra or {}

    def parse() -> tuple[SideSource, SideSource | None, dict[str, np.ndarray]]:
        first = parse_side(x1, side="x1", operation=operation)
        second = None if x2 is None else parse_side(x2, side="x2", operation=operation)
        return first, second, {key: wire.tensor_from_json(value, name=key) for key, value in fields.items()}

    return await parse_off_loop(parse, size=len(await request.body()))  # the body is cached by now


def load_side(
    raw: SideSource, record: ModelRecord, datasets: DatasetStore, *, side: str, operation: str
) -> KernelInput:
    """The side loaded (data set rows read) and checked against the model (:func:`check_input`); blocking."""
    item = from_dataset(raw, record, datasets) if isinstance(raw, DatasetRef) else inline(raw)
    check_input(item.array, record, side=side, operation=operation)
    return item


async def load_sides(
    ctx: ComputeContext, name: str, version: int | None, x1: SideSource, x2: SideSource | None, *, operation: str
) -> tuple[ModelRecord, KernelInput, KernelInput | None]:
    """The model record (latest when ``version`` is None) and both sides loaded and checked, in a worker thread."""

    def prepare() -> tuple[ModelRecord, KernelInput, KernelInput | None]:
        record = ctx.registry.get(name, version)
        first = load_side(x1, record, ctx.datasets, side="x1", operation=operation)
        second = None if x2 is None else load_side(x2, record, ctx.datasets, side="x2", operation=operation)
        return record, first, second

    return await anyio.to_thread.run_sync(prepare)


async def read_object(request: Request, *, operation: str, expected: str = "") -> dict[str, Any]:
    """The JSON body, which must be an object.

    Args:
        expected: what the object should hold, for the message (e.g. ``" with x1 (and x2, ...)"``).

    Raises:
        UnsupportedMediaType: not application/json (415).
        MalformedRequest: invalid JSON, or not an object (400).
    """
    data = await read_json(request, operation=operation)
    if not isinstance(data, dict):
        raise MalformedRequest(f"{operation}: expected a JSON object{expected}, got {type(data).__name__}")
    return data


def check_budget(estimate: int, budget: int | None, *, what: str, operation: str) -> None:
    """Refuse float64 work of ``estimate`` bytes over the memory budget (None: the machine's default budget).

    Raises:
        MemoryEstimateExceeded: with the estimate and the budget.
    """
    limit = default_memory_budget() if budget is None else budget
    if estimate > limit:
        raise MemoryEstimateExceeded(
            f"{operation}: {what} needs about {format_bytes(estimate)} in float64, over the memory budget of "
            f"{format_bytes(limit)} (NTK_MEMORY_BUDGET_BYTES); use fewer examples or mode 'trace'",
            estimate_bytes=estimate,
            budget_bytes=limit,
        )


def run_model(fn: Callable[[], T], *, record: ModelRecord, operation: str, device: str = "cpu") -> tuple[T, float]:
    """``fn()`` (a computation on ``record``'s model) and its wall time in seconds.

    Raises:
        ResourceLimit: ``device`` ran out of memory although the plan fit the budget (other processes, fragments).
        InvalidInput: the model's own forward failed on these inputs (e.g. a factory model with other
            expectations): the caller's input error, not a 500. Domain errors pass through.
    """
    start = time.perf_counter()
    try:
        out = fn()
    except NtkServiceError:
        raise
    except torch.OutOfMemoryError as exc:
        raise ResourceLimit(
            f"{operation}: {device} ran out of memory although the plan fit the memory budget; retry, send fewer "
            "examples or a cheaper mode, or lower NTK_MEMORY_BUDGET_BYTES"
        ) from exc
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise InvalidInput(f"{operation}: model {record.name!r} failed on the inputs: {exc}") from exc
    return out, time.perf_counter() - start


@dataclass(frozen=True)
class KernelCall:
    """A kernel request (``POST /v1/models/{name}/ntk``) read once by :func:`read_kernel_request`.

    Attributes:
        x1, x2: where the sides come from (x2 None: x2 = x1), not loaded yet.
        options: the request's wire options (mode, implementation, params, dtype, version, groups, rest).
        mode: ``options.mode`` as the engine's enum, parsed here once.
    """

    x1: SideSource
    x2: SideSource | None
    options: KernelOptions
    mode: KernelMode | DerivedMode


async def read_kernel_request(request: Request, query: dict[str, Any], *, operation: str) -> KernelCall:
    """The sides, the options and the mode of a kernel request, each parsed exactly once: from a JSON body, or
    from a binary body (.npy: x1; safetensors: x1 and optional x2) plus the options in ``query``.

    Args:
        query (dict): the options given as query parameters (name -> value; only those given).

    Raises:
        UnsupportedMediaType, MalformedRequest: not JSON / a tensor body, or a body that does not parse.
        InvalidInput: options in the query beside a JSON body, a JSON body without x1, unexpected tensors in a
            binary body, or an option of the wrong value (e.g. ``"mode: Input should be 'full', ..."``).
    """
    if content_type(request) in BINARY_TENSOR_TYPES:
        tensors = await read_tensors(request, operation=operation, npy_name="x1")
        x1: SideSource = take_tensor(tensors, "x1", operation=operation)
        x2: SideSource | None = tensors.pop("x2", None)
        if tensors:
            raise InvalidInput(f"{operation}: unexpected tensors {sorted(tensors)} in the body; send only x1 and x2")
        options = validate_body(KernelOptions, query, operation=operation)
    else:
        data = await read_object(request, operation=operation, expected=" with x1 (and x2, mode, ...)")
        if query:
            raise InvalidInput(
                f"{operation}: with a JSON body, put mode/implementation/params/dtype/version in the body, "
                "not in the query string (query options are for binary bodies)"
            )
        if "x1" not in data:
            raise InvalidInput(f'{operation}: the body needs x1 (a tensor or {{"dataset": id, "start", "stop"}})')
        x1_raw, x2_raw = data.pop("x1"), data.pop("x2", None)
        options = validate_body(KernelOptions, data, operation=operation)
        x1, x2, _ = await parse_sides(request, x1_raw, x2_raw, operation=operation)
    return KernelCall(x1, x2, options, parse_any_mode(options.mode, operation=operation))


def engine_options(options: KernelOptions, settings: Settings) -> NtkOptions:
    """The engine's options of a request, built once: the request's implementation and dtype, the server's memory
    budget (None: the device's default), device and TF32 policy.

    Raises:
        UnknownDevice: the settings name a device this machine lacks (the app checks it at startup).
    """
    return NtkOptions(
        implementation=options.implementation,
        dtype=None if options.dtype is None else DTYPES[options.dtype],
        memory_budget_bytes=settings.memory_budget_bytes,
        device=torch.device(settings.device),  # checked to exist by NtkOptions (and at startup)
        allow_tf32=settings.allow_tf32,
    )


def run_kernel(
    module: torch.nn.Module,
    x1: KernelInput,
    x2: KernelInput | None,
    call: KernelCall,
    *,
    record: ModelRecord,
    options: NtkOptions,
    side_cache: SideCache | None,
    operation: str,
) -> tuple[NtkResult | NtkGroupsResult, float]:
    """The engine call of a kernel request (blocking: run it in a worker thread) and its wall time in seconds:
    ``compute_ntk``, or ``compute_ntk_groups`` when the request has ``groups``. The side cache is passed only when
    a side is keyed, so two inline sides take the engine's joint pass.

    Returns:
        (NtkResult or NtkGroupsResult, float): the result (an ``NtkGroupsResult`` exactly when ``groups`` was
        given) and the seconds it took.

    Raises:
        as :func:`run_model`.
    """
    keyed = x1.key is not None or (x2 is not None and x2.key is not None)
    if not keyed or side_cache is None or side_cache.max_bytes <= 0:
        side_cache = None  # nothing to reuse: the engine may then take its joint pass
    t1, t2 = torch.from_numpy(x1.array), None if x2 is None else torch.from_numpy(x2.array)
    x2_key = None if x2 is None else x2.key
    wire_options = call.options
    engine: Callable[..., NtkResult | NtkGroupsResult] = (
        functools.partial(compute_ntk, params=wire_options.params)
        if wire_options.groups is None
        else functools.partial(compute_ntk_groups, groups=wire_options.groups, rest=wire_options.rest)
    )

    def compute() -> NtkResult | NtkGroupsResult:
        return engine(
            module, t1, t2, mode=call.mode, options=options, side_cache=side_cache, x1_key=x1.key, x2_key=x2_key
        )

    device = "cpu" if options.device is None else str(options.device)
    return run_model(compute, record=record, operation=operation, device=device)


async def answer_json(
    limiter: ComputeLimiter, run: Callable[[], dict[str, Any]], *, cap: int, operation: str, hint: str
) -> Response:
    """``run()``'s body as JSON, computed and encoded in one worker-thread hop under the compute limiter (a hop
    back to the loop with a big body would stall it).

    Raises:
        PayloadTooLarge: the encoded body is over ``cap`` bytes (413); ``hint`` says how to ask for less.
    """

    def respond() -> Response:
        response = json_response(run())
        if len(response.body) > cap:
            raise PayloadTooLarge(
                f"{operation}: the response would be {format_bytes(len(response.body))}, over the server's JSON "
                f"limit of {format_bytes(cap)} (NTK_MAX_JSON_RESPONSE_BYTES); {hint}"
            )
        return response

    return await limiter.run(respond, operation=operation)
