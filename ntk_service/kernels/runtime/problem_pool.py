"""Prepared problems kept across ``compute_ntk`` calls, so repeated kernels of one model skip the set-up.

Preparing a problem costs a structural copy of the module tree (NOTE [private module]), a probe forward with a
FLOP counter, and, per implementation, one-off analysis such as the structured path's structure plan (keyed on
the problem object). For the benchmark MLP at N = M = 64 that set-up was about as long as the kernel itself.

NOTE [problem pool]: idle problems are kept per model object (weakly: they go with the model) and per call
signature (per-example input shape and kind, compute dtype, parameter globs). A problem is checked out by one
call at a time, so concurrent calls on one model each get their own private copy, as before. A kept problem is
valid while the model looks the same: ``fingerprint`` covers every submodule's identity, type and attributes
(hyper-parameters such as stride or negative_slope, hooks, the attributes of a config object it holds: the
private copy holds a copy of that object) and every tensor's identity, storage, shape and dtype.
In-place updates of values (an optimizer step, ``load_state_dict``) keep the fingerprint: the kept problem
shares those tensors, so it sees the new values. Anything else (a replaced submodule or parameter, ``.to()``,
``p.data = ...``, a changed attribute) changes the fingerprint and drops the model's kept problems. Problems
whose tensors would be dtype-converted copies (a float32 model computed in float64) are not kept: they would hold
a second copy of the weights and go stale on in-place updates; nor are problems of a model copied to another device
(``device=``): the server keeps its models on the device instead (the registry's module cache holds that copy).
"""

from __future__ import annotations

import contextlib
import enum
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ntk_service.kernels.problem.batch import Batch, check_ids, to_device
from ntk_service.kernels.problem.batch import signature as input_signature
from ntk_service.kernels.problem.inputs import validate_inputs
from ntk_service.kernels.problem.outputs import OutputPath
from ntk_service.kernels.problem.preparation import build_problem
from ntk_service.kernels.problem.private_module import check_model, eval_semantics, private_copy
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime.device import model_device, place_module

__all__ = [
    "IDLE_PER_SIGNATURE",
    "SIGNATURES_PER_MODEL",
    "Prepared",
    "clear",
    "fingerprint",
    "prepared_problem",
]

IDLE_PER_SIGNATURE = 4
"""Idle problems kept per (model, signature): the most calls on one model that run at once without set-up."""

SIGNATURES_PER_MODEL = 8
"""Signatures kept per model, least recently used dropped first."""

_ATOMS = frozenset({int, float, bool, str, bytes, type(None), torch.dtype, torch.device})
_EMPTY: Hashable = ()


def _freeze(value: object, depth: int = 0) -> Hashable:
    """A hashable summary of an attribute value: atoms as themselves, tensors by identity and storage,
    containers element-wise and plain objects (a config namespace) by identity and attributes (3 levels deep),
    modules and anything else by identity."""
    kind = type(value)
    if kind in _ATOMS or isinstance(value, enum.Enum | type):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value.untyped_storage().data_ptr(), tuple(value.shape), value.dtype)
    if depth < 3:
        if isinstance(value, dict):  # hook dicts, _parameters, _buffers, _modules: mostly empty
            return tuple((k, _freeze(v, depth + 1)) for k, v in value.items()) if value else _EMPTY
        if isinstance(value, tuple | list):
            return (kind.__name__, *(_freeze(v, depth + 1) for v in value))
        if isinstance(value, set | frozenset):
            return ("set", *sorted(repr(v) for v in value)) if value else _EMPTY
        state = None if isinstance(value, nn.Module) else getattr(value, "__dict__", None)
        if isinstance(state, dict) and state:  # ``model.cfg.flag = True`` changes the model (the copy has its own)
            return ("object", id(value), _freeze(state, depth + 1))
    return ("object", id(value))


_CONTAINERS = frozenset({dict, OrderedDict, list, tuple, set})


def _module_print(module: nn.Module) -> Hashable:
    items: list[object] = [id(module), type(module)]
    for key, value in vars(module).items():
        kind = type(value)
        if kind in _ATOMS:
            if key != "training":  # problems run in eval mode whatever the flag
                items.append((key, value))
        elif kind not in _CONTAINERS or value:  # most hook dicts are empty: nothing to add
            items.append((key, _freeze(value)))
    return tuple(items)


def fingerprint(model: nn.Module) -> Hashable:
    """What a kept problem depends on: each submodule's identity, type and attributes but its training flag
    (problems run in eval mode), tensors by identity, storage, shape and dtype (see NOTE [problem pool])."""
    return tuple(_module_print(m) for m in model.modules())


@dataclass
class _ModelEntry:
    fingerprint: Hashable
    idle: OrderedDict[Hashable, list[NtkProblem]] = field(default_factory=OrderedDict)


_POOL: weakref.WeakKeyDictionary[nn.Module, _ModelEntry] = weakref.WeakKeyDictionary()
_POOL_LOCK = threading.Lock()


def _take(model: nn.Module, print_: Hashable, signature: Hashable) -> NtkProblem | None:
    with _POOL_LOCK:
        entry = _POOL.get(model)
        if entry is None or entry.fingerprint != print_:
            _POOL[model] = _ModelEntry(print_)
            return None
        idle = entry.idle.get(signature)
        if not idle:
            return None
        entry.idle.move_to_end(signature)
        return idle.pop()


def _give(model: nn.Module, print_: Hashable, signature: Hashable, problem: NtkProblem) -> None:
    with _POOL_LOCK:
        entry = _POOL.get(model)
        if entry is None or entry.fingerprint != print_:
            return  # the model changed while this call ran: its problem describes the old one
        idle = entry.idle.setdefault(signature, [])
        entry.idle.move_to_end(signature)
        if len(idle) < IDLE_PER_SIGNATURE:
            idle.append(problem)
        while len(entry.idle) > SIGNATURES_PER_MODEL:
            entry.idle.popitem(last=False)


def clear() -> None:
    """Forget every kept problem (tests; a server never needs this: entries go with their models)."""
    with _POOL_LOCK:
        _POOL.clear()


def _converts(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether preparing for ``dtype`` copies some floating tensor into another dtype."""
    tensors = [*model.parameters(), *model.buffers()]
    return any(t.is_floating_point() and t.dtype != dtype for t in tensors)


@dataclass(frozen=True)
class Prepared:
    """What ``prepared_problem`` yields: the problem and the validated inputs, as ``prepare_problem`` returns
    them. A kept problem's structure plan was made on an earlier call's first example: the same per-example
    shape, and models whose layer calls depend on values are refused by the probe (``vmap``) anyway."""

    problem: NtkProblem
    x1: Batch
    x2: Batch | None


@contextlib.contextmanager
def prepared_problem(
    model: nn.Module,
    x1: object,
    x2: object | None,
    *,
    params: Sequence[str] | None,
    dtype: torch.dtype | str | None,
    device: torch.device | None = None,
    output: OutputPath | None = None,
) -> Iterator[Prepared]:
    """Validate the inputs and check out a prepared problem for ``model`` (kept or new; NOTE [problem pool]).

    Args:
        model, x1, x2, params, dtype: as ``preparation.prepare_problem``.
        device: where to compute; the inputs are moved there, and a model elsewhere is copied there for this call
            (not kept). Default: None, the model's device.
        output: which tensor of forward's return value is f (``outputs.parse_output``); part of the kept
            problem's key. Default: None.

    Yields:
        The problem, the caller's alone until the block exits, and kept for later calls when it exits without an
        error.

    Raises:
        As ``preparation.prepare_problem``.
    """
    check_model(model)
    compute_dtype, x1t, x2t = validate_inputs(model, x1, x2, dtype)
    if device is not None:
        x1t, x2t = to_device(x1t, device), None if x2t is None else to_device(x2t, device)
        if model_device(model) != device:  # a per-call copy on the device, see the module docstring
            placed = place_module(model, device).eval()
            copied = build_problem(placed, x1t, x2t, params=params, dtype=compute_dtype, output=output)
            copied.owns_module = not _converts(placed, compute_dtype)
            yield Prepared(copied, x1t, x2t)
            return
    signature: Hashable = (
        input_signature(x1t),
        compute_dtype,
        None if params is None else tuple(params) if not isinstance(params, str) else params,
        output,
    )
    print_: Hashable | None = None
    problem: NtkProblem | None = None
    try:  # a kept problem for this signature never converts (those are not kept): no need to check
        print_ = fingerprint(model)
        problem = _take(model, print_, signature)
    except TypeError:  # an unhashable model or glob list: prepared per call
        print_ = None
    if problem is None and print_ is not None and _converts(model, compute_dtype):
        print_ = None
    if problem is None:
        private = None if print_ is None else private_copy(model)
        if private is None:  # not kept, or uncopyable (then the locked original): prepared per call
            with eval_semantics(model) as module:
                problem = build_problem(module, x1t, x2t, params=params, dtype=compute_dtype, output=output)
                yield Prepared(problem, x1t, x2t)
            return
        problem = build_problem(private, x1t, x2t, params=params, dtype=compute_dtype, output=output)
        problem.owns_module = True  # a private copy, no tensor converted: its own tensors are the problem's
    else:  # a kept problem: this call's ids are checked against the vocabularies its probe found
        check_ids(problem.id_tables, x1t, "x1")
        if x2t is not None:
            check_ids(problem.id_tables, x2t, "x2")
    yield Prepared(problem, x1t, x2t)
    _give(model, print_, signature, problem)
