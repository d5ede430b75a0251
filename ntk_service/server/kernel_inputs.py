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

import time
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
from ntk_service.kernels import NtkResult, SideCache, compute_ntk, default_memory_budget
from ntk_service.registry import DatasetStore, ModelRecord, ModelRegistry
from ntk_service.server.compute import ComputeLimiter
from ntk_service.server.deps import ComputeDep, DatasetsDep, MetricsDep, RegistryDep, SettingsDep, SideCacheDep
from ntk_service.server.media import json_response, parse_off_loop, read_json
from ntk_service.server.metrics import Metrics
from ntk_service.server.schemas import DatasetRef, KernelOptions, validate_body

__all__ = [
    "MIN_JSON_BYTES_PER_VALUE",
    "ComputeContext",
    "ComputeContextDep",
    "KernelInput",
    "Side",
    "answer_json",
    "check_budget",
    "check_input",
    "engine_arguments",
    "from_dataset",
    "inline",
    "load_side",
    "load_sides",
    "parse_side",
    "parse_sides",
    "read_object",
    "run_kernel",
    "run_model",
]

T = TypeVar("T")

MIN_JSON_BYTES_PER_VALUE = 4
"""The shortest a float can be in JSON data ("0.0,"): an answer whose value count times this exceeds the JSON cap
is refused before computing; otherwise the encoded length decides."""

Side = np.ndarray | DatasetRef
"""One side as the request gave it: an inline array (N, *input) or rows of a stored data set."""


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


def parse_side(raw: Any, *, side: str, operation: str) -> Side:
    """A JSON side: ``{"dataset": id, "start", "stop"}`` is a :class:`DatasetRef`, anything else a wire tensor."""
    if isinstance(raw, dict) and "dataset" in raw:
        return validate_body(DatasetRef, raw, operation=f"{operation}: {side}")
    return wire.tensor_from_json(raw, name=side)


async def parse_sides(
    request: Request, x1: Any, x2: Any, *, operation: str, extra: dict[str, Any] | None = None
) -> tuple[Side, Side | None, dict[str, np.ndarray]]:
    """x1, x2 (None: absent) and the ``extra`` JSON tensors of a JSON body, parsed off the loop when it is large."""
    fields = extra or {}

    def parse() -> tuple[Side, Side | None, dict[str, np.ndarray]]:
        first = parse_side(x1, side="x1", operation=operation)
        second = None if x2 is None else parse_side(x2, side="x2", operation=operation)
        return first, second, {key: wire.tensor_from_json(value, name=key) for key, value in fields.items()}

    return await parse_off_loop(parse, size=len(await request.body()))  # the body is cached by now


def load_side(raw: Side, record: ModelRecord, datasets: DatasetStore, *, side: str, operation: str) -> KernelInput:
    """The side loaded (data set rows read) and checked against the model (:func:`check_input`); blocking."""
    item = from_dataset(raw, record, datasets) if isinstance(raw, DatasetRef) else inline(raw)
    check_input(item.array, record, side=side, operation=operation)
    return item


async def load_sides(
    ctx: ComputeContext, name: str, version: int | None, x1: Side, x2: Side | None, *, operation: str
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


def engine_arguments(
    x1: KernelInput,
    x2: KernelInput | None,
    options: KernelOptions,
    *,
    budget: int | None,
    side_cache: SideCache | None,
    device: str,
    allow_tf32: bool,
) -> dict[str, Any]:
    """The arguments ``compute_ntk`` and ``compute_ntk_groups`` share, from a request's sides and options. The side
    cache is passed only when a side is keyed, so two inline sides take the joint pass."""
    keyed = x1.key is not None or (x2 is not None and x2.key is not None)
    if not keyed or side_cache is None or side_cache.max_bytes <= 0:
        side_cache = None  # nothing to reuse: the engine may then take its joint pass
    return {
        "x1": torch.from_numpy(x1.array),
        "x2": None if x2 is None else torch.from_numpy(x2.array),
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


def run_kernel(
    module: torch.nn.Module,
    x1: KernelInput,
    x2: KernelInput | None,
    options: KernelOptions,
    *,
    record: ModelRecord,
    budget: int | None,
    side_cache: SideCache | None,
    operation: str,
    device: str = "cpu",
    allow_tf32: bool = False,
) -> tuple[NtkResult, float]:
    """The engine call :func:`~ntk_service.kernels.compute_ntk` (blocking: run it in a worker thread) and its wall
    time in seconds (arguments: ``engine_arguments``)."""
    args = engine_arguments(x1, x2, options, budget=budget, side_cache=side_cache, device=device, allow_tf32=allow_tf32)
    return run_model(
        lambda: compute_ntk(module, params=options.params, **args), record=record, operation=operation, device=device
    )


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
