"""The capture's view of a forward: ``Recorder``, a ``TorchFunctionMode`` that collects every site's input and adds
the points the reverse pass differentiates at, and ``batch_axes``, which finds where a batched forward keeps the
examples in each site's tensors.

Per site i of the plan, a block of n examples gives the op's input a in the batched forward (its example axis,
``descriptors.Axis``, turns it into (n, *in_shape)) or (*in_shape) per example under vmap, and its probe: a zero
added to the op's output, which the reverse pass differentiates at. A site is recognised as the plan's next one by
its op and a selected parameter among its arguments (directly or through a derivation, ``tracking.py``), in call
order. The mode is thread-local (torch's mode stack): another thread using the same module sees nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ntk_service.errors import UnsupportedModel
from ntk_service.kernels.problem.batch import Batch, batch_size, leaves, take
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured.attention import DECOMPOSED, decomposition
from ntk_service.kernels.structured.descriptors import Axis, SiteAxes
from ntk_service.kernels.structured.ops import OPS
from ntk_service.kernels.structured.plan import StructurePlan
from ntk_service.kernels.structured.tracking import DERIVATIONS, ParameterTracker
from ntk_service.kernels.types import NamedTensors

__all__ = ["ChannelsLastGrad", "Recorder", "batch_axes", "distinct_pair", "run_recorded", "saved_activation_bytes"]


class ChannelsLastGrad(torch.autograd.Function):
    """Identity whose backward hands on the cotangent in channels-last memory (NOTE [channels-last capture])."""

    @staticmethod
    def forward(ctx: object, y: torch.Tensor) -> torch.Tensor:
        return y

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous(memory_format=torch.channels_last)


def _tracked_params(problem: NtkProblem, plan: StructurePlan) -> dict[str, list[torch.Tensor]]:
    """The covered parameters under every object the forward may read them as: the problem's tensors
    (``functional_call``) and, for ``f_own``, the module's own parameters."""
    fallback = set(plan.fallback)
    own = dict(problem.module.named_parameters()) if problem.owns_module else {}
    tracked: dict[str, list[torch.Tensor]] = {}
    for name, t in problem.params.items():
        if name in fallback:
            continue
        tracked[name] = [t] + ([own[name]] if name in own and own[name] is not t else [])
    return tracked


class Recorder(TorchFunctionMode):
    """The capture's mode: collects the sites' inputs and the points to differentiate at.

    Args:
        problem: the prepared model; plan: its structure.
        batch: None when the forward runs per example under vmap (``probes`` given and added); else the block
            size n of a batched forward, where each site's output gets an added zero probe requiring grad (one zero
            expanded to the output's shape: the cotangent at the expanded view is full-size, and no buffer of zeros
            is written).
        axes: per site, where the batched forward keeps the examples (checks each output's shape); None: not
            checked (the runs of ``batch_axes`` that find them).
        record_only: collect inputs and outputs, add no probes.
        channels_last: 2-D convolutions take and give channels-last memory (NOTE [channels-last capture]).
    """

    def __init__(
        self,
        problem: NtkProblem,
        plan: StructurePlan,
        batch: int | None = None,
        *,
        axes: tuple[SiteAxes, ...] | None = None,
        record_only: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.plan, self.batch, self.axes = plan, batch, axes
        self.record_only, self.channels_last = record_only, channels_last
        self.tracker = ParameterTracker(_tracked_params(problem, plan), exact=False)
        self.probes: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor | None] = []
        self.outputs: list[torch.Tensor] = []
        self.returned: list[tuple[weakref.ref[torch.Tensor], int]] = []  # batched: each site's output, its version
        convs = [i for i, s in enumerate(plan.sites) if s.family in ("conv", "convolution") and len(s.out_shape) == 4]
        self.last_conv = convs[-1] if convs else -1

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        op = OPS.get(func)
        if op is None:
            body = decomposition(func, args, kwargs) if func is DECOMPOSED else None
            if body is None:
                return func(*args, **kwargs)
            with self:
                return body()
        if not self.tracker.tracked_leaves(args, kwargs):
            return func(*args, **kwargs)
        bound = op.bind(args, kwargs)
        out = None
        if op.family in DERIVATIONS:
            out = func(*args, **kwargs)
            if self.tracker.derive(op, bound, func, args, kwargs, out):
                return out
        return self._site(op.family, bound, func, args, kwargs, out)

    def _site(
        self, family: str, bound: dict[str, Any], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> Any:
        i = len(self.inputs)
        sites = self.plan.sites
        site = sites[i] if i < len(sites) else None
        if site is None or site.family != family:
            raise UnsupportedModel(
                "compute_ntk (structured): the model's op calls differ between examples (data-dependent control "
                f"flow: call {i} taking a selected parameter is {family}, not what the structure probe saw); use "
                "implementation='jacobian_contraction'"
            )
        a = bound.get(site.input_arg) if site.input_arg is not None else None
        conv2d = self.channels_last and self.batch is not None and i <= self.last_conv
        conv2d = conv2d and site.family in ("conv", "convolution") and len(site.out_shape) == 4
        if conv2d and isinstance(a, torch.Tensor):  # NOTE [channels-last capture]
            a = a.contiguous(memory_format=torch.channels_last)
            args, kwargs = _replaced(args, kwargs, site.input_arg, bound, a, func)
            out = None
        if out is None:
            out = func(*args, **kwargs)
        self._check(i, out)
        self.inputs.append(a)
        if self.record_only:
            self.outputs.append(out)
            return out
        if self.batch is None:
            return out + self.probes[i]
        if conv2d:
            out = out.contiguous(memory_format=torch.contiguous_format if i == self.last_conv else torch.channels_last)
            out = ChannelsLastGrad.apply(out)  # type: ignore[no-untyped-call]
        zero = torch.zeros((1,) * out.ndim, dtype=out.dtype, requires_grad=True)
        self.probes.append(zero.expand(out.shape))
        probed = out + self.probes[i]
        self.returned.append((weakref.ref(probed), probed._version))
        return probed

    def _check(self, i: int, out: object) -> None:
        site = self.plan.sites[i]
        expected: tuple[int, ...] | None = site.out_shape
        if self.batch is not None:
            if self.axes is None:
                expected = None
            else:
                d = self.axes[i].output.dim
                expected = (*site.out_shape[:d], site.out_shape[d] * self.batch, *site.out_shape[d + 1 :])
        if not isinstance(out, torch.Tensor) or (expected is not None and tuple(out.shape) != expected):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise UnsupportedModel(
                "compute_ntk (structured): the model's op calls differ between examples (data-dependent control "
                f"flow: call {i} taking a selected parameter ({site.op}) gave {got}, not what the structure probe "
                "saw); use implementation='jacobian_contraction'"
            )

    def output_use(self, out: torch.Tensor) -> int | None:
        """The site whose probed output the batched forward returned as ``out`` itself, unmodified (its version
        unchanged: an in-place ``out *= 2`` after the op is not the identity), or None. Its δ for output c is
        e_c for every example, known without a reverse pass (NOTE [example-independent δ] in contraction.py)."""
        for i, (ref, version) in enumerate(self.returned):
            if ref() is out and out._version == version:
                return i
        return None

    def check_count(self) -> None:
        if len(self.inputs) != len(self.plan.sites):
            raise UnsupportedModel(
                f"compute_ntk (structured): the covered ops were called {len(self.inputs)} times, the structure "
                f"probe saw {len(self.plan.sites)}; use implementation='jacobian_contraction'"
            )


def _replaced(
    args: tuple[Any, ...], kwargs: dict[str, Any], name: str | None, bound: dict[str, Any], value: Any, func: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with the bound argument ``name`` replaced by ``value``."""
    if name in kwargs:
        return args, {**kwargs, name: value}
    position = OPS[func].names.index(str(name))
    return (*args[:position], value, *args[position + 1 :]), kwargs


def run_recorded(problem: NtkProblem, recorder: Recorder, params: NamedTensors, x: Batch) -> torch.Tensor:
    """The model's output (n, k) on x (n, *input) (or (k,) on one example under vmap), ``recorder`` active."""
    with recorder:
        if recorder.batch is None:
            out = problem.f_single(params, x)
        else:  # the batched forward of the problem's own parameters may skip functional_call's swapping
            out = problem.f_own(x) if params is problem.params else problem.f_batch(params, x)
    recorder.check_count()
    return out


def distinct_pair(x: Batch) -> Batch | None:
    """Two different examples of x (the first and the first that differs from it), or None when all are equal:
    where a batched forward keeps the examples can only be told apart on different ones."""
    first = take(x, 0, 1)
    for j in range(1, batch_size(x)):
        other = take(x, j, j + 1)
        if any(not torch.equal(a, b) for (_, a), (_, b) in zip(leaves(first), leaves(other), strict=True)):
            return _pair(first, other)
    return None


def _pair(a: Batch, b: Batch) -> Batch:
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b])  # type: ignore[list-item]
    joined = [torch.cat([s, t]) for (_, s), (_, t) in zip(leaves(a), leaves(b), strict=True)]
    return tuple(joined) if isinstance(a, tuple) else dict(zip(a.keys(), joined, strict=True))


def _axis(one: torch.Tensor, two: torch.Tensor, shape: tuple[int, ...]) -> Axis | None:
    """Where ``two`` (a 2-example run) keeps the examples of which ``one`` (the first alone) is the first."""
    if tuple(one.shape) != shape:
        return None
    for d, r in enumerate(shape):
        if tuple(two.shape) != (*shape[:d], 2 * r, *shape[d + 1 :]):
            continue
        candidates = [(True, two.narrow(d, 0, r))]
        if r > 1:
            candidates.append((False, torch.unflatten(two, d, (r, 2)).select(d + 1, 0)))
        for major, first in candidates:
            if one.numel() == 0 or torch.equal(first, one):
                return Axis(d, major)
            if one.is_floating_point():  # rounding may differ between batch sizes
                scale = float(one.abs().max()) + 1e-30
                if float((first - one).abs().max()) <= 1e-4 * scale:
                    return Axis(d, major)
    return None


def batch_axes(problem: NtkProblem, plan: StructurePlan, x: Batch) -> tuple[SiteAxes, ...] | None:
    """Where a batched forward keeps the examples in every site's input and output, if it keeps them apart, so
    a batched forward can replace the per-example one (NOTE [probes]); else None.

    A 2-example run and a run of its first example alone must agree: each site's tensors of the pair hold those of
    the first example at a place ``Axis`` names (a dimension twice as large, the first example's part first or
    interleaved). Models that mix examples (a reversed batch) or move them between calls fail this.

    Args:
        x: (2, *input), two different examples (``distinct_pair``).
    """
    if plan.fallback or batch_size(x) < 2:
        return None
    runs = []
    for batch in (take(x, 0, 1), take(x, 0, 2)):
        recorder = Recorder(problem, plan, batch_size(batch), record_only=True)
        with torch.no_grad():
            try:
                run_recorded(problem, recorder, problem.params, batch)
            except UnsupportedModel:
                return None
        runs.append((recorder.inputs, recorder.outputs))
    axes = []
    for i, site in enumerate(plan.sites):
        (a1, o1), (a2, o2) = (runs[0][0][i], runs[0][1][i]), (runs[1][0][i], runs[1][1][i])
        output = _axis(o1, o2, site.out_shape)
        into = _axis(a1, a2, site.in_shape) if a1 is not None and a2 is not None else None
        if output is None or (site.input_arg is not None and into is None):
            return None
        axes.append(SiteAxes(into, output))
    return tuple(axes)


def saved_activation_bytes(problem: NtkProblem, plan: StructurePlan, example: Batch) -> float:
    """Bytes autograd saves for the probes' backward on one example, parameters and buffers excluded."""
    shared = {t.untyped_storage().data_ptr() for t in (*problem.params.values(), *problem.frozen.values())}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage().data_ptr() not in shared:
            saved += t.numel() * t.element_size()
        return t

    recorder = Recorder(problem, plan)  # per-example shapes: the 1-example batch is what the structure probe saw
    recorder.probes = [torch.zeros(s.out_shape, dtype=problem.dtype, requires_grad=True) for s in plan.sites]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        problem.f_batch(problem.params, take(example, 0, 1))
    recorder.check_count()
    return float(saved)
