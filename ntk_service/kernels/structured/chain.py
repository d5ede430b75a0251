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
forward on the plan's example (``_PipelineTrace``) must be a pure pipeline of modules of exactly the known types
with their stock forward — an ``nn.Sequential`` of them, nested or not, or a module whose class declares a fixed
forward (``FIXED_PIPELINE_ATTRIBUTE``: the registry's MLP family, which loops over an ``nn.ModuleList``); any
tensor operation of its own, even reading ``x.shape``, refuses it, so the forward cannot depend on values or on
the batch size — with vectors per example, no parameter on the Jacobian path, and no hooks when the capture runs.
Anything else takes the autograd capture in ``capture.py``, which handles every model the rules cover.
A chain's forward is not called again after that trace, which is why an arbitrary forward does not qualify: one
reading a global flag or the grad mode could take another path on a later call.
(While another thread prepares a problem, ``FlopCounterMode`` holds global module hooks: a capture then also
takes the autograd way, exact but slower.)
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.modules import module as torch_module
from torch.overrides import TorchFunctionMode

from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured.descriptors import Delta, Layout

__all__ = ["FIXED_PIPELINE_ATTRIBUTE", "Chain", "run_chain", "sequential_chain"]

aten = torch.ops.aten

Backward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(cotangent at the output (n, k, d), input z (n, 1, d), output y (n, 1, d)) -> cotangent at the input (n, k, d)."""


@dataclass(frozen=True)
class _Linear:
    weight: torch.Tensor  # (out, in), compute dtype
    bias: torch.Tensor | None
    use: int | None  # the structure plan's use this call is (None: no selected parameter, not captured)


@dataclass(frozen=True)
class _Pointwise:
    forward: Callable[[torch.Tensor], torch.Tensor]
    backward: Backward | None  # None: the identity (Dropout in eval mode, Identity, Flatten on vectors)


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
"""The pointwise modules ``_pointwise`` knows, by exact type."""


def _scaled(derivative: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Backward:
    """g ⊙ σ'(z), σ'(z) (n, 1, d) from the aten backward kernel on ones, once for the block rather than per output
    (those kernels do not all take a cotangent broadcast over k: oneDNN's GELU for one)."""
    return lambda g, z, y: g * derivative(z, y)


def _pointwise(module: nn.Module) -> _Pointwise | None:
    """Forward and backward of a pointwise module of exactly a known type (the aten kernels autograd uses)."""
    kind = type(module)
    if kind not in _POINTWISE_TYPES:
        return None  # a subclass could compute anything
    if kind is nn.ReLU:  # threshold_backward on the cotangent itself, as autograd does
        return _Pointwise(F.relu, lambda g, z, y: aten.threshold_backward(g, y, 0))
    if kind is nn.Tanh:
        return _Pointwise(torch.tanh, _scaled(lambda z, y: aten.tanh_backward(torch.ones_like(y), y)))
    if kind is nn.Sigmoid:
        return _Pointwise(torch.sigmoid, _scaled(lambda z, y: aten.sigmoid_backward(torch.ones_like(y), y)))
    if kind is nn.SiLU:
        return _Pointwise(F.silu, _scaled(lambda z, y: aten.silu_backward(torch.ones_like(z), z)))
    if isinstance(module, nn.GELU):
        approximate = module.approximate
        return _Pointwise(
            lambda z: F.gelu(z, approximate=approximate),
            _scaled(lambda z, y: aten.gelu_backward(torch.ones_like(z), z, approximate=approximate)),
        )
    if isinstance(module, nn.LeakyReLU):
        slope = module.negative_slope
        return _Pointwise(
            lambda z: F.leaky_relu(z, slope),
            _scaled(lambda z, y: aten.leaky_relu_backward(torch.ones_like(z), z, slope, False)),
        )
    if isinstance(module, nn.ELU):
        alpha = module.alpha
        return _Pointwise(
            lambda z: F.elu(z, alpha),
            _scaled(lambda z, y: aten.elu_backward(torch.ones_like(z), alpha, 1, 1, False, z)),
        )
    if isinstance(module, nn.Softplus):
        beta, threshold = module.beta, module.threshold
        return _Pointwise(
            lambda z: F.softplus(z, beta, threshold),
            _scaled(lambda z, y: aten.softplus_backward(torch.ones_like(z), z, beta, threshold)),
        )
    if kind is nn.Identity or kind is nn.Dropout:  # the capture runs the model in eval mode: dropout is off
        return _Pointwise(lambda z: z, None)
    if isinstance(module, nn.Flatten) and (module.start_dim, module.end_dim) == (1, -1):
        return _Pointwise(lambda z: z.flatten(1), None)  # backpropagated through only on (n, d): the identity
    return None


FIXED_PIPELINE_ATTRIBUTE = "ntk_fixed_pipeline"
"""A class attribute (``ntk_fixed_pipeline = True``) by which a module says its forward calls the same modules in
the same order on every call, whatever the inputs and any state outside the module (a flag, the grad mode): the
chain traces such a forward once and never calls it again (NOTE [sequential chains]). ``nn.Sequential``'s forward
is such a forward; the registry's MLP family declares it."""


def _has_fixed_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a forward that is the same pipeline on every call (torch's
    ``nn.Sequential.forward`` or a class declaring ``FIXED_PIPELINE_ATTRIBUTE``), with ``nn.Module.__call__``."""
    kind = type(module)
    if kind.__call__ is not nn.Module.__call__ or "forward" in vars(module):
        return False
    return kind.forward is nn.Sequential.forward or getattr(kind, FIXED_PIPELINE_ATTRIBUTE, False) is True


_TRACING: contextvars.ContextVar[_PipelineTrace | None] = contextvars.ContextVar("ntk_chain_trace", default=None)
"""The trace the hooks of the current context record for; None: they do nothing (another thread's forward)."""


class _PipelineTrace(TorchFunctionMode):
    """One forward of the model, recording its leaf calls and whether it is a pure pipeline of them.

    Pure: inside the root module's forward, every tensor operation happens inside a call of a known leaf (a Linear
    or a ``_POINTWISE_TYPES`` module), each leaf call takes exactly the previous call's output (the first, the
    model's input) and the model returns the last call's output. Any other operation, even reading ``x.shape``, is
    refused: it could make the forward depend on the values or on the batch size. The root and every other module
    called between the leaves must have a fixed forward (``_has_fixed_forward``): a forward reading a flag or the
    grad mode would take another path later, and the chain is traced once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.armed = False  # inside the root's forward
        self.depth = 0  # inside a leaf call
        self.calls: list[tuple[nn.Module, torch.Tensor]] = []  # each leaf call at depth 0 and its input
        self.value: object = None  # the pipeline's current tensor
        self.pure = True

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.armed and self.depth == 0:
            self.pure = False
        return func(*args, **(kwargs or {}))

    def root_pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if _TRACING.get() is self:
            self.armed, self.value = True, args[0] if len(args) == 1 else None

    def container_pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if _TRACING.get() is self and self.armed and self.depth == 0 and not _has_fixed_forward(module):
            self.pure = False

    def root_post(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if _TRACING.get() is self:
            self.armed = False
            self.pure = self.pure and output is self.value

    def leaf_pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if _TRACING.get() is not self or not self.armed:
            return
        if self.depth == 0:
            if len(args) != 1 or args[0] is not self.value or not isinstance(args[0], torch.Tensor):
                self.pure = False
            else:
                self.calls.append((module, args[0]))
        self.depth += 1

    def leaf_post(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if _TRACING.get() is not self or not self.armed:
            return
        self.depth -= 1
        if self.depth == 0:
            self.value = output


def _is_leaf(module: nn.Module) -> bool:
    return type(module) is nn.Linear or type(module) in _POINTWISE_TYPES


def _trace_pipeline(problem: NtkProblem, example: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor]] | None:
    """The leaf calls (module, input) of the model's forward on ``example`` if it is a pure pipeline of them (see
    ``_PipelineTrace``), else None."""
    root = problem.module
    if _is_leaf(root):  # the model is one leaf
        return [(root, example)] if type(root).__call__ is nn.Module.__call__ else None
    if not _has_fixed_forward(root):
        return None
    trace = _PipelineTrace()
    handles = []
    token = _TRACING.set(trace)
    try:
        handles += [root.register_forward_pre_hook(trace.root_pre), root.register_forward_hook(trace.root_post)]
        for module in root.modules():
            if _is_leaf(module):
                handles.append(module.register_forward_pre_hook(trace.leaf_pre))
                handles.append(module.register_forward_hook(trace.leaf_post))
            elif module is not root:
                handles.append(module.register_forward_pre_hook(trace.container_pre))
        with torch.no_grad(), trace:
            functional_call(root, (problem.params, problem.frozen), (example,))
    except Exception:  # the structure probe ran this forward already: whatever fails here, refuse, do not fail
        return None
    finally:
        _TRACING.reset(token)
        for handle in handles:
            handle.remove()
    return trace.calls if trace.pure and trace.calls else None


def sequential_chain(problem: NtkProblem, example: torch.Tensor, use_layers: list[nn.Module]) -> Chain | None:
    """The chain of the problem's model if it is one (see NOTE [sequential chains]), else None.

    A chain is a model whose forward on ``example`` is a pure pipeline of Linear layers and the pointwise modules
    ``_pointwise`` knows (``_PipelineTrace``: an ``nn.Sequential`` of them, nested or not, or a module with a
    fixed forward, ``FIXED_PIPELINE_ATTRIBUTE``, looping over an ``nn.ModuleList``), each of exactly its type and
    without a ``forward`` set on the instance; every Linear's weight and bias parameters of the problem, its
    input one vector per example; the plan's uses exactly the chain's calls of those layers, in order.

    Args:
        problem: the prepared model.
        example: (1, *input), compute dtype.
        use_layers: the module called by each use of the structure plan, in call order.
    """
    calls = _trace_pipeline(problem, example)
    if calls is None:
        return None
    tensors = {**problem.frozen, **problem.params}
    canonical = {id(p): name for name, p in problem.module.named_parameters()}
    steps: list[_Linear | _Pointwise] = []
    uses = iter(enumerate(use_layers))
    pending = next(uses, None)
    for module, a in calls:
        if "forward" in vars(module):
            return None  # a forward set on the instance (accelerate's hooks do that): other math
        if type(module) is nn.Linear:
            if a.ndim != 2:
                return None  # leading dimensions per example (positions): the autograd capture's case
            weight, bias = _parameter(module.weight, canonical, tensors), _parameter(module.bias, canonical, tensors)
            if weight is None or (bias is None) != (module.bias is None):
                return None  # a weight that is not a parameter (a buffer, a plain tensor)
            use = None
            if pending is not None and pending[1] is module:
                use, pending = pending[0], next(uses, None)
            steps.append(_Linear(weight, bias, use))
            continue
        step = _pointwise(module)
        if step is None:
            return None
        steps.append(step)
    if pending is not None or not any(isinstance(s, _Linear) for s in steps) or len(problem.out_shape) != 1:
        return None  # a use the chain does not make (the plan saw other calls), or an output of other shape
    return Chain(tuple(steps), tuple(problem.module.modules()))


def _parameter(
    tensor: torch.Tensor | None, canonical: dict[int, str], tensors: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    """The problem's (compute dtype) tensor of a module parameter, or None if it is not a parameter."""
    name = None if tensor is None else canonical.get(id(tensor))
    return None if name is None else tensors.get(name)


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
