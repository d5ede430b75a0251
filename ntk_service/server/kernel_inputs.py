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
import re
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
from ntk_service.kernels.problem.outputs import parse_output, select_output
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
)
from ntk_service.server.metrics import Metrics
from ntk_service.server.schemas import DatasetRef, KernelOptions, validate_body

__all__ = [
    "INPUT_NAME",
    "MIN_JSON_BYTES_PER_VALUE",
    "ComputeContext",
    "ComputeContextDep",
    "KernelCall",
    "KernelInput",
    "NamedArrays",
    "SideSource",
    "answer_json",
    "check_budget",
    "check_input",
    "check_output",
    "output_size",
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
    "split_sides",
]

T = TypeVar("T")

MIN_JSON_BYTES_PER_VALUE = 4
"""The shortest a float can be in JSON data ("0.0,"): an answer whose value count times this exceeds the JSON cap
is refused before computing; otherwise the encoded length decides."""

NamedArrays = dict[str, np.ndarray]
"""One side of a model taking several tensors: forward's argument name -> (N, *shape)."""

SideSource = np.ndarray | NamedArrays | DatasetRef
"""Where one side of a request comes from: an inline array (N, *input), inline named arrays, or rows of a stored
data set. (The engine's ``kernels.algorithm.Side`` is another thing: what an implementation keeps from a block of
examples.)"""

INPUT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
"""A named input: a Python identifier (forward's keyword argument), at most 64 characters."""


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


def inline(array: np.ndarray | NamedArrays) -> KernelInput:
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


def check_input(array: np.ndarray | NamedArrays, record: ModelRecord, *, side: str, operation: str) -> None:
    """Refuse inputs the model cannot take, before computing: per-example shape, dtype, token range; for a model
    with named inputs (``record.inputs``) the names, one N for every leaf, and each leaf's shape, dtype and ids.

    Raises:
        ShapeMismatch: not a batch (N, *input_shape), token ids (N, T) longer than the model's ``max_len``, or
            named leaves with different N.
        InvalidInput: floats for a token model or integers for a float model; token ids outside the vocabulary;
            named arrays for a model taking one tensor or the reverse; a missing or extra name.
    """
    if record.inputs is not None or isinstance(array, dict):
        _check_named(array, record, side=side, operation=operation)
        return
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
    _check_leaf(array, record.input_dtype, _vocabulary(architecture), record, side=side, operation=operation)


def _check_leaf(
    array: np.ndarray, dtype: str, vocab: int | None, record: ModelRecord, *, side: str, operation: str
) -> None:
    """One tensor's dtype against the model's, and its ids (every example) against the vocabulary."""
    is_integer_model = dtype == "int64"
    wanted = "integer token ids" if is_integer_model else "float32 or float64 values"
    if is_integer_model != (array.dtype.kind in "iu"):
        raise InvalidInput(
            f"{operation}: {side} has dtype {array.dtype}, model {record.name!r} expects {dtype}; send {wanted}"
        )
    if vocab is not None and array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= vocab:
            raise InvalidInput(
                f"{operation}: {side} has token ids in [{low}, {high}], model {record.name!r} "
                f"has a vocabulary of {vocab} (ids 0..{vocab - 1})"
            )


def _check_named(array: np.ndarray | NamedArrays, record: ModelRecord, *, side: str, operation: str) -> None:
    spec = record.inputs
    if spec is None:
        raise InvalidInput(
            f"{operation}: {side} is named arrays {sorted(array)[:8]}, model {record.name!r} takes one tensor x of "
            f"per-example shape {tuple(record.input_shape)}; send {side} as one tensor"
        )
    names = list(spec.names)
    example = "{" + ", ".join(f'"{n}": ...' for n in names) + "}"
    if not isinstance(array, dict):
        raise InvalidInput(
            f"{operation}: {side} is one tensor, model {record.name!r} takes the named inputs {names}; send {side} "
            f"as an object of named tensors {example}"
        )
    missing, extra = [n for n in names if n not in array], sorted(set(array) - set(names))
    if missing or extra:
        raise InvalidInput(
            f"{operation}: {side} has the inputs {sorted(array)}, model {record.name!r} takes {names}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    n = None
    for leaf in spec.leaves:
        value = array[leaf.name]
        where = f"{side}[{leaf.name!r}]"
        if value.ndim < 1:
            raise ShapeMismatch(f"{operation}: {where} must be a batch (N, *{leaf.shape}), got a scalar")
        if n is not None and value.shape[0] != n:
            raise ShapeMismatch(
                f"{operation}: {where} has {value.shape[0]} examples, {side}[{names[0]!r}] has {n}; every input "
                "of a side needs the same N (dimension 0)"
            )
        n = value.shape[0]
        if tuple(value.shape[1:]) != leaf.shape:
            raise ShapeMismatch(
                f"{operation}: {where} has per-example shape {tuple(value.shape[1:])}, model {record.name!r} "
                f"expects {leaf.shape}; send a batch of shape (N, {', '.join(map(str, leaf.shape))})"
            )
        _check_leaf(value, leaf.dtype, leaf.vocab_size, record, side=where, operation=operation)
        if leaf.dtype == "int64" and value.dtype != np.int64:
            array[leaf.name] = value.astype(np.int64)  # the graph's embedding and masks take int64


def check_output(output: str | None, record: ModelRecord, *, operation: str) -> None:
    """Refuse ``output`` for a model whose forward returns a tensor (the ``exported`` architecture lists the
    entries of a dict output in ``outputs``; factory models may return anything, so the engine decides).

    Raises:
        InvalidInput: ``output`` given for a model returning one tensor.
    """
    architecture = record.architecture
    if output is None or architecture.get("family") == "factory" or "outputs" in architecture:
        return
    raise InvalidInput(
        f"{operation}: output={output!r} was given, but model {record.name!r} returns one tensor; drop output "
        "(it selects from a model returning a dict, e.g. a Hugging Face ModelOutput)"
    )


def output_size(output: str | None, record: ModelRecord, *, operation: str) -> int:
    """k of the kernel ``output`` selects, known before any compute: the record's ``output_dim`` for a tensor
    output; for a dict output, the selection applied to empty (meta) tensors of the per-example shapes the exported
    architecture lists in ``outputs``. A factory model's output is only known to the engine: its ``output_dim``.

    Raises:
        InvalidInput: ``output`` for a model returning one tensor (``check_output``), or a path that does not
            select from the listed outputs (the message names what is there).
    """
    check_output(output, record, operation=operation)
    outputs = record.architecture.get("outputs")
    if output is None or not isinstance(outputs, dict):
        return record.output_dim
    shapes = {key: torch.empty((1, *shape), device="meta") for key, shape in outputs.items()}
    return int(select_output(shapes, parse_output(output, operation), operation).numel())


def _named_side(raw: dict[str, Any], *, side: str) -> NamedArrays:
    """``{"name": tensor, ...}``: one wire tensor per forward argument name."""
    if not raw:
        raise InvalidInput(f"{side}: an empty object; send a tensor or an object of named tensors")
    arrays = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not INPUT_NAME.match(name):
            raise InvalidInput(
                f"{side}: input name {str(name)[:80]!r} is not an identifier (letters, digits, _; at most 64); name "
                "each tensor after its forward argument"
            )
        arrays[name] = wire.tensor_from_json(value, name=f"{side}[{name!r}]")
    return arrays


def parse_side(raw: Any, *, side: str, operation: str) -> SideSource:
    """A JSON side: ``{"dataset": id, "start", "stop"}`` is a :class:`DatasetRef`, an object with ``data`` (or with
    ``shape`` and ``dtype``: one missing its data) a wire tensor, any other object named tensors
    (``{"input_ids": tensor, "attention_mask": tensor}``)."""
    if isinstance(raw, dict) and "dataset" in raw:
        return validate_body(DatasetRef, raw, operation=f"{operation}: {side}")
    if isinstance(raw, dict) and "data" not in raw and not {"shape", "dtype"} <= set(raw):
        return _named_side(raw, side=f"{operation}: {side}")
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


def check_budget(estimate: int, budget: int | None, *, what: str, operation: str, mode: str | None = None) -> None:
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
            f"{operation}: {what} needs about {format_bytes(estimate)} in float64, over the memory budget of "
            f"{format_bytes(limit)} (NTK_MEMORY_BUDGET_BYTES); {advice}",
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
        x1, *others = split_sides(tensors, ("x1", "x2"), operation=operation)
        x2 = others[0]
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


def split_sides(
    tensors: dict[str, np.ndarray], sides: tuple[str, ...], *, operation: str
) -> tuple[SideSource, *tuple[SideSource | None, ...]]:
    """The sides of a safetensors body: a tensor named after the side (``x1``), or named inputs ``x1.<name>``
    (``x1.input_ids``, ``x1.attention_mask``); the first side is required, the others optional (None).

    Raises:
        InvalidInput: the first side missing, a side both whole and named, a name that is not an identifier, or
            tensors of no side (each named in the message).
    """
    found: dict[str, Any] = {}
    for key in sorted(tensors):
        side, dot, name = key.partition(".")
        if side not in sides or (dot and not INPUT_NAME.match(name)):
            raise InvalidInput(
                f"{operation}: the body has the tensor {key[:80]!r}; expected {' and '.join(sides)} (one tensor "
                f"each) or named inputs like '{sides[0]}.input_ids' (identifiers after the dot)"
            )
        if dot:
            if isinstance(found.get(side), np.ndarray):
                raise InvalidInput(f"{operation}: the body has both {side!r} and {key!r}; send one or the other")
            found.setdefault(side, {})[name] = tensors[key]
        elif side in found:
            raise InvalidInput(f"{operation}: the body has both {side!r} and named {side}.* tensors")
        else:
            found[side] = tensors[key]
    if sides[0] not in found:
        raise InvalidInput(
            f"{operation}: the safetensors body has no tensor {sides[0]!r} nor '{sides[0]}.<name>' tensors (it has "
            f"{sorted(tensors)[:8] or 'none'}); name the tensor {sides[0]!r}"
        )
    return (found[sides[0]], *(found.get(side) for side in sides[1:]))


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
    t1, t2 = x1.to_torch(record), None if x2 is None else x2.to_torch(record)
    x2_key = None if x2 is None else x2.key
    wire_options = call.options
    output = getattr(wire_options, "output", None)
    check_output(output, record, operation=operation)
    engine: Callable[..., NtkResult | NtkGroupsResult] = (
        functools.partial(compute_ntk, params=wire_options.params, output=output)
        if wire_options.groups is None
        else functools.partial(compute_ntk_groups, groups=wire_options.groups, rest=wire_options.rest, output=output)
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
