"""The structured capture of a plain ``nn.Sequential`` of Linear layers and pointwise activations, without autograd.

NOTE [sequential chains]: for a chain h_{j+1} = σ_j(h_j W_jᵀ + b_j) the cotangents the capture needs follow in
closed form: δ at the head's output is e_c, at its input W[c]; an activation maps a cotangent g to σ'(z) ⊙ g (ReLU
by the kernel autograd calls, threshold_backward; the others by their aten backward on ones, σ'(z) once for the
block (n, d) rather than once per output), and a Linear maps δ to δ W. δ comes out example-major, rows (i, c),
which spares the contraction the costly transposition of an output-major one (NOTE [accumulator memory] in
``structured_contract.py``).
``run_chain`` does exactly that for all k outputs at once, as (n, k, ·) matrices: one forward under
``no_grad`` and one matmul per hidden layer, no hooks, no graph, no vmapped engine run. On the benchmark MLP
(784-512-512-10, N = M = 64) the kernel took 14.2 instead of 15.4 ms in an in-process alternation with the
autograd capture, 14.0 instead of 14.6 ms alternating with neural-tangents (``benchmarks/bench_trees_ab.py``);
the example-major layout then took N = M = 256 from 103 to 97 ms and left N = 64 as it was.

The chain is taken only where it is exactly the model (``sequential_chain`` lists the conditions): plain
Sequentials of modules of exactly the known types with their stock forward, vectors per example, no parameter on
the Jacobian path, and no hooks when the capture runs. Anything else takes the autograd capture in
``structured_capture.py``, which handles every model the rules cover. (While another thread prepares a problem,
``FlopCounterMode`` holds global module hooks: a capture then also takes the autograd way, exact but slower.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

__all__ = ["Chain", "run_chain", "sequential_chain"]

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


def _children(module: nn.Module) -> Iterator[nn.Module]:
    """The modules a plain ``nn.Sequential`` calls, in its forward's order (a module held twice is called twice;
    ``children()`` would list it once), nested plain Sequentials unrolled."""
    for child in module._modules.values():
        if child is None:
            continue
        yield child
        if type(child) is nn.Sequential:
            yield from _children(child)


def sequential_chain(
    module: nn.Module,
    input_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    tensors: dict[str, torch.Tensor],
    use_layers: list[nn.Module],
) -> Chain | None:
    """The chain of ``module`` if it is one (see NOTE [sequential chains]), else None.

    A chain is: ``module`` of exactly type ``nn.Sequential``, its children (nested plain Sequentials unrolled) each
    of exactly ``nn.Linear`` or a type ``_pointwise`` knows, none with a ``forward`` set on the instance; every
    Linear's weight and bias parameters of the problem, its input one vector per example; the calls of the
    plan's uses exactly the chain's calls of those layers, in order; the output the model's per-example shape.

    Args:
        module: the problem's model.
        input_shape: its per-example input shape.
        out_shape: its per-example output shape.
        tensors: every parameter and buffer by its canonical name (``named_parameters()``), compute dtype.
        use_layers: the module called by each use of the structure plan, in call order.
    """
    if type(module) is not nn.Sequential or "forward" in vars(module):
        return None
    canonical = {id(p): name for name, p in module.named_parameters()}
    steps: list[_Linear | _Pointwise] = []
    modules: list[nn.Module] = [module]
    shape = input_shape
    uses = iter(enumerate(use_layers))
    pending = next(uses, None)
    for child in _children(module):
        modules.append(child)
        if "forward" in vars(child):
            return None  # a forward set on the instance (accelerate's hooks do that): other math
        if type(child) is nn.Sequential:
            continue
        if type(child) is nn.Linear:
            if shape != (child.in_features,):
                return None  # leading dimensions per example (positions): the autograd capture's case
            weight, bias = _parameter(child.weight, canonical, tensors), _parameter(child.bias, canonical, tensors)
            if weight is None or (bias is None) != (child.bias is None):
                return None  # a weight that is not a parameter (a buffer, a plain tensor)
            use = None
            if pending is not None and pending[1] is child:
                use, pending = pending[0], next(uses, None)
            steps.append(_Linear(weight, bias, use))
            shape = (child.out_features,)
            continue
        step = _pointwise(child)
        if step is None:
            return None
        if type(child) is nn.Flatten:
            shape = (math.prod(shape),)
        steps.append(step)
    if pending is not None or shape != out_shape or not any(isinstance(s, _Linear) for s in steps):
        return None  # a use the chain does not make (the plan saw other calls), or another output
    return Chain(tuple(steps), tuple(modules))


def _parameter(
    tensor: torch.Tensor | None, canonical: dict[int, str], tensors: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    """The problem's (compute dtype) tensor of a module parameter, or None if it is not a parameter."""
    name = None if tensor is None else canonical.get(id(tensor))
    return None if name is None else tensors.get(name)


@torch.no_grad()
def run_chain(chain: Chain, x: torch.Tensor, uses: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every captured Linear call's input a and output cotangents δ (NOTE [sequential chains]).

    Args:
        chain: from ``sequential_chain``.
        x: (n, *input), compute dtype.
        uses: the number of the plan's uses.

    Returns:
        inputs[u] (n, 1, in_u) and deltas[u] (n, k, 1, out_u) as the autograd capture gives them, but δ lies
        example-major, in (n, k, out_u) memory (NOTE [accumulator memory] in structured_contract.py); for the head,
        the identity expanded over the examples.
    """
    n = x.shape[0]
    inputs: list[torch.Tensor | None] = [None] * uses
    deltas: list[torch.Tensor | None] = [None] * uses
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
    is_basis = True
    first = min((s.use for s in chain.steps if isinstance(s, _Linear) and s.use is not None), default=None)
    for step, (z, y) in zip(reversed(chain.steps), reversed(saved), strict=True):
        if first is None:
            break
        if isinstance(step, _Pointwise):
            if step.backward is not None:
                g, is_basis = step.backward(g, z.unsqueeze(1), y.unsqueeze(1)), False
            continue
        if step.use is not None:
            deltas[step.use] = eye.expand(n, k, k) if is_basis else g
            if step.use == first:
                break
        # δ W, for all k outputs at once; from the basis, W[c] for every example (stride 0 over n)
        weight = step.weight
        if is_basis:
            g = weight.unsqueeze(0).expand(n, k, weight.shape[1])
        else:
            g = torch.mm(g.reshape(n * k, -1), weight).view(n, k, -1)
        is_basis = False
    assert all(a is not None for a in inputs) and all(d is not None for d in deltas)
    return (
        [a.unsqueeze(1) for a in inputs if a is not None],
        [d.unsqueeze(2) for d in deltas if d is not None],
    )
