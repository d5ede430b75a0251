"""Hook state during a structured capture: the forward hooks that collect every covered call's input and the
points the reverse pass differentiates at (``Recorder``), and the batch-safety check (``is_batch_safe``).

Per use i of the plan, a block of n examples gives the call's input a (n, *in_shape[1:]) in the batched forward
(the capture puts the per-example 1 back) or (*in_shape) per example under vmap, and its probe: a zero added to
the call's output, which the reverse pass differentiates at. Hooks act only for the recorder active in the current
context (``ACTIVE``): other threads using the same module see a no-op.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ntk_service.errors import UnsupportedModel
from ntk_service.kernels.problem.batch import Batch, batch_size, take
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured.plan import StructurePlan
from ntk_service.kernels.types import NamedTensors

__all__ = ["ACTIVE", "ChannelsLastGrad", "Recorder", "hooks", "is_batch_safe", "run_recorded"]

ACTIVE: contextvars.ContextVar[object | None] = contextvars.ContextVar("ntk_structured_capture", default=None)
"""The capture (or structure probe) the hooks of the current context act for; None: hooks do nothing."""


@contextmanager
def hooks(modules: tuple[nn.Module, ...] | list[nn.Module], pre: object | None, post: object) -> Iterator[None]:
    """Forward (pre-)hooks on ``modules`` while the block runs, removed in ``finally``."""
    handles = []
    try:
        for module in modules:
            if pre is not None:
                handles.append(module.register_forward_pre_hook(pre))  # type: ignore[arg-type]
            handles.append(module.register_forward_hook(post))  # type: ignore[arg-type]
        yield
    finally:
        for handle in handles:
            handle.remove()


class ChannelsLastGrad(torch.autograd.Function):
    """Identity whose backward hands on the cotangent in channels-last memory (NOTE [channels-last capture])."""

    @staticmethod
    def forward(ctx: object, y: torch.Tensor) -> torch.Tensor:
        return y

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous(memory_format=torch.channels_last)


class Recorder:
    """Hook state during a capture: collects the layers' inputs and the points to differentiate at.

    ``batch``: None when the forward runs per example under vmap (probes given and added); else the block size n
    of a batched forward, where each covered output gets an added zero probe requiring grad (one zero expanded to
    the output's shape: the cotangent at the expanded view is full-size, and no buffer of zeros is written).
    """

    def __init__(self, plan: StructurePlan, batch: int | None = None) -> None:
        self.plan, self.batch = plan, batch
        self.index = {id(m): i for i, m in enumerate(plan.layers)}
        self.probes: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []
        self.returned: list[tuple[weakref.ref[torch.Tensor], int]] = []  # batched: each use's output, its version
        self.record_only = False
        self.channels_last = False
        convs = [i for i, u in enumerate(plan.uses) if isinstance(plan.layers[u.layer], nn.Conv2d)]
        self.last_conv = convs[-1] if convs else -1

    def pre(self, module: nn.Module, args: tuple) -> tuple | None:  # type: ignore[type-arg]
        """Channels-last capture: a Conv2d's batch input in channels-last memory, so its output is too."""
        if ACTIVE.get() is not self or not isinstance(module, nn.Conv2d) or len(args) != 1:
            return None
        if not isinstance(args[0], torch.Tensor) or args[0].ndim != 4:
            return None
        return (args[0].contiguous(memory_format=torch.channels_last),)

    def post(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:  # type: ignore[type-arg]
        if ACTIVE.get() is not self:
            return None
        i = len(self.inputs)
        uses = self.plan.uses
        expected = None if i >= len(uses) else uses[i].out_shape
        if self.batch is not None and expected is not None:
            expected = (self.batch, *expected[1:])
        if expected is None or uses[i].layer != self.index[id(module)] or tuple(output.shape) != expected:
            raise UnsupportedModel(
                "compute_ntk (structured): the model's layer calls differ between examples (data-dependent control "
                f"flow: call {i} of the covered layers is {type(module).__name__} with output {tuple(output.shape)}, "
                "not what the structure probe saw); use implementation='jacobian_contraction'"
            )
        self.inputs.append(args[0])
        if self.record_only:
            return None
        if self.batch is not None:
            channels_last = self.channels_last and isinstance(module, nn.Conv2d) and output.ndim == 4
            if channels_last:  # NOTE [channels-last capture]
                last = i == self.last_conv
                output = output.contiguous(memory_format=torch.contiguous_format if last else torch.channels_last)
                output = ChannelsLastGrad.apply(output)  # type: ignore[no-untyped-call]
            zero = torch.zeros((1,) * output.ndim, dtype=output.dtype, requires_grad=True)
            self.probes.append(zero.expand(output.shape))
            probed = output + self.probes[i]
            self.returned.append((weakref.ref(probed), probed._version))
            return probed
        return output + self.probes[i]

    def output_use(self, out: torch.Tensor) -> int | None:
        """The use whose probed output the batched forward returned as ``out`` itself, unmodified (its version
        unchanged: an in-place ``out *= 2`` after the layer is not the identity), or None. Its δ for output c is
        e_c for every example, known without a reverse pass (NOTE [example-independent δ] in contraction.py)."""
        for i, (ref, version) in enumerate(self.returned):
            if ref() is out and out._version == version:
                return i
        return None

    def check_count(self) -> None:
        if len(self.inputs) != len(self.plan.uses):
            raise UnsupportedModel(
                f"compute_ntk (structured): the covered layers were called {len(self.inputs)} times, the "
                f"structure probe saw {len(self.plan.uses)}; use implementation='jacobian_contraction'"
            )


def run_recorded(problem: NtkProblem, recorder: Recorder, params: NamedTensors, x: Batch) -> torch.Tensor:
    """The model's output (n, k) on x (n, *input) (or (k,) on one example under vmap), ``recorder`` active."""
    token = ACTIVE.set(recorder)
    try:
        if recorder.batch is None:
            out = problem.f_single(params, x)
        else:  # the batched forward of the problem's own parameters may skip functional_call's swapping
            out = problem.f_own(x) if params is problem.params else problem.f_batch(params, x)
    finally:
        ACTIVE.reset(token)
    recorder.check_count()
    return out


def is_batch_safe(problem: NtkProblem, plan: StructurePlan, x: Batch) -> bool:
    """Whether every covered call sees the examples along dim 0, in order, so a batched forward can replace the
    per-example one (NOTE [probes]): the inputs of a 2-example run have dim 0 of size 2 where one example gives
    1, and their first row equals the 1-example run's.

    Args:
        x: (2, *input), two different examples.
    """
    if plan.fallback or batch_size(x) < 2:
        return False
    runs = []
    for batch in (take(x, 0, 1), take(x, 0, 2)):
        recorder = Recorder(plan, batch_size(batch))
        recorder.record_only = True
        with hooks(plan.layers, None, recorder.post), torch.no_grad():
            try:
                run_recorded(problem, recorder, problem.params, batch)
            except UnsupportedModel:
                return False
        runs.append(recorder.inputs)
    for use, one, two in zip(plan.uses, *runs, strict=True):
        if tuple(one.shape) != use.in_shape or tuple(two.shape) != (2, *use.in_shape[1:]):
            return False
        if one.is_floating_point():
            scale = float(one.abs().max()) + 1e-30
            if float((two[:1] - one).abs().max()) > 1e-4 * scale:
                return False
        elif not torch.equal(two[:1], one):
            return False
    return True
