"""The structured capture of a pipeline of Linear layers and pointwise activations, without autograd.

NOTE [sequential chains]: for a chain h_{j+1} = σ_j(h_j W_jᵀ + b_j) the cotangents the capture needs follow in
closed form: δ at the head's output is e_c, at its input W[c]; an activation maps a cotangent g to σ'(z) ⊙ g (ReLU
by the kernel autograd calls, threshold_backward; the others by their aten backward on ones, σ'(z) once for the
block (n, d) rather than once per output), and a Linear maps δ to δ W. δ comes out example-major, rows (i, c),
which spares the contraction the costly transposition of an output-major one (NOTE [accumulator memory] in
``contraction.py``).

``run_chain`` does exactly that for all k outputs at once, as (n, k, ·) matrices: one forward under
``no_grad`` and one matmul per hidden layer, no hooks, no graph, no vmapped engine run (what that buys:
``StructuredOptions.chain`` in docs/engine.md, measured with ``benchmarks/bench_fast_paths.py``).

The chain is taken only where it is exactly the model (``sequential_chain`` lists the conditions): one traced
forward on the plan's example (``_PipelineTrace``, a ``TorchFunctionMode``) must be a pure pipeline of operators —
``linear`` of the previous value with a parameter (or a parameter times a number: NTK parameterization) as its
weight and bias, and the pointwise activations ``_POINTWISE`` knows — inside a forward that is the same on every
call: an exported program's graph (no control flow), or modules that are all fixed (an ``nn.Sequential``, nested or
not, of ``nn.Linear`` and activation modules of exactly the known types, or modules whose class declares a fixed
forward, ``FIXED_PIPELINE_ATTRIBUTE``: the registry's MLP family, ``layers.NtkLinear``). Any other tensor operation
of an ``nn.Module`` forward, even reading ``x.shape``, refuses it, so the forward cannot depend on values or on the
batch size — with vectors per example, no parameter on the Jacobian path, and no hooks when the capture runs.
Anything else takes the autograd capture in ``capture.py``, which handles every model the rules cover.
A chain's forward is not called again after that trace, which is why an arbitrary forward does not qualify: one
reading a global flag or the grad mode could take another path on a later call.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.modules import module as torch_module
from torch.overrides import TorchFunctionMode

from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured.descriptors import Delta, Layout
from ntk_service.kernels.structured.ops import METADATA, OPS, Op

__all__ = ["FIXED_PIPELINE_ATTRIBUTE", "Chain", "run_chain", "sequential_chain"]

aten = torch.ops.aten
_T = torch.Tensor

Backward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(cotangent at the output (n, k, d), input z (n, 1, d), output y (n, 1, d)) -> cotangent at the input (n, k, d)."""


@dataclass(frozen=True)
class _Linear:
    weight: torch.Tensor  # (out, in), compute dtype, as the op took it (a parameter times a number, or itself)
    bias: torch.Tensor | None
    use: int | None  # the structure plan's site this call is (None: no selected parameter, not captured)


@dataclass(frozen=True)
class _Pointwise:
    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Backward | None  # None: the identity (dropout in eval mode, flatten of vectors)


@dataclass(frozen=True)
class Chain:
    """The steps of a sequential model and the modules whose hooks would change it."""

    steps: tuple[_Linear | _Pointwise, ...]
    modules: tuple[nn.Module, ...]

    def is_runnable(self) -> bool:
        """No forward or backward hook on the chain's modules, and none global (checked per capture: hooks come
        and go; a hook could change what a layer returns)."""
        if (
            torch_module._global_forward_hooks
            or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks
            or torch_module._global_backward_pre_hooks
        ):
            return False
        return not any(
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in self.modules
        )


_POINTWISE_TYPES = frozenset(
    {nn.ReLU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.GELU, nn.LeakyReLU, nn.ELU, nn.Softplus}
    | {nn.Identity, nn.Dropout, nn.Flatten}
)
"""The activation modules of ``torch.nn`` whose stock forward is one ``_POINTWISE`` op, by exact type."""


def _scaled(derivative: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Backward:
    """g ⊙ σ'(z), σ'(z) (n, 1, d) from the aten backward kernel on ones, once for the block rather than per output
    (those kernels do not all take a cotangent broadcast over k: oneDNN's GELU for one)."""
    return lambda g, z, y: g * derivative(z, y)


def _relu(b: Mapping[str, Any]) -> _Pointwise:
    return _Pointwise(F.relu, lambda g, z, y: aten.threshold_backward(g, y, 0))  # as autograd does


def _tanh(b: Mapping[str, Any]) -> _Pointwise:
    return _Pointwise(torch.tanh, _scaled(lambda z, y: aten.tanh_backward(torch.ones_like(y), y)))


def _sigmoid(b: Mapping[str, Any]) -> _Pointwise:
    return _Pointwise(torch.sigmoid, _scaled(lambda z, y: aten.sigmoid_backward(torch.ones_like(y), y)))


def _silu(b: Mapping[str, Any]) -> _Pointwise:
    return _Pointwise(F.silu, _scaled(lambda z, y: aten.silu_backward(torch.ones_like(z), z)))


def _gelu(b: Mapping[str, Any]) -> _Pointwise | None:
    approximate = b.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        return None
    return _Pointwise(
        lambda z: F.gelu(z, approximate=approximate),
        _scaled(lambda z, y: aten.gelu_backward(torch.ones_like(z), z, approximate=approximate)),
    )


def _leaky_relu(b: Mapping[str, Any]) -> _Pointwise:
    slope = float(b.get("negative_slope", 0.01))
    return _Pointwise(
        lambda z: F.leaky_relu(z, slope),
        _scaled(lambda z, y: aten.leaky_relu_backward(torch.ones_like(z), z, slope, False)),
    )


def _elu(b: Mapping[str, Any]) -> _Pointwise | None:
    alpha = float(b.get("alpha", 1.0))
    if b.get("scale", 1) != 1 or b.get("input_scale", 1) != 1:
        return None
    return _Pointwise(
        lambda z: F.elu(z, alpha),
        _scaled(lambda z, y: aten.elu_backward(torch.ones_like(z), alpha, 1, 1, False, z)),
    )


def _softplus(b: Mapping[str, Any]) -> _Pointwise:
    beta, threshold = float(b.get("beta", 1.0)), float(b.get("threshold", 20.0))
    return _Pointwise(
        lambda z: F.softplus(z, beta, threshold),
        _scaled(lambda z, y: aten.softplus_backward(torch.ones_like(z), z, beta, threshold)),
    )


def _dropout(b: Mapping[str, Any]) -> _Pointwise | None:
    training = b.get("training", b.get("train", True))
    return _Pointwise(lambda z: z, None) if training is False else None  # eval mode: the identity


def _flatten(b: Mapping[str, Any]) -> _Pointwise | None:
    if (b.get("start_dim", 0), b.get("end_dim", -1)) != (1, -1):
        return None
    return _Pointwise(lambda z: z.flatten(1), None)  # backpropagated through only on (n, d): the identity


def _identity(b: Mapping[str, Any]) -> _Pointwise:
    return _Pointwise(lambda z: z, None)


def _forms(
    build: Callable[[Mapping[str, Any]], _Pointwise | None], names: tuple[str, ...], *funcs: object
) -> dict[object, tuple[Op, Callable[[Mapping[str, Any]], _Pointwise | None]]]:
    return {func: (Op("pointwise", names), build) for func in funcs}


_POINTWISE: dict[object, tuple[Op, Callable[[Mapping[str, Any]], _Pointwise | None]]] = {
    **_forms(_relu, ("input", "inplace"), F.relu, torch.relu, _T.relu, aten.relu.default),
    **_forms(_tanh, ("input",), torch.tanh, _T.tanh, F.tanh, aten.tanh.default),
    **_forms(_sigmoid, ("input",), torch.sigmoid, _T.sigmoid, F.sigmoid, aten.sigmoid.default),
    **_forms(_silu, ("input", "inplace"), F.silu, aten.silu.default),
    **_forms(_gelu, ("input", "approximate"), F.gelu, aten.gelu.default),
    **_forms(_leaky_relu, ("input", "negative_slope", "inplace"), F.leaky_relu, aten.leaky_relu.default),
    **_forms(_elu, ("input", "alpha", "inplace"), F.elu),
    **_forms(_elu, ("input", "alpha", "scale", "input_scale"), aten.elu.default),
    **_forms(_softplus, ("input", "beta", "threshold"), F.softplus, aten.softplus.default),
    **_forms(_dropout, ("input", "p", "training", "inplace"), F.dropout),
    **_forms(_dropout, ("input", "p", "train"), aten.dropout.default),
    **_forms(_flatten, ("input", "start_dim", "end_dim"), torch.flatten, _T.flatten, aten.flatten.using_ints),
    **_forms(_identity, ("input",), _T.contiguous, aten.contiguous.default, aten.alias.default, aten.clone.default),
}
"""The pointwise ops a chain steps through, eager and ATen, with their forward and backward built from the call's
arguments (None: that configuration is not known, e.g. dropout in training mode)."""

_WEIGHT_DERIVATIONS = frozenset({"mul", "div", "neg", "identity"})
"""How a chain's Linear may take its parameters: themselves, or times a number (NTK parameterization)."""


FIXED_PIPELINE_ATTRIBUTE = "ntk_fixed_pipeline"
"""A class attribute (``ntk_fixed_pipeline = True``) by which a module says its forward calls the same modules and
operators in the same order on every call, whatever the inputs and any state outside the module (a flag, the grad
mode): the chain traces such a forward once and never calls it again (NOTE [sequential chains]).
``nn.Sequential``'s forward is such a forward; the registry's MLP family and ``layers.NtkLinear`` declare it."""


def _has_fixed_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward that is the same on every call: ``nn.Sequential``'s, a stock
    ``nn.Linear`` or activation module of exactly a known type, or a class declaring ``FIXED_PIPELINE_ATTRIBUTE``,
    called through ``nn.Module.__call__``."""
    kind = type(module)
    if kind.__call__ is not nn.Module.__call__ or "forward" in vars(module):
        return False
    if kind is nn.Linear or kind in _POINTWISE_TYPES or kind.forward is nn.Sequential.forward:
        return True
    return getattr(kind, FIXED_PIPELINE_ATTRIBUTE, False) is True


class _PipelineTrace(TorchFunctionMode):
    """One forward of the model, recording its steps and whether it is a pure pipeline of them.

    Pure: every tensor operation is either a *weight derivation* (a parameter, or a parameter times a number) or a
    step on the pipeline's current value — ``linear`` with derived weight and bias, or a ``_POINTWISE`` op — and
    the model returns the last step's output. Any other operation is refused; an ``nn.Module`` forward may not even
    read a tensor's metadata (it could make the forward depend on the batch size), a graph module's may (its
    graph is fixed). Every module called must have a fixed forward (``_has_fixed_forward``).
    """

    def __init__(self, params: Mapping[int, torch.Tensor], selected: set[int], graph: bool) -> None:
        super().__init__()
        self.values = dict(params)  # id -> tensor: the parameters and what derives from them
        self.selected = set(selected)  # ids of the selected parameters and their derivations
        self.graph = graph
        self.value: object = None  # the pipeline's current tensor
        self.steps: list[_Linear | _Pointwise] = []
        self.sites: list[bool] = []  # per Linear step: whether it takes a selected parameter
        self.pure = True

    def start(self, x: torch.Tensor) -> None:
        self.value = x

    def module_pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if _TRACING.get() is self and self.pure and not _has_fixed_forward(module):
            self.pure = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.pure:
            self.pure = self._step(func, args, kwargs, out)
        return out

    def _step(self, func: object, args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> bool:
        if METADATA(func):
            return self.graph
        op = OPS.get(func)
        if op is not None and op.family in _WEIGHT_DERIVATIONS:
            bound = op.bind(args, kwargs)
            operands = [v for k, v in bound.items() if k in ("input", "other")]
            tensors = [t for t in operands if isinstance(t, torch.Tensor)]
            if len(tensors) == 1 and id(tensors[0]) in self.values:
                numbers = all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in operands if v is not tensors[0]
                )
                if not numbers or bound.get("rounding_mode") is not None or not isinstance(out, torch.Tensor):
                    return False
                self.values[id(out)] = out
                if id(tensors[0]) in self.selected:
                    self.selected.add(id(out))
                return True
        if op is not None and op.family == "linear":
            bound = op.bind(args, kwargs)
            weight, bias = bound.get("weight"), bound.get("bias")
            if bound.get("input") is not self.value or id(weight) not in self.values:
                return False
            if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
                return False
            if bias is not None and id(bias) not in self.values:
                return False
            if not isinstance(self.value, torch.Tensor) or self.value.ndim != 2:
                return False  # leading dimensions per example (positions): the autograd capture's case
            self.sites.append(id(weight) in self.selected or id(bias) in self.selected)
            self.steps.append(_Linear(weight, bias, None))
            self.value = out
            return True
        form = _POINTWISE.get(func)
        if form is None:
            return False
        bound = form[0].bind(args, kwargs)
        step = form[1](bound)
        if step is None or bound.get("input") is not self.value:
            return False
        self.steps.append(step)
        self.value = out
        return True


_TRACING: contextvars.ContextVar[_PipelineTrace | None] = contextvars.ContextVar("ntk_chain_trace", default=None)
"""The trace the module hooks of the current context record for; None: they do nothing (another thread's forward of
a module that cannot be copied, traced under its lock by this one)."""


def _trace_pipeline(problem: NtkProblem, example: torch.Tensor) -> _PipelineTrace | None:
    """The trace of the model's forward on ``example`` if it is a pure pipeline (see ``_PipelineTrace``)."""
    root = problem.module
    graph = isinstance(root, torch.fx.GraphModule) and "forward" not in vars(root)
    if not graph and not _has_fixed_forward(root):
        return None
    names = {n for n, _ in root.named_parameters()}
    tensors = {n: t for n, t in {**problem.frozen, **problem.params}.items() if n in names}
    trace = _PipelineTrace({id(t): t for t in tensors.values()}, {id(t) for t in problem.params.values()}, graph)
    handles = [m.register_forward_pre_hook(trace.module_pre) for m in root.modules() if m is not root]
    trace.start(example)
    token = _TRACING.set(trace)
    try:
        with torch.no_grad(), trace:
            out = functional_call(root, (problem.params, problem.frozen), (example,))
    except Exception:  # the structure probe ran this forward already: whatever fails here, refuse, do not fail
        return None
    finally:
        _TRACING.reset(token)
        for handle in handles:
            handle.remove()
    pure = trace.pure and out is trace.value and any(isinstance(s, _Linear) for s in trace.steps)
    return trace if pure else None


def sequential_chain(problem: NtkProblem, example: torch.Tensor, sites: tuple[Any, ...]) -> Chain | None:
    """The chain of the problem's model if it is one (see NOTE [sequential chains]), else None.

    A chain is a model whose forward on ``example`` is a pure pipeline (``_PipelineTrace``) whose Linear steps
    taking selected parameters are exactly the plan's sites, in order, and whose output is one vector per example.

    Args:
        problem: the prepared model.
        example: (1, *input), compute dtype.
        sites: the structure plan's sites (``plan.Site``), in call order.
    """
    trace = _trace_pipeline(problem, example)
    if trace is None or len(problem.out_shape) != 1:
        return None
    if sum(trace.sites) != len(sites) or any(site.family != "linear" for site in sites):
        return None  # a site the chain does not make (the plan saw other calls)
    steps: list[_Linear | _Pointwise] = []
    use = 0
    linear = iter(trace.sites)
    for step in trace.steps:
        if isinstance(step, _Linear) and next(linear):
            step, use = _Linear(step.weight, step.bias, use), use + 1
        steps.append(step)
    return Chain(tuple(steps), tuple(problem.module.modules()))


@torch.no_grad()
def run_chain(chain: Chain, x: torch.Tensor, uses: int) -> tuple[list[torch.Tensor], list[Delta]]:
    """Every captured Linear call's input a and output cotangents δ (NOTE [sequential chains]).

    Args:
        chain: from ``sequential_chain``.
        x: (n, *input), compute dtype.
        uses: the number of the plan's uses.

    Returns:
        inputs[u] (n, 1, in_u) and deltas[u] (n, k, 1, out_u) as the autograd capture gives them, but δ lies
        example-major, in (n, k, out_u) memory (NOTE [accumulator memory] in contraction.py); δ's that are the same
        for every example (the head's identity, the rows of W right below it) are declared shared (stride 0).
    """
    n = x.shape[0]
    inputs: list[torch.Tensor | None] = [None] * uses
    deltas: list[Delta | None] = [None] * uses
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # each step's (input, output)
    h = x
    for step in chain.steps:
        z = h
        if isinstance(step, _Linear):
            if step.use is not None:
                inputs[step.use] = h
            h = F.linear(h, step.weight, step.bias)
        else:
            h = step.forward(h)
        saved.append((z, h))
    k = h.shape[1]
    eye = torch.eye(k, dtype=h.dtype)
    g = eye.unsqueeze(0).expand(n, k, k)  # the cotangent at the output, (n, k, k): the basis
    is_basis, is_shared = True, True
    first = min((s.use for s in chain.steps if isinstance(s, _Linear) and s.use is not None), default=None)
    for step, (z, y) in zip(reversed(chain.steps), reversed(saved), strict=True):
        if first is None:
            break
        if isinstance(step, _Pointwise):
            if step.backward is not None:
                g, is_basis, is_shared = step.backward(g, z.unsqueeze(1), y.unsqueeze(1)), False, False
            continue
        if step.use is not None:
            delta = eye.expand(n, k, k) if is_basis else g
            deltas[step.use] = Delta(delta.unsqueeze(2), Layout.EXAMPLE_MAJOR, shared=is_shared)
            if step.use == first:
                break
        # δ W, for all k outputs at once; from the basis, W[c] for every example (stride 0 over n)
        weight = step.weight
        if is_basis:
            g = weight.unsqueeze(0).expand(n, k, weight.shape[1])
        else:
            g, is_shared = torch.mm(g.reshape(n * k, -1), weight).view(n, k, -1), False
        is_basis = False
    assert all(a is not None for a in inputs) and all(d is not None for d in deltas)
    return [a.unsqueeze(1) for a in inputs if a is not None], [d for d in deltas if d is not None]
