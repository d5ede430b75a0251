"""Computing a request on a model version: the record read once, the sides loaded and checked, the engine run
under the compute limiter, failures mapped to the caller's errors.

``/ntk`` (``routes/kernels.py``), the kernel family (``routes/kernel_family.py``), the analyses
(``routes/analysis.py``) and the solve route take their inputs the same way: the body is read first
(``reading.py``), then, in one worker-thread hop, :func:`load_sides` reads the model record, loads each side
(data-set rows read) and checks it against the model's input contract (``registry/input_contract.py``); the
computation itself is a second hop, under the compute limiter, and takes the module of the record already read
(``ModelRegistry.module``). ``/ntk`` with inline sides, which need no stored data read, loads them in its compute
hop instead while a compute slot is free (:func:`prepare_kernel_sides`): a hop costs 0.2-0.4 ms, a few percent of a
small kernel. The model's failures on the inputs are the caller's 422, not a 500.

The shared side cache holds data-set rows only (keyed by model version, data set and row range). Inline sides
are not keyed: hashing them costs time, a client rarely resends the same bytes, and an unkeyed kernel with x1 and
x2 takes the engine's joint pass (one forward and reverse pass over both sides) instead of two separate ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import anyio.to_thread
import numpy as np
import torch
from fastapi import Depends, Request
from starlette.responses import Response

from ntk_service.config import Settings
from ntk_service.errors import (
    InvalidInput,
    MemoryEstimateExceeded,
    NtkServiceError,
    PayloadTooLarge,
    ResourceLimit,
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
from ntk_service.kernels.modes import result_shape
from ntk_service.kernels.spec import KernelSpec
from ntk_service.registry import DatasetStore, ModelRecord, ModelRegistry
from ntk_service.registry.input_contract import NamedArrays, check_input, check_output, output_size
from ntk_service.server.compute import ComputeLimiter
from ntk_service.server.deps import ComputeDep, app_state
from ntk_service.server.media import MIN_JSON_BYTES_PER_VALUE, json_response, json_too_large
from ntk_service.server.metrics import Metrics
from ntk_service.server.reading import KernelCall, SideSource
from ntk_service.server.schemas import DatasetRef

__all__ = [
    "ComputeContext",
    "ComputeContextDep",
    "KernelInput",
    "answer_json",
    "check_budget",
    "from_dataset",
    "inline",
    "load_kernel_sides",
    "load_side",
    "load_sides",
    "prepare_kernel_sides",
    "reads_sides",
    "run_kernel",
    "run_model",
]

T = TypeVar("T")


@dataclass(frozen=True)
class KernelInput:
    """One side, loaded: the array (N, *input) or named arrays (name -> (N, *shape), checked to share N), and the
    side-cache key naming its content (None: not cached)."""

    array: np.ndarray | NamedArrays
    key: Hashable | None

    @property
    def n(self) -> int:
        """N, the examples of this side."""
        if isinstance(self.array, dict):
            return int(next(iter(self.array.values())).shape[0])
        return int(self.array.shape[0])

    def to_torch(self, record: ModelRecord) -> torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
        """What the model's forward takes: a tensor, a tuple (positional inputs) or a dict (keyword inputs) in the
        order of ``record.inputs``, sharing memory with the arrays."""
        if not isinstance(self.array, dict):
            return torch.from_numpy(self.array)
        spec = record.inputs
        names = list(self.array) if spec is None else list(spec.names)
        tensors = {name: torch.from_numpy(self.array[name]) for name in names}
        return tuple(tensors.values()) if spec is not None and spec.kind == "tuple" else tensors


@dataclass(frozen=True)
class ComputeContext:
    """The lifespan's objects a computing route needs (one dependency instead of six parameters)."""

    registry: ModelRegistry
    datasets: DatasetStore
    limiter: ComputeLimiter
    side_cache: SideCache
    settings: Settings
    metrics: Metrics


async def _compute_context(request: Request, limiter: ComputeDep) -> ComputeContext:
    # One dependency reading app.state, not six solved one by one (FastAPI's solve of each costs ~30 us a
    # request); the limiter stays a dependency of its own, so that the OpenAPI pass documents the route's 429.
    registry, datasets, side_cache, settings, metrics = (
        app_state(request, name) for name in ("registry", "datasets", "side_cache", "settings", "metrics")
    )
    return ComputeContext(registry, datasets, limiter, side_cache, settings, metrics)


ComputeContextDep = Annotated[ComputeContext, Depends(_compute_context)]
"""A route's :class:`ComputeContext`; declare it after the access dependency (auth is checked first)."""


def inline(array: np.ndarray | NamedArrays) -> KernelInput:
    """An inline side: never keyed (see the module docstring)."""
    return KernelInput(array, None)


def from_dataset(ref: DatasetRef, record: ModelRecord, datasets: DatasetStore) -> KernelInput:
    """Rows ``ref.start:ref.stop`` of a stored data set, keyed by the model version, data set and row range."""
    array = datasets.load(ref.dataset, ref.start, ref.stop)
    return KernelInput(array, (*record.cache_key, "dataset", ref.dataset, ref.start, ref.stop))


def load_side(raw: SideSource, record: ModelRecord, datasets: DatasetStore, *, side: str) -> KernelInput:
    """The side loaded (data set rows read) and checked against the model (``check_input``); blocking."""
    item = from_dataset(raw, record, datasets) if isinstance(raw, DatasetRef) else inline(raw)
    check_input(item.array, record, side=side)
    return item


async def load_sides(
    ctx: ComputeContext,
    name: str,
    version: int | None,
    x1: SideSource,
    x2: SideSource | None,
    *,
    output: str | None = None,
) -> tuple[ModelRecord, KernelInput, KernelInput | None]:
    """The model record (latest when ``version`` is None), read once, and both sides loaded and checked against
    its input contract, ``output`` against its outputs (``check_output``); in one worker-thread hop."""

    def prepare() -> tuple[ModelRecord, KernelInput, KernelInput | None]:
        record = ctx.registry.get(name, version)
        check_output(output, record)
        first = load_side(x1, record, ctx.datasets, side="x1")
        second = None if x2 is None else load_side(x2, record, ctx.datasets, side="x2")
        return record, first, second

    return await anyio.to_thread.run_sync(prepare)


def reads_sides(call: KernelCall) -> bool:
    """Whether loading ``call``'s sides reads stored data (a data-set side), i.e. blocking I/O beyond the model
    record's read; inline sides need none."""
    return isinstance(call.x1, DatasetRef) or isinstance(call.x2, DatasetRef)


def prepare_kernel_sides(
    ctx: ComputeContext, name: str, call: KernelCall, *, json_cap: int | None
) -> tuple[ModelRecord, KernelInput, KernelInput | None]:
    """The model record and both sides of a kernel request, loaded and checked (blocking: run it in a worker
    thread): :func:`load_sides`'s work, and, for a JSON answer (``json_cap`` not None), its size refused before
    computing when even the shortest JSON of that many values would pass the cap.

    Raises:
        NotAcceptable: at least ``MIN_JSON_BYTES_PER_VALUE`` bytes per value would pass ``json_cap`` (406).
    """
    spec = call.spec
    record = ctx.registry.get(name, call.version)
    check_output(spec.output, record)
    first = load_side(call.x1, record, ctx.datasets, side="x1")
    second = None if call.x2 is None else load_side(call.x2, record, ctx.datasets, side="x2")
    if json_cap is not None:
        n = first.n
        m = n if second is None else second.n
        k = output_size(spec.output_path, record)
        numel = math.prod(result_shape(spec.mode, n, m, k))
        if isinstance(spec.groups, tuple):  # at least one kernel per group ("modules": known after the compute)
            numel *= len(spec.groups) + int(spec.rest)
        if numel * MIN_JSON_BYTES_PER_VALUE > json_cap:
            shortest = f"at least {format_bytes(numel * MIN_JSON_BYTES_PER_VALUE)}"
            raise json_too_large(shortest, json_cap)
    return record, first, second


async def load_kernel_sides(
    ctx: ComputeContext, name: str, call: KernelCall, *, json_cap: int | None
) -> tuple[ModelRecord, KernelInput, KernelInput | None]:
    """:func:`prepare_kernel_sides` in one worker-thread hop.

    Raises:
        NotAcceptable: at least ``MIN_JSON_BYTES_PER_VALUE`` bytes per value would pass ``json_cap`` (406).
    """
    return await anyio.to_thread.run_sync(lambda: prepare_kernel_sides(ctx, name, call, json_cap=json_cap))


def check_budget(estimate: int, budget: int | None, *, what: str, mode: str | None = None) -> None:
    """Refuse float64 work of ``estimate`` bytes over the memory budget (None: the machine's default budget).

    Args:
        mode: the kernel mode the work is on; "full" adds mode 'trace' to the advice (a k²-times smaller kernel).
            Default: None (no mode to change).

    Raises:
        MemoryEstimateExceeded: with the estimate and the budget.
    """
    limit = default_memory_budget() if budget is None else budget
    if estimate > limit:
        advice = "use fewer examples or mode 'trace'" if mode == "full" else "use fewer examples"
        raise MemoryEstimateExceeded(
            detail=f"{what} needs about {format_bytes(estimate)} in float64, over the memory budget of "
            f"{format_bytes(limit)} (NTK_MEMORY_BUDGET_BYTES); {advice}",
            estimate_bytes=estimate,
            budget_bytes=limit,
        )


def run_model(fn: Callable[[], T], *, record: ModelRecord, device: str = "cpu") -> tuple[T, float]:
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
            detail=f"{device} ran out of memory although the plan fit the memory budget; retry, send fewer "
            "examples or a cheaper mode, or lower NTK_MEMORY_BUDGET_BYTES"
        ) from exc
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise InvalidInput(detail=f"model {record.name!r} failed on the inputs: {exc}") from exc
    return out, time.perf_counter() - start


def run_kernel(
    module: torch.nn.Module,
    x1: KernelInput,
    x2: KernelInput | None,
    spec: KernelSpec,
    options: NtkOptions,
    *,
    record: ModelRecord,
    side_cache: SideCache | None,
) -> tuple[NtkResult | NtkGroupsResult, float]:
    """The engine call of a kernel (blocking: run it in a worker thread) and its wall time in seconds:
    ``compute_ntk``, or ``compute_ntk_groups`` when the spec has groups, with the request's two values. The side
    cache is passed only when a side is keyed, so two inline sides take the engine's joint pass.

    Returns:
        (NtkResult or NtkGroupsResult, float): the result (an ``NtkGroupsResult`` exactly when the spec has
        groups) and the seconds it took.

    Raises:
        as :func:`run_model`.
    """
    keyed = x1.key is not None or (x2 is not None and x2.key is not None)
    if not keyed or side_cache is None or side_cache.max_bytes <= 0:
        side_cache = None  # nothing to reuse: the engine may then take its joint pass
    t1, t2 = x1.to_torch(record), None if x2 is None else x2.to_torch(record)
    x2_key = None if x2 is None else x2.key
    engine = compute_ntk if spec.groups is None else compute_ntk_groups

    def compute() -> NtkResult | NtkGroupsResult:
        return engine(module, t1, t2, spec=spec, options=options, side_cache=side_cache, x1_key=x1.key, x2_key=x2_key)

    device = "cpu" if options.device is None else str(options.device)
    return run_model(compute, record=record, device=device)


async def answer_json(limiter: ComputeLimiter, run: Callable[[], dict[str, Any]], *, cap: int, hint: str) -> Response:
    """``run()``'s body as JSON, computed and encoded in one worker-thread hop under the compute limiter (a hop
    back to the loop with a big body would stall it).

    Raises:
        PayloadTooLarge: the encoded body is over ``cap`` bytes (413); ``hint`` says how to ask for less.
    """

    def respond() -> Response:
        response = json_response(run())
        if len(response.body) > cap:
            raise PayloadTooLarge(
                detail=f"the response would be {format_bytes(len(response.body))}, over the server's JSON "
                f"limit of {format_bytes(cap)} (NTK_MAX_JSON_RESPONSE_BYTES); {hint}"
            )
        return response

    return await limiter.run(respond)
