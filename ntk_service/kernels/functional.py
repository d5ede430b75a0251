"""From an ``nn.Module`` to the per-example function f(params, x) -> (k,) that every implementation differentiates.

``prepare_problem`` validates the inputs, selects the parameters (globs, tied weights once), casts to the compute
dtype, and probes the model once on a few examples: it checks that examples do not interact, measures the output
size k, counts the forward FLOPs per example ([FP]) and the bytes autograd saves for backward per example. The
planner turns those measurements into a cost and memory estimate.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import itertools
import math
import threading
import weakref
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.utils.flop_counter import FlopCounterMode

from ntk_service.errors import (
    EmptyBatch,
    InvalidInput,
    NoMatchingParameters,
    NonFiniteInput,
    ShapeMismatch,
    UnsupportedModel,
)
from ntk_service.kernels.inputs import (
    Batch,
    IdTables,
    as_batch,
    batch_size,
    call_module,
    check_ids,
    check_sides,
    concat,
    embedding_feeds,
    is_batch,
    is_data_dependent,
    leaves,
    one_example,
    take,
    template,
    unsqueeze,
)
from ntk_service.kernels.math_attention import math_attention
from ntk_service.kernels.outputs import OutputPath, select_output
from ntk_service.kernels.types import NamedTensors

__all__ = [
    "NtkProblem",
    "build_problem",
    "check_model",
    "eval_semantics",
    "prepare_problem",
    "private_copy",
    "select_parameters",
    "validate_inputs",
]

PROBE_EXAMPLES = 4
"""Examples used to probe the model: enough to see examples interact, few enough to cost nothing."""

_BATCHNORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


@dataclass
class NtkProblem:
    """A model prepared for kernel computation; all tensors are in the compute dtype.

    Attributes:
        module: a private structural copy of the user's module (NOTE [private module]), or the user's own under
            a lock when it cannot be copied; never mutated beyond ``functional_call``'s temporary swap.
        params: the selected parameters, detached, by name (tied weights appear once).
        frozen: every other parameter and buffer, detached, by name (constants of f).
        out_shape: per-example output shape; k = prod(out_shape).
        input_shape: per-example input shape; () for a tuple or mapping of inputs (``inputs.py``).
        dtype: the compute dtype (float32 or float64).
        forward_flops: FLOPs of one example's forward pass, counted by ``FlopCounterMode``.
        saved_bytes: bytes autograd saves for backward in one example's forward pass.
        owns_module: ``module`` is a private copy (``problem_pool``) whose own parameters and buffers hold the
            values of ``params`` and ``frozen`` (same storage and dtype), so ``f_own`` may call it directly.
        choices: the implementation and block plan chosen per call shape (``api._choose``), kept with the
            problem so a kept problem (``problem_pool``) plans once per shape.
        analyses: an implementation's one-off analysis of the model, kept with the problem by a key of its own
            (the structured engine's frozen plan per options: ``structured.Structured.terms``).
        output: which tensor of forward's return value is f (``outputs.py``); None: forward returns it.
        per_example_loop: ``vmap`` over examples is refused by the model (data-dependent control flow, e.g. a
            Hugging Face attention mask's ``padding_mask.all()``), so the Jacobians are built one example at a time
            (NOTE [per-example loop]).
        id_tables: integer leaf name -> the nn.Embedding it feeds and its size, seen by the probe: every
            example's ids are checked against it on every call (``inputs.check_ids``).
        template: for a tuple or mapping of inputs, one example of their shapes and dtypes, for analyses made
            before any data (``inputs.template``; the structured plan); None for a tensor (``input_shape``).
        calls_attention: the probe saw the model call ``F.scaled_dot_product_attention`` (or MultiheadAttention's
            functional form) itself, without an attention module (Hugging Face models): run it on the math path
            wherever examples are vmapped (``math_attention.attention_scope``).
    """

    module: nn.Module
    params: NamedTensors
    frozen: NamedTensors
    out_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    dtype: torch.dtype
    forward_flops: float
    saved_bytes: float
    owns_module: bool = False
    choices: dict[Hashable, Any] = field(default_factory=dict)
    analyses: dict[Hashable, Any] = field(default_factory=dict)
    output: OutputPath | None = None
    per_example_loop: bool = False
    id_tables: IdTables = field(default_factory=dict)
    template: Batch | None = None
    calls_attention: bool = False

    @property
    def k(self) -> int:
        return math.prod(self.out_shape)

    @property
    def num_params(self) -> int:
        """P: the number of selected scalar parameters."""
        return sum(p.numel() for p in self.params.values())

    @property
    def itemsize(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    def f_batch(self, params: NamedTensors, x: Batch) -> torch.Tensor:
        """The model on a batch: x (n, *input) (or a tuple/mapping of such leaves) -> (n, k)."""
        if isinstance(x, torch.Tensor) and self.output is None:
            out: torch.Tensor = functional_call(self.module, (params, self.frozen), (x,))
        else:
            out = select_output(call_module(self.module, (params, self.frozen), x), self.output)
        return _as_outputs(out, batch_size(x), self.k)

    def f_own(self, x: Batch) -> torch.Tensor:
        """``f_batch(self.params, x)`` without ``functional_call``'s swapping, when ``owns_module``.

        The module's own parameters take part (they require grad): fine for differentiating w.r.t. anything else
        (the structured capture's probes), wrong for telling parameter uses apart (``plan_structure`` tracks the
        tensors of ``params``, so it calls ``f_batch``).
        """
        if not self.owns_module:
            return self.f_batch(self.params, x)
        if isinstance(x, torch.Tensor):
            raw: object = self.module(x)
        else:
            raw = self.module(*x) if isinstance(x, tuple) else self.module(**x)
        return _as_outputs(select_output(raw, self.output), batch_size(x), self.k)

    def f_single(self, params: NamedTensors, x: Batch) -> torch.Tensor:
        """The model on one example: x (*input) -> (k,). Use under ``vmap`` for batches."""
        return self.f_batch(params, unsqueeze(x)).squeeze(0)


def _as_outputs(out: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The model's output as (n, k); the model's own tensor when it has that shape already (not a view of it), so
    the structured capture can tell which layer's output the model returned (``Recorder.output_use``)."""
    return out if out.shape == (n, k) else out.reshape(n, k)


_MODULE_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_MODULE_LOCKS_GUARD = threading.Lock()


def _module_lock(module: nn.Module) -> threading.Lock:
    with _MODULE_LOCKS_GUARD:
        return _MODULE_LOCKS.setdefault(module, threading.Lock())


def _structural_copy(module: nn.Module) -> nn.Module | None:
    """A copy of the module tree that shares every parameter and buffer tensor (no weights copied), or None."""
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    try:
        return copy.deepcopy(module, shared)
    except Exception:  # a module holding something uncopyable (a lock, a file): use the original, serialized
        return None


def check_model(module: object) -> None:
    """Refuse what has no per-example NTK before any work.

    Raises:
        UnsupportedModel: not an nn.Module, or a BatchNorm layer is in train mode (batch statistics couple the
        examples).
    """
    if not isinstance(module, nn.Module):
        raise UnsupportedModel(f"compute_ntk: model must be a torch.nn.Module, got {type(module).__name__}")
    if any(isinstance(m, _BATCHNORM_TYPES) and m.training for m in module.modules()):
        in_train = [name for name, m in module.named_modules() if isinstance(m, _BATCHNORM_TYPES) and m.training]
        raise UnsupportedModel(
            f"compute_ntk: BatchNorm layer(s) {in_train[:3]} are in train mode, where batch statistics couple the "
            "examples and the per-example kernel is undefined; call model.eval() first (running statistics are used)"
        )


def private_copy(module: nn.Module) -> nn.Module | None:
    """An eval-mode structural copy of ``module`` sharing every tensor (see NOTE [private module]), or None when
    the module cannot be copied."""
    private = _structural_copy(module)
    return None if private is None else private.eval()


@contextlib.contextmanager
def eval_semantics(module: nn.Module) -> Iterator[nn.Module]:
    """Yield a private eval-mode view of ``module`` (dropout off); the caller's module is never touched.

    NOTE [private module]: ``functional_call`` swaps a module's parameters in place for the duration of a call and
    the structured path reads ``module._parameters``, so two threads computing on one module object (the server's
    cached models) would see each other's tensors. Each call therefore works on a structural copy that shares the
    parameter and buffer tensors (cheap: module objects only; ``problem_pool`` keeps them across calls). A module
    that cannot be copied is used itself, under a per-module lock, flipped to eval and restored afterwards, and so
    are its plain tensor attributes: the old ``torch.nn.utils.weight_norm`` (the usual reason a module cannot be
    copied) sets ``weight`` in a forward pre-hook, which under ``vmap`` would leave a functorch wrapper behind.

    Raises:
        UnsupportedModel: see ``check_model``.
    """
    check_model(module)
    private = private_copy(module)
    if private is not None:
        yield private
        return
    with _module_lock(module):
        flags = [(m, m.training) for m in module.modules()]
        attributes = [(m, _tensor_attributes(m)) for m in module.modules()]
        module.eval()
        try:
            yield module
        finally:
            for m, was_training in flags:
                m.training = was_training
            for m, tensors in attributes:
                for name in _tensor_attributes(m).keys() - tensors.keys():
                    delattr(m, name)
                vars(m).update(tensors)


def _tensor_attributes(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's plain tensor attributes (not parameters or buffers, which live in their own dicts)."""
    return {name: value for name, value in vars(module).items() if isinstance(value, torch.Tensor)}


def select_parameters(module: nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """Names of the parameters matched by glob ``patterns`` (all when None), in ``named_parameters()`` order.

    Tied weights appear once, under their first name.

    Raises:
        NoMatchingParameters: a pattern matches nothing (the message lists the names), or the model has none.
    """
    names = [name for name, _ in module.named_parameters()]
    if not names:
        raise NoMatchingParameters("compute_ntk: the model has no parameters, so its NTK is zero-dimensional")
    if patterns is None:
        return names
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise NoMatchingParameters(f"compute_ntk: params must be a list of glob strings, got {patterns!r}")
    if len(patterns) == 0:
        raise NoMatchingParameters("compute_ntk: params=[] selects nothing; pass None for all parameters")
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise NoMatchingParameters(
                f"compute_ntk: parameter glob {pattern!r} matches no parameter; the model has: {shown}"
            )
    return [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def _as_input(x: object, name: str, dtype: torch.dtype) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.ndim == 0:
        raise ShapeMismatch(f"compute_ntk: {name} must have a batch dimension (N, *input), got a scalar")
    if t.shape[0] == 0:
        raise EmptyBatch(f"compute_ntk: {name} is an empty batch (shape {tuple(t.shape)}); pass at least one example")
    if t.is_floating_point():
        # one reduction in the input's own dtype instead of an elementwise test: a NaN or inf element always makes
        # the sum non-finite; a finite sum that overflows is a false alarm the exact test below clears
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0])
            raise NonFiniteInput(f"compute_ntk: {name} contains NaN or inf (first in example {bad}); clean the inputs")
        return t.to(dtype)
    if t.is_complex() or t.dtype == torch.bool:
        raise ShapeMismatch(f"compute_ntk: {name} has dtype {t.dtype}; expected a float or integer tensor")
    return t.to(torch.int64)


def _cast_named(tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> NamedTensors:
    return {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()) for name, t in tensors}


def _counted_forward(problem: NtkProblem, x: Batch) -> tuple[object, float, float]:
    """The model on the batch x, with its FLOPs and the bytes autograd saves for backward, per example.

    Returns:
        (output, FLOPs per example, saved bytes per example); the output is detached.
    """
    saved = 0
    # Weights autograd saves (e.g. for a matmul's input gradient) are shared by every example: not per-example bytes.
    shared = {t.untyped_storage().data_ptr() for t in (*problem.params.values(), *problem.frozen.values())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage().data_ptr() not in shared:
            saved += t.numel() * t.element_size()
        return t

    params = {name: p.detach().requires_grad_(True) for name, p in problem.params.items()}
    counter = FlopCounterMode(display=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        out = call_module(problem.module, (params, problem.frozen), x)
        if is_batch(x) or problem.output is not None:
            out = select_output(out, problem.output)
    n = batch_size(x)
    out = out.detach() if isinstance(out, torch.Tensor) else out
    return out, counter.get_total_flops() / n, saved / n


def _probe(problem: NtkProblem, x: Batch, sides: Sequence[tuple[str, Batch]] = ()) -> None:
    """Run the model on a few examples: output shape, examples independent, FLOPs and saved bytes counted.
    ``sides``: the whole batches (name, x) whose ids a failed probe checks, to name the leaf and example."""
    if is_batch(x):
        _probe_batch(problem, x, sides)
        return
    assert isinstance(x, torch.Tensor)
    n = x.shape[0]
    try:
        batched, problem.forward_flops, problem.saved_bytes = _counted_forward(problem, x)
    except InvalidInput:
        raise
    except Exception as exc:  # the model's own error, e.g. a shape mismatch inside a layer
        sizes = sorted({m.num_embeddings for m in problem.module.modules() if isinstance(m, nn.Embedding)})
        if isinstance(exc, IndexError) and sizes and not x.is_floating_point():  # ids outside an Embedding's table
            tables = (
                f"a vocabulary of {sizes[0]} (ids 0..{sizes[0] - 1})" if len(sizes) == 1 else f"vocabularies {sizes}"
            )
            raise InvalidInput(
                f"compute_ntk: the model failed on token ids in [{int(x.min())}, {int(x.max())}] ({exc}); its "
                f"nn.Embedding has {tables}: send ids inside the vocabulary"
            ) from exc
        raise ShapeMismatch(
            f"compute_ntk: the model failed on inputs of per-example shape {tuple(x.shape[1:])} and dtype "
            f"{x.dtype}: {type(exc).__name__}: {exc}. Check the input shape the model expects"
        ) from exc
    if not isinstance(batched, torch.Tensor) or batched.ndim < 1 or batched.shape[0] != n:
        got = tuple(batched.shape) if isinstance(batched, torch.Tensor) else type(batched).__name__
        raise UnsupportedModel(
            f"compute_ntk: for a batch of {n} examples the model returned {got}; expected a tensor (N, *out) "
            "with one output row per example"
        )
    problem.out_shape = tuple(batched.shape[1:])
    _check_independent(problem, x, batched, n)


def _probe_batch(problem: NtkProblem, x: Batch, sides: Sequence[tuple[str, Batch]]) -> None:
    """``_probe`` for a tuple or mapping of inputs: also learns which integer leaf feeds which nn.Embedding
    (``problem.id_tables``), refusing a float leaf that feeds one."""
    n = batch_size(x)
    with embedding_feeds(problem.module, x) as feeds:
        try:
            batched, problem.forward_flops, problem.saved_bytes = _counted_forward(problem, x)
        except InvalidInput:
            raise
        except Exception as exc:  # the model's own error, e.g. a missing argument or a shape mismatch in a layer
            feeds.check_floats()
            for side, whole in sides:
                check_ids(feeds.tables, whole, side)
            shown = ", ".join(f"{name or 'x'}: {tuple(t.shape[1:])} {t.dtype}" for name, t in leaves(x))
            if isinstance(exc, TypeError) and ("argument" in str(exc)):  # a missing or unexpected name
                raise InvalidInput(
                    f"compute_ntk: the model's forward does not take the inputs {shown} ({exc}); pass exactly the "
                    "arguments its forward takes, by position (a tuple) or by name (a mapping)"
                ) from exc
            raise ShapeMismatch(
                f"compute_ntk: the model failed on inputs {shown} (per-example shapes): {type(exc).__name__}: "
                f"{exc}. Check the input names, shapes and dtypes the model's forward expects"
            ) from exc
    feeds.check_floats()
    problem.id_tables = feeds.tables
    if not isinstance(batched, torch.Tensor) or batched.ndim < 1 or batched.shape[0] != n:
        got = tuple(batched.shape) if isinstance(batched, torch.Tensor) else type(batched).__name__
        raise UnsupportedModel(
            f"compute_ntk: for a batch of {n} examples the output {problem.output and problem.output.text!r} is "
            f"{got}; expected a tensor (N, *out) with one output row per example"
        )
    problem.out_shape = tuple(batched.shape[1:])
    _check_independent(problem, x, batched, n)


def _check_independent(problem: NtkProblem, x: Batch, batched: torch.Tensor, n: int) -> None:
    """The model one example at a time (``vmap``, or the per-example loop where vmap refuses the model's
    data-dependent control flow: NOTE [per-example loop]) agrees with the batch."""
    attention = math_attention()
    try:  # attention on its math path, as the implementations run it (the CPU flash kernel has no batching rule)
        with torch.no_grad(), attention:
            single = vmap(problem.f_single, (None, 0))(problem.params, x)
    except Exception as exc:
        if not is_data_dependent(exc):
            raise UnsupportedModel(
                f"compute_ntk: the model cannot be evaluated one example at a time under torch.func.vmap: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        with torch.no_grad():
            single = torch.stack([problem.f_single(problem.params, one_example(x, i)) for i in range(n)])
        problem.per_example_loop = True
    problem.calls_attention = attention.rerouted
    batched = batched.reshape(n, -1)
    scale = float(batched.abs().max()) + 1e-30
    tol = (1e-4 if problem.dtype == torch.float32 else 1e-9) * scale
    if n > 1 and float((batched - single).abs().max()) > tol:
        raise UnsupportedModel(
            "compute_ntk: the model's examples interact (its output for an example depends on the other examples "
            "in the batch, e.g. batch statistics or mixing across dim 0), so the per-example NTK is undefined"
        )


def prepare_problem(
    module: nn.Module,
    x1: object,
    x2: object | None,
    *,
    params: Sequence[str] | None,
    dtype: torch.dtype | str | None,
    output: OutputPath | None = None,
) -> tuple[NtkProblem, Batch, Batch | None]:
    """Validate inputs and build the NtkProblem, for the module yielded by ``eval_semantics``.

    Args:
        module: the model; a batch (N, *input) maps to (N, *out).
        x1: (N, *input) float or integer tensor (or anything ``torch.as_tensor`` takes).
        x2: (M, *input) or None.
        params: glob patterns over parameter names, or None for all.
        dtype: compute dtype (float32/float64, or their names); None = the model's floating dtype.
        output: which tensor of forward's return value is f (``outputs.parse_output``). Default: None.

    Returns:
        (problem, x1, x2): x1 (N, *input) and x2 (M, *input) or None, cast to the compute dtype when floating.

    Raises:
        ShapeMismatch, EmptyBatch, NonFiniteInput, NoMatchingParameters, UnsupportedModel.
    """
    compute_dtype, x1t, x2t = validate_inputs(module, x1, x2, dtype)
    return build_problem(module, x1t, x2t, params=params, dtype=compute_dtype, output=output), x1t, x2t


def validate_inputs(
    module: nn.Module, x1: object, x2: object | None, dtype: torch.dtype | str | None
) -> tuple[torch.dtype, Batch, Batch | None]:
    """The compute dtype and the inputs as tensors: x1 (N, *input), x2 (M, *input) or None (see
    ``prepare_problem``); a tuple or mapping of inputs as a ``Batch`` of such leaves (``inputs.as_batch``)."""
    compute_dtype = _resolve_dtype(module, dtype)
    if is_batch(x1) or is_batch(x2):
        b1 = as_batch(x1, "x1", compute_dtype) if is_batch(x1) else _as_input(x1, "x1", compute_dtype)
        if x2 is None:
            return compute_dtype, b1, None
        b2 = as_batch(x2, "x2", compute_dtype) if is_batch(x2) else _as_input(x2, "x2", compute_dtype)
        return compute_dtype, b1, check_sides(b1, b2)
    x1t = _as_input(x1, "x1", compute_dtype)
    x2t = None if x2 is None else _as_input(x2, "x2", compute_dtype)
    if x2t is not None:
        if x2t.shape[1:] != x1t.shape[1:]:
            raise ShapeMismatch(
                f"compute_ntk: x2 has per-example shape {tuple(x2t.shape[1:])}, x1 has {tuple(x1t.shape[1:])}; "
                "both sides must have the same per-example shape"
            )
        if x2t.is_floating_point() != x1t.is_floating_point():
            raise ShapeMismatch(
                f"compute_ntk: x1 is {x1t.dtype} but x2 is {x2t.dtype}; pass both as float or both as int"
            )
    return compute_dtype, x1t, x2t


def build_problem(
    module: nn.Module,
    x1: Batch,
    x2: Batch | None,
    *,
    params: Sequence[str] | None,
    dtype: torch.dtype,
    output: OutputPath | None = None,
) -> NtkProblem:
    """Select and cast the parameters and probe the model on the first examples of x1 (then x2).

    Args:
        module: the model (a private copy, see NOTE [private module]).
        x1, x2: validated inputs (``validate_inputs``).
        params: glob patterns over parameter names, or None for all.
        dtype: the compute dtype.
        output: which tensor of forward's return value is f (``outputs.parse_output``). Default: None.
    """
    selected = select_parameters(module, params)
    all_params = dict(module.named_parameters())
    problem = NtkProblem(
        module=module,
        params=_cast_named(((n, all_params[n]) for n in selected), dtype),
        frozen={
            **_cast_named(((n, p) for n, p in all_params.items() if n not in set(selected)), dtype),
            **_cast_named(module.named_buffers(), dtype),
        },
        out_shape=(),
        input_shape=tuple(x1.shape[1:]) if isinstance(x1, torch.Tensor) else (),
        dtype=dtype,
        forward_flops=0.0,
        saved_bytes=0.0,
        output=output,
        template=None if isinstance(x1, torch.Tensor) else template(x1),
    )
    probe = take(x1, 0, PROBE_EXAMPLES)
    if x2 is not None and batch_size(probe) < PROBE_EXAMPLES:
        probe = concat(probe, take(x2, 0, PROBE_EXAMPLES - batch_size(probe)))
    sides = [("x1", x1)] if x2 is None else [("x1", x1), ("x2", x2)]
    _probe(problem, probe, sides)
    for side, whole in sides:
        check_ids(problem.id_tables, whole, side)
    return problem


def _resolve_dtype(module: nn.Module, dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        resolved = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
    elif isinstance(dtype, str):
        resolved = {"float32": torch.float32, "float64": torch.float64}.get(dtype, None)  # type: ignore[assignment]
        if resolved is None:
            raise InvalidInput(f"compute_ntk: dtype {dtype!r} is not supported; expected 'float32' or 'float64'")
    else:
        resolved = dtype
    if resolved not in (torch.float32, torch.float64):
        raise InvalidInput(f"compute_ntk: dtype {resolved} is not supported; expected torch.float32 or torch.float64")
    return resolved
