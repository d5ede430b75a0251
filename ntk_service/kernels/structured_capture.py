"""Where the structured NTK gets its inputs: which parameters each rule covers (``plan_structure``) and, per block
of examples, every covered layer's inputs a and output cotangents δ of all k outputs (``capture``).

NOTE [covered parameters]: a parameter is covered by a rule only if *every* use of it is a call of a layer that
the rule understands. ``plan_structure`` runs the model once on one example under a ``TorchFunctionMode`` that
sees every torch operation and its tensor arguments, while forward hooks track which rule layer is executing.
An operation taking a selected parameter outside the forward of a rule layer that owns it (a bare
``nn.Parameter`` in custom math, ``F.linear(h, embedding.weight)`` for a tied head, the packed projections that
``nn.MultiheadAttention`` passes to ``F.multi_head_attention_forward``) sends that parameter to the Jacobian
path; nothing is skipped silently. A layer called several times (weight sharing) has one use per call, and
tied weights (one tensor in several layers) collect the uses of all those layers.

NOTE [probes]: δ comes from one reverse pass per example, vmapped over the output basis: each covered call's
output gets a zero "probe" added by a forward hook, and ``jacrev`` w.r.t. the probes gives ∂f_c/∂(layer
output) for all c at once; the layers' inputs come back as auxiliary outputs. Running per example under
``vmap`` (rather than on the batch) keeps the example axis out of the layers' view, so a model that reshapes
or transposes its batch internally still gets per-example a and δ. Parameters on the Jacobian path are
differentiated in the same pass. When ``is_batch_safe`` shows (on two real examples) that every covered call
sees the examples along dim 0 in order, and no parameter is on the Jacobian path, the same probes run on the
batched forward with plain autograd instead (``autograd.grad(..., is_grads_batched=True)``): the same numbers
with about half the overhead. Hooks are registered per call, removed in ``finally``, and act only for the
capture active in the current context (other threads using the same module see a no-op).

NOTE [outputs as probes]: in the batched forward the layer outputs themselves are the points the reverse pass
differentiates at (``autograd.grad`` w.r.t. a non-leaf tensor gives the cotangent flowing into it): no zero is
added to each output (that elementwise pass over every layer output was ~0.4 ms of a ~15 ms MLP kernel). That
is exact while nothing modifies an output in place afterwards (``nn.ReLU(inplace=True)``, ``out[:, 0] += ...``):
then the tensor's history is rebased and its gradient would be taken after the modification. Every output's
version counter (shared with its views) is checked after the forward; if one moved, the plan switches to added
probes (``StructurePlan.probe_outputs``) and the capture reruns once.

NOTE [channels-last capture]: a convolutional model's batched capture runs k plain reverse passes, and each pass
is mostly the input gradients of its convolutions (transposed convolutions over n images). oneDNN computes
those on NCHW tensors through internal reorders to and from its blocked layout, and on channels-last (NHWC)
tensors directly: on the benchmark CNN (conv 3x3/2 32->32, 64 examples) ~6.6 ms vs ~2.4-2.8 ms per pass. So
a pre-hook gives every Conv2d its input in channels-last memory (so oneDNN's output is channels-last too) and
the post hook hands on every Conv2d output but the last in that layout (same values: the model sees the same
tensors, and the elementwise ops after it keep the layout), and ``_ChannelsLastGrad`` hands the cotangent
back to every convolution in that layout, so its backward, and the elementwise backward before it, see one
layout. The last convolution's output stays NCHW: what follows it is usually a flatten or a pooling head,
whose backward gives NCHW cotangents. A δ that comes back channels-last goes into memory (n, H, W, k, C)
(``_delta_buffer``), which ``ConvRule`` reads in place. A model that ``.view``s an inner convolution's output
cannot take channels-last strides: the first such failure turns the layout off for the plan and the capture
reruns in NCHW.

The δ of an early convolution is the largest buffer of a side (benchmark CNN, 64 examples: n·k·C·H·W = 74 MB),
fresh memory on every call: ``_delta_buffer`` asks for huge pages for it (NOTE [huge pages] in allocator.py).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import jacrev, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ntk_service.errors import UnsupportedModel
from ntk_service.kernels.allocator import prefer_huge_pages
from ntk_service.kernels.functional import NtkProblem
from ntk_service.kernels.structured_chain import Chain, run_chain, sequential_chain
from ntk_service.kernels.structured_rules import Rule, rule_for
from ntk_service.kernels.types import NamedTensors

__all__ = ["Capture", "StructurePlan", "Use", "capture", "is_batch_safe", "plan_structure"]


@dataclass(frozen=True)
class Use:
    """One call of a covered layer, with its per-example (logical) input and output shapes."""

    layer: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


@dataclass
class StructurePlan:
    """The rule layers of a problem and who covers each selected parameter.

    Attributes:
        layers: covered layers (modules with at least one covered parameter), in first-call order.
        rules: the rule of each layer.
        states: each layer's parameters and buffers (compute dtype) by attribute name.
        uses: every call of a covered layer, in call order.
        param_uses: selected parameter name -> [(use index, role attribute)] for rule-covered parameters.
        fallback: selected parameters on the Jacobian path, in ``problem.params`` order.
        saved_bytes: bytes autograd saves per example in the probed forward (activations only: tensors sharing
            storage with parameters or buffers are not per example and not counted).
        channels_last: the batched capture of a convolutional model runs its Conv2d outputs in channels-last
            memory (NOTE [channels-last capture]); cleared when that forward fails (a model viewing them).
        probe_outputs: the batched capture adds a zero probe to every covered output instead of differentiating
            at the output itself; set when the model modifies a layer output in place (NOTE [outputs as probes]).
        chain: the model as a sequential chain, captured without autograd (NOTE [sequential chains] in
            ``structured_chain.py``); None for every other model.
    """

    layers: list[nn.Module]
    rules: list[Rule]
    states: list[dict[str, torch.Tensor]]
    uses: list[Use] = field(default_factory=list)
    param_uses: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    fallback: list[str] = field(default_factory=list)
    saved_bytes: float = 0.0
    channels_last: bool = True
    probe_outputs: bool = False
    chain: Chain | None = None


_ACTIVE: contextvars.ContextVar[object | None] = contextvars.ContextVar("ntk_structured_capture", default=None)
"""The capture (or structure probe) the hooks of the current context act for; None: hooks do nothing."""

_METADATA_METHODS = frozenset(
    {"size", "dim", "numel", "__len__", "stride", "element_size", "is_floating_point", "is_complex", "is_contiguous"}
)
_METADATA_PROPERTIES = frozenset({"shape", "ndim", "dtype", "device", "layout", "requires_grad", "is_leaf"})
"""Tensor queries that read metadata only (``w.shape[0]`` to size something): not uses of a parameter's values."""


def _reads_metadata_only(func: object) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property getter: its descriptor is func.__self__
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_PROPERTIES
    return name in _METADATA_METHODS


@contextmanager
def _hooks(modules: list[nn.Module], pre: object | None, post: object) -> Iterator[None]:
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


class _UseTracker(TorchFunctionMode):
    """Records which selected parameters an operation takes outside a rule layer that owns them."""

    def __init__(self, selected: dict[int, str], probe: _StructureProbe) -> None:
        super().__init__()
        self.selected, self.probe = selected, probe

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not _reads_metadata_only(func):
            for leaf in tree_flatten((args, kwargs))[0]:
                if isinstance(leaf, torch.Tensor) and id(leaf) in self.selected:
                    self.probe.note_op(leaf, self.selected[id(leaf)])
        return func(*args, **kwargs)


class _StructureProbe:
    """State of the one-example structure run of ``plan_structure``."""

    def __init__(self, layers: list[nn.Module], roles: list[tuple[str, ...]]) -> None:
        self.index = {id(m): i for i, m in enumerate(layers)}
        self.layers, self.roles = layers, roles
        self.stack: list[int] = []
        self.uses: list[Use] = []
        self.outside: set[str] = set()
        self.odd_layers: set[int] = set()

    def note_op(self, tensor: torch.Tensor, name: str) -> None:
        if self.stack:
            top = self.layers[self.stack[-1]]
            if any(getattr(top, role) is tensor for role in self.roles[self.stack[-1]]):
                return
        self.outside.add(name)

    def pre(self, module: nn.Module, args: tuple) -> None:  # type: ignore[type-arg]
        if _ACTIVE.get() is self:
            self.stack.append(self.index[id(module)])

    def post(self, module: nn.Module, args: tuple, output: object) -> None:  # type: ignore[type-arg]
        if _ACTIVE.get() is not self:
            return
        layer = self.stack.pop()
        if len(args) != 1 or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
            self.odd_layers.add(layer)  # called with extra arguments or returning a non-tensor: no rule
            return
        self.uses.append(Use(layer, tuple(args[0].shape), tuple(output.shape)))


def _module_state(problem: NtkProblem, module: nn.Module, prefixes: dict[int, str]) -> dict[str, torch.Tensor]:
    prefix = prefixes[id(module)]
    prefix = prefix + "." if prefix else ""
    tensors = {**problem.frozen, **problem.params}
    names = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    return {n: tensors[prefix + n] for n in names if prefix + n in tensors}


def plan_structure(problem: NtkProblem, example: torch.Tensor) -> StructurePlan:
    """Find the rule layers, run one example to record their uses, and assign every selected parameter.

    Args:
        problem: the prepared model.
        example: (1, *input), one example (values only steer data-dependent control flow).

    Returns:
        The plan; every selected parameter is in ``param_uses`` or ``fallback`` (see NOTE [covered parameters]).
    """
    canonical = {id(p): name for name, p in problem.module.named_parameters()}
    layers: list[nn.Module] = []
    rules: list[Rule] = []
    roles: list[tuple[str, ...]] = []
    for module in problem.module.modules():
        rule = rule_for(module)
        if rule is None:
            continue
        covered = tuple(r for r in rule.roles(module) if canonical.get(id(module._parameters[r])) in problem.params)
        if covered:
            layers.append(module)
            rules.append(rule)
            roles.append(covered)
    probe = _StructureProbe(layers, roles)
    selected = {id(t): name for name, t in problem.params.items()}
    token = _ACTIVE.set(probe)
    try:
        with _hooks(layers, probe.pre, probe.post), torch.no_grad(), _UseTracker(selected, probe):
            problem.f_batch(problem.params, example)
    finally:
        _ACTIVE.reset(token)

    first_call: dict[int, int] = {}
    for use in probe.uses:
        first_call.setdefault(use.layer, len(first_call))
    keep = sorted((i for i in first_call if i not in probe.odd_layers), key=first_call.__getitem__)
    prefixes: dict[int, str] = {}
    for name, m in problem.module.named_modules():
        prefixes.setdefault(id(m), name)
    renumber = {old: new for new, old in enumerate(keep)}
    plan = StructurePlan(
        layers=[layers[i] for i in keep],
        rules=[rules[i] for i in keep],
        states=[_module_state(problem, layers[i], prefixes) for i in keep],
    )
    owner: dict[str, list[tuple[int, str]]] = {}
    for i in range(len(layers)):  # never-called layers still own their parameters (their J is zero)
        for role in roles[i]:
            owner.setdefault(canonical[id(layers[i]._parameters[role])], [])
    plan.uses = [Use(renumber[u.layer], u.in_shape, u.out_shape) for u in probe.uses if u.layer in renumber]
    for index, use in enumerate(plan.uses):
        layer = plan.layers[use.layer]
        for role in roles[keep[use.layer]]:
            owner[canonical[id(layer._parameters[role])]].append((index, role))
    odd_params = {canonical[id(layers[i]._parameters[r])] for i in probe.odd_layers for r in roles[i]}
    for name in problem.params:
        if name in owner and name not in probe.outside and name not in odd_params:
            plan.param_uses[name] = owner[name]
        else:
            plan.fallback.append(name)
    plan.saved_bytes = _saved_activation_bytes(problem, plan, example)
    if not plan.fallback:
        plan.chain = sequential_chain(problem, example[:1], [plan.layers[u.layer] for u in plan.uses])
    return plan


def _saved_activation_bytes(problem: NtkProblem, plan: StructurePlan, example: torch.Tensor) -> float:
    """Bytes autograd saves for the probes' backward on one example, parameters and buffers excluded."""
    shared = {t.untyped_storage().data_ptr() for t in (*problem.params.values(), *problem.frozen.values())}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage().data_ptr() not in shared:
            saved += t.numel() * t.element_size()
        return t

    recorder = _Recorder(plan)  # per-example shapes: the 1-example batch is what the structure probe saw
    recorder.probes = [torch.zeros(u.out_shape, dtype=problem.dtype, requires_grad=True) for u in plan.uses]
    token = _ACTIVE.set(recorder)
    try:
        with _hooks(plan.layers, None, recorder.post), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                problem.f_batch(problem.params, example[:1])
    finally:
        _ACTIVE.reset(token)
    return float(saved)


@dataclass
class Capture:
    """What one block of n examples gives: per use a (n, *in_shape) and δ (n, k, *out_shape); fallback J."""

    inputs: list[torch.Tensor]
    deltas: list[torch.Tensor]
    fallback_jacobians: NamedTensors


class _ChannelsLastGrad(torch.autograd.Function):
    """Identity whose backward hands on the cotangent in channels-last memory (NOTE [channels-last capture])."""

    @staticmethod
    def forward(ctx: object, y: torch.Tensor) -> torch.Tensor:
        return y

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous(memory_format=torch.channels_last)


class _Recorder:
    """Hook state during a capture: collects the layers' inputs and the points to differentiate at.

    ``batch``: None when the forward runs per example under vmap (probes given and added); else the block size n
    of a batched forward, where each covered output is its own probe (NOTE [outputs as probes]) or, with
    ``plan.probe_outputs``, gets an added zero probe (n, *out_shape[1:]) requiring grad.
    """

    def __init__(self, plan: StructurePlan, batch: int | None = None) -> None:
        self.plan, self.batch = plan, batch
        self.index = {id(m): i for i, m in enumerate(plan.layers)}
        self.probes: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[tuple[torch.Tensor, int]] = []  # batched: each call's (probed) output and its version
        self.record_only = False
        self.channels_last = False
        convs = [i for i, u in enumerate(plan.uses) if isinstance(plan.layers[u.layer], nn.Conv2d)]
        self.last_conv = convs[-1] if convs else -1

    def pre(self, module: nn.Module, args: tuple) -> tuple | None:  # type: ignore[type-arg]
        """Channels-last capture: a Conv2d's batch input in channels-last memory, so its output is too."""
        if _ACTIVE.get() is not self or not isinstance(module, nn.Conv2d) or len(args) != 1:
            return None
        if not isinstance(args[0], torch.Tensor) or args[0].ndim != 4:
            return None
        return (args[0].contiguous(memory_format=torch.channels_last),)

    def post(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:  # type: ignore[type-arg]
        if _ACTIVE.get() is not self:
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
                output = _ChannelsLastGrad.apply(output)  # type: ignore[no-untyped-call]
            if self.plan.probe_outputs or not output.requires_grad:
                # one zero expanded to the output's shape: the cotangent at the expanded view is full-size, and no
                # buffer of zeros is written. (An output not requiring grad, e.g. the first layer's when no
                # parameter requires grad, is not made a leaf: hooks others put on it, such as a FlopCounterMode
                # running in another thread, cannot handle leaves inside autograd.grad.)
                zero = torch.zeros((1,) * output.ndim, dtype=output.dtype, requires_grad=True)
                self.probes.append(zero.expand(output.shape))
                output = output + self.probes[i]
            else:  # NOTE [outputs as probes]
                self.probes.append(output)
            self.outputs.append((output, output._version))
            return output
        return output + self.probes[i]

    def outputs_modified(self) -> bool:
        """Whether some covered output was modified in place after its call (NOTE [outputs as probes])."""
        return any(t._version != version for t, version in self.outputs)

    def check_count(self) -> None:
        if len(self.inputs) != len(self.plan.uses):
            raise UnsupportedModel(
                f"compute_ntk (structured): the covered layers were called {len(self.inputs)} times, the "
                f"structure probe saw {len(self.plan.uses)}; use implementation='jacobian_contraction'"
            )


class _OutputModified(Exception):
    """A covered output was modified in place after its call: differentiate at added probes instead."""


def _run_recorded(problem: NtkProblem, recorder: _Recorder, params: NamedTensors, x: torch.Tensor) -> torch.Tensor:
    token = _ACTIVE.set(recorder)
    try:
        if recorder.batch is None:
            out = problem.f_single(params, x)
        else:  # the batched forward of the problem's own parameters may skip functional_call's swapping
            out = problem.f_own(x) if params is problem.params else problem.f_batch(params, x)
    finally:
        _ACTIVE.reset(token)
    recorder.check_count()
    if recorder.batch is not None and not recorder.record_only and not recorder.plan.probe_outputs:
        if recorder.outputs_modified():
            raise _OutputModified
    return out


def is_batch_safe(problem: NtkProblem, plan: StructurePlan, x: torch.Tensor) -> bool:
    """Whether every covered call sees the examples along dim 0, in order, so a batched forward can replace the
    per-example one (NOTE [probes]): the inputs of a 2-example run have dim 0 of size 2 where one example gives
    1, and their first row equals the 1-example run's.

    Args:
        x: (2, *input), two different examples.
    """
    if plan.fallback or x.shape[0] < 2:
        return False
    runs = []
    for batch in (x[:1], x[:2]):
        recorder = _Recorder(plan, batch.shape[0])
        recorder.record_only = True
        with _hooks(plan.layers, None, recorder.post), torch.no_grad():
            try:
                _run_recorded(problem, recorder, problem.params, batch)
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


def capture(problem: NtkProblem, plan: StructurePlan, x: torch.Tensor, *, batched: bool = False) -> Capture:
    """One forward and one output-basis-vmapped reverse pass (see NOTE [probes]); for a sequential chain with no
    hooks, the closed form of ``run_chain`` instead (NOTE [sequential chains] in ``structured_chain.py``).

    Args:
        problem: the prepared model.
        plan: its structure plan.
        x: (n, *input).
        batched: run the forward on the whole block with plain autograd (only when ``is_batch_safe``, which
            also means no fallback parameters); else per example under vmap.

    Returns:
        The capture: inputs[i] (n, *in_shape), deltas[i] (n, k, *out_shape) for use i; fallback name -> (n, k, p).
    """
    if plan.chain is not None and plan.chain.is_runnable():  # NOTE [sequential chains]
        inputs, deltas = run_chain(plan.chain, x, len(plan.uses))
        return Capture(inputs=inputs, deltas=deltas, fallback_jacobians={})
    if batched:
        return _capture_batched(problem, plan, x)
    n, k = x.shape[0], problem.k
    recorder = _Recorder(plan)
    probes = tuple(torch.zeros(u.out_shape, dtype=problem.dtype) for u in plan.uses)
    fallback = {name: problem.params[name] for name in plan.fallback}
    constants = {name: t for name, t in problem.params.items() if name not in fallback}

    def forward(
        probe_args: tuple[torch.Tensor, ...], fallback_args: NamedTensors, x_i: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        recorder.probes, recorder.inputs = list(probe_args), []
        out = _run_recorded(problem, recorder, {**constants, **fallback_args}, x_i)
        return out, tuple(recorder.inputs)

    with _hooks(plan.layers, None, recorder.post), torch.enable_grad():
        (d_probes, d_fallback), inputs = vmap(jacrev(forward, argnums=(0, 1), has_aux=True), (None, None, 0))(
            probes, fallback, x
        )
    return Capture(
        inputs=list(inputs),
        deltas=list(d_probes),
        fallback_jacobians={name: j.reshape(n, k, -1) for name, j in d_fallback.items()},
    )


def _capture_batched(problem: NtkProblem, plan: StructurePlan, x: torch.Tensor) -> Capture:
    try:
        return _capture_batched_once(problem, plan, x)
    except _OutputModified:  # NOTE [outputs as probes]: from now on this plan adds probes
        plan.probe_outputs = True
        return _capture_batched_once(problem, plan, x)


def _capture_batched_once(problem: NtkProblem, plan: StructurePlan, x: torch.Tensor) -> Capture:
    n, k = x.shape[0], problem.k
    if any(isinstance(layer, nn.Conv1d | nn.Conv2d) for layer in plan.layers):
        if plan.channels_last and x.device.type == "cpu":  # NOTE [channels-last capture] was measured on oneDNN
            try:
                return _capture_passes(problem, plan, x, channels_last=True)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:  # e.g. the model views a convolution's output: .view needs NCHW strides
                plan.channels_last = False
        return _capture_passes(problem, plan, x, channels_last=False)
    recorder = _Recorder(plan, n)
    with _hooks(plan.layers, None, recorder.post), torch.enable_grad():
        out = _run_recorded(problem, recorder, problem.params, x)  # (n, k)
        eye = torch.eye(k, dtype=problem.dtype)
        head = _linear_head(plan, recorder, out)
        if head is not None:  # NOTE [linear head]
            weight = plan.states[plan.uses[-1].layer]["weight"]  # (k, in)
            cotangent = weight.unsqueeze(1).expand(k, n, weight.shape[1])  # ∂f_c/∂a = W[c], every example
            earlier = recorder.probes[:-1]
            head_grads: tuple[torch.Tensor | None, ...] = (None,) * len(earlier)
            if earlier and head.requires_grad:  # else no earlier call reaches the head's input: δ = 0
                head_grads = torch.autograd.grad(head, earlier, cotangent, is_grads_batched=True, allow_unused=True)
            deltas = [
                torch.zeros((n, k, *p.shape[1:]), dtype=p.dtype) if g is None else g.transpose(0, 1)
                for g, p in zip(head_grads, earlier, strict=True)
            ]
            return _batched_capture(recorder, [*deltas, eye.unsqueeze(0).expand(n, k, k)])
        # a materialized basis: the batched matmul of a Linear output layer's backward then folds k into its
        # rows (one mm) instead of an expanded bmm
        basis = eye.unsqueeze(1).expand(k, n, k).contiguous()
        grads = torch.autograd.grad(out, recorder.probes, basis, is_grads_batched=True, allow_unused=True)
    deltas = [  # views of (k, n, ...) memory
        torch.zeros((n, k, *p.shape[1:]), dtype=p.dtype) if g is None else _output_basis(g, basis, eye)
        for g, p in zip(grads, recorder.probes, strict=True)
    ]
    return _batched_capture(recorder, deltas)


def _linear_head(plan: StructurePlan, recorder: _Recorder, out: torch.Tensor) -> torch.Tensor | None:
    """The input a (n, in) of the last covered call when the model's output (n, k) is exactly that call's output
    and it is an ``nn.Linear`` with k outputs; else None.

    NOTE [linear head]: then ∂f_c/∂a = W[c] for every example, so the reverse pass can start at a with those
    rows (stride 0 over the examples) instead of at the output with the basis: it skips the head's batched
    matmul, whose (k, n, in) result is the size of a hidden layer's δ, and the head's δ is the identity.
    "Exactly": same memory, contiguous, and not modified in place after the call (its version counter).
    """
    if not recorder.outputs or len(recorder.outputs) != len(plan.uses) or not recorder.probes:
        return None
    probed, version = recorder.outputs[-1]
    a = recorder.inputs[-1]
    layer = plan.layers[plan.uses[-1].layer]
    same = probed.data_ptr() == out.data_ptr() and probed.shape == out.shape and probed._version == version
    if not (isinstance(layer, nn.Linear) and same and out.is_contiguous() and a.ndim == 2):
        return None
    if layer.out_features != out.shape[1] or "weight" not in plan.states[plan.uses[-1].layer]:
        return None
    return a


def _output_basis(grad: torch.Tensor, basis: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """A probe's δ (k, n, ...) as (n, k, ...); the basis itself (a layer whose output is the model's output)
    as the identity expanded over the examples (stride 0), which the contraction recognizes (NOTE
    [example-independent δ] in structured_contract.py)."""
    if grad.shape == basis.shape and grad.data_ptr() == basis.data_ptr():
        return eye.unsqueeze(0).expand(basis.shape[1], *eye.shape)
    return grad.transpose(0, 1)


def _capture_passes(problem: NtkProblem, plan: StructurePlan, x: torch.Tensor, *, channels_last: bool) -> Capture:
    """The batched capture of a convolutional model: k plain reverse passes, one per output, each written into
    its slot of the deltas' memory (vmap's convolution_backward rule, which ``is_grads_batched`` would use,
    clones its inputs and loops over the outputs, then concatenates). See NOTE [channels-last capture]."""
    n, k = x.shape[0], problem.k
    recorder = _Recorder(plan, n)
    recorder.channels_last = channels_last
    with _hooks(plan.layers, recorder.pre if channels_last else None, recorder.post), torch.enable_grad():
        out = _run_recorded(problem, recorder, problem.params, x)  # (n, k)
        buffers: list[torch.Tensor | None] = [None] * len(recorder.probes)
        basis = [False] * len(recorder.probes)  # so far every pass gave the cotangent itself: δ_c = e_c
        eye = torch.eye(k, dtype=problem.dtype)
        for c in range(k):
            cotangent = eye[c].expand(n, k)
            grads = torch.autograd.grad(out, recorder.probes, cotangent, retain_graph=c < k - 1, allow_unused=True)
            for i, g in enumerate(grads):
                if g is None:
                    continue
                buffer = buffers[i]
                if buffer is None and (c == 0 or basis[i]) and _is_same_view(g, cotangent):
                    basis[i] = True  # a layer whose output is the model's output
                    continue
                if buffer is None:  # earlier passes gave zeros (no cotangent) or e_c (the basis)
                    buffer = buffers[i] = _delta_buffer(g, k)
                    if basis[i]:
                        buffer[:, :c].copy_(eye[:c].expand(n, c, k))
                    else:
                        buffer[:, :c].zero_()
                    basis[i] = False
                buffer[:, c].copy_(g)
    deltas = [
        eye.expand(n, k, k)  # e_c for every example (stride 0): NOTE [example-independent δ] in structured_contract
        if is_basis
        else torch.zeros((n, k, *p.shape[1:]), dtype=p.dtype)
        if b is None
        else b
        for b, p, is_basis in zip(buffers, recorder.probes, basis, strict=True)
    ]
    return _batched_capture(recorder, deltas)


def _is_same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same elements of the same memory."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _batched_capture(recorder: _Recorder, deltas: list[torch.Tensor]) -> Capture:
    """The batched forward saw each use's (1, ...) per-example shape as (n, ...): put the 1 back."""
    return Capture(
        inputs=[a.detach().unsqueeze(1) for a in recorder.inputs],
        deltas=[d.unsqueeze(2) for d in deltas],  # (n, k, 1, *out_shape[1:])
        fallback_jacobians={},
    )


def _delta_buffer(grad: torch.Tensor, k: int) -> torch.Tensor:
    """Uninitialised δ (n, k, *grad.shape[1:]) for the k reverse passes of ``_capture_passes``.

    A channels-last cotangent (n, C, H, W) gets memory (n, H, W, k, C): each example's δ is then an (H·W, k·C)
    matrix, so a convolution's weight Jacobian is one batched matmul with its patches and the bias a sum over
    the outer axes (NOTE [channels-last capture]); others get (n, k, ...).
    """
    n, *shape = grad.shape
    if grad.ndim == 4 and grad.is_contiguous(memory_format=torch.channels_last) and not grad.is_contiguous():
        c, h, w = shape
        return prefer_huge_pages(torch.empty((n, h, w, k, c), dtype=grad.dtype)).permute(0, 3, 4, 1, 2)
    return prefer_huge_pages(torch.empty((n, k, *shape), dtype=grad.dtype))
