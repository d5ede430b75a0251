"""The analysis pass of the structured engine: which parameters each rule covers (``plan_structure``) and how each
is contracted (``choose_terms``), together ``analyze``, whose frozen ``StructuredTerms`` the engine keeps on the
prepared problem.

NOTE [covered parameters]: a parameter is covered by a rule only if *every* use of it is a call of a layer that
the rule understands. ``plan_structure`` runs the model once on one example under a ``TorchFunctionMode`` that
sees every torch operation and its tensor arguments, while forward hooks track which rule layer is executing.
An operation taking a selected parameter outside the forward of a rule layer that owns it (a bare
``nn.Parameter`` in custom math, ``F.linear(h, embedding.weight)`` for a tied head, the packed projections that
``nn.MultiheadAttention`` passes to ``F.multi_head_attention_forward``) sends that parameter to the Jacobian
path; nothing is skipped silently. A layer called several times (weight sharing) has one use per call, and
tied weights (one tensor in several layers) collect the uses of all those layers.

Shapes: ``example`` is (1, *input); the plan records every covered call's per-example input and output shapes.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ntk_service.kernels.problem.batch import Batch, take
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured.chain import sequential_chain
from ntk_service.kernels.structured.options import StructuredOptions
from ntk_service.kernels.structured.plan import FactoredTerm, JacobianTerm, StructuredTerms, StructurePlan, Use
from ntk_service.kernels.structured.recorder import ACTIVE, Recorder, hooks
from ntk_service.kernels.structured.rules import Rule, rule_for

__all__ = ["NOMINAL_PARTNERS", "analyze", "choose_terms", "plan_structure"]

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
        if ACTIVE.get() is self:
            self.stack.append(self.index[id(module)])

    def post(self, module: nn.Module, args: tuple, output: object) -> None:  # type: ignore[type-arg]
        if ACTIVE.get() is not self:
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


def plan_structure(problem: NtkProblem, example: Batch) -> StructurePlan:
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
    token = ACTIVE.set(probe)
    try:
        with hooks(layers, probe.pre, probe.post), torch.no_grad(), _UseTracker(selected, probe):
            problem.f_batch(problem.params, example)
    finally:
        ACTIVE.reset(token)

    first_call: dict[int, int] = {}
    for use in probe.uses:
        first_call.setdefault(use.layer, len(first_call))
    keep = sorted((i for i in first_call if i not in probe.odd_layers), key=first_call.__getitem__)
    prefixes: dict[int, str] = {}
    for name, m in problem.module.named_modules():
        prefixes.setdefault(id(m), name)
    renumber = {old: new for new, old in enumerate(keep)}
    kept_layers = tuple(layers[i] for i in keep)
    owner: dict[str, list[tuple[int, str]]] = {}
    for i in range(len(layers)):  # never-called layers still own their parameters (their J is zero)
        for role in roles[i]:
            owner.setdefault(canonical[id(layers[i]._parameters[role])], [])
    uses = tuple(Use(renumber[u.layer], u.in_shape, u.out_shape) for u in probe.uses if u.layer in renumber)
    for index, use in enumerate(uses):
        layer = kept_layers[use.layer]
        for role in roles[keep[use.layer]]:
            owner[canonical[id(layer._parameters[role])]].append((index, role))
    odd_params = {canonical[id(layers[i]._parameters[r])] for i in probe.odd_layers for r in roles[i]}
    param_uses: dict[str, tuple[tuple[int, str], ...]] = {}
    fallback: list[str] = []
    for name in problem.params:
        if name in owner and name not in probe.outside and name not in odd_params:
            param_uses[name] = tuple(owner[name])
        else:
            fallback.append(name)
    plan = StructurePlan(
        layers=kept_layers,
        rules=tuple(rules[i] for i in keep),
        states=tuple(_module_state(problem, layers[i], prefixes) for i in keep),
        uses=uses,
        param_uses=param_uses,
        fallback=tuple(fallback),
        saved_bytes=0.0,
        chain=None,
    )
    chain = None
    if not fallback and isinstance(example, torch.Tensor):  # a chain takes one tensor, never a tuple or mapping
        chain = sequential_chain(problem, example[:1], [kept_layers[u.layer] for u in uses])
    return dataclasses.replace(plan, saved_bytes=_saved_activation_bytes(problem, plan, example), chain=chain)


def _saved_activation_bytes(problem: NtkProblem, plan: StructurePlan, example: Batch) -> float:
    """Bytes autograd saves for the probes' backward on one example, parameters and buffers excluded."""
    shared = {t.untyped_storage().data_ptr() for t in (*problem.params.values(), *problem.frozen.values())}
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage().data_ptr() not in shared:
            saved += t.numel() * t.element_size()
        return t

    recorder = Recorder(plan)  # per-example shapes: the 1-example batch is what the structure probe saw
    recorder.probes = [torch.zeros(u.out_shape, dtype=problem.dtype, requires_grad=True) for u in plan.uses]
    token = ACTIVE.set(recorder)
    try:
        with hooks(plan.layers, None, recorder.post), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                problem.f_batch(problem.params, take(example, 0, 1))
    finally:
        ACTIVE.reset(token)
    return float(saved)


NOMINAL_PARTNERS = 64
"""Examples a side is assumed to be contracted with when weighing the one-off cost of building a Jacobian
against the per-pair cost of the factored form (a side does not know M; blocks are rarely smaller)."""


def choose_terms(problem: NtkProblem, plan: StructurePlan, options: StructuredOptions) -> StructuredTerms:
    """How each rule-covered parameter is contracted (NOTE [factored or Jacobian] in algorithm.py)."""
    k = problem.k
    factored: list[FactoredTerm] = []
    jacobian: list[JacobianTerm] = []
    folded: set[str] = set()
    uses_of = {name: tuple(u for u, _ in uses) for name, uses in plan.param_uses.items()}
    for name, uses in plan.param_uses.items():
        if name in folded:
            continue
        numel = problem.params[name].numel()
        layers = [plan.uses[u].layer for u, _ in uses]
        rules = {type(plan.rules[layer]) for layer in layers}
        dims = [
            plan.rules[plan.uses[u].layer].factor_dims(
                plan.layers[plan.uses[u].layer], plan.uses[u].in_shape, plan.uses[u].out_shape
            )
            for u, role in uses
            if role in plan.rules[plan.uses[u].layer].factored
        ]
        can_factor = len(rules) == 1 and dims and len(dims) == len(uses) and len({(d[0], *d[2:]) for d in dims}) == 1
        build = sum(2.0 * k * d[0] * d[1] * d[2] * d[3] for d in dims) if dims else 0.0
        if can_factor:
            g, _, da, dd = dims[0]
            t = sum(d[1] for d in dims)
            index = plan.rules[layers[0]].index_rows(plan.layers[layers[0]]) > 0
            factored_cost = 2.0 * g * t * t * (k * k * dd + (1 if index else da) + k * k)
            jacobian_cost = 2.0 * k * k * numel + 2 * build / NOMINAL_PARTNERS
            form = options.form
            if form == "factored" or (form == "cheaper" and factored_cost < jacobian_cost):
                bias = _foldable_bias(plan, name, uses_of) if not index and options.fold_bias else None
                if bias is not None:
                    folded.add(bias)
                factored.append(FactoredTerm(name, uses_of[name], bias, index, (g, t, da, dd)))
                continue
        jacobian.append(JacobianTerm(name, tuple(uses), numel, build))
    return StructuredTerms(
        plan,
        tuple(factored),
        tuple(t for t in jacobian if t.name not in folded),
        channels_last=options.channels_last,
    )


def _foldable_bias(plan: StructurePlan, weight: str, uses_of: dict[str, tuple[int, ...]]) -> str | None:
    """The bias used in exactly the calls that use ``weight`` (same layer), if it is rule-covered."""
    for name, uses in plan.param_uses.items():
        if name != weight and uses_of[name] == uses_of[weight] and uses and all(role == "bias" for _, role in uses):
            return name
    return None


def analyze(problem: NtkProblem, options: StructuredOptions, example: Batch | None = None) -> StructuredTerms:
    """The one analysis pass: the structure of ``problem`` and its term choice, as a frozen plan.

    Args:
        problem: the prepared model.
        options: the engine's options (the form and bias folding steer the term choice; the capture switches set
            the plan's starting facts).
        example: (1, *input) one example; default: zeros of the input shape (float, else int64 token ids).
    """
    if example is None and problem.template is not None:  # a tuple or mapping of inputs (kernels/problem/batch.py)
        example = problem.template
    if example is None:
        example = torch.zeros((1, *problem.input_shape), dtype=problem.dtype)
        try:
            plan = plan_structure(problem, example)
        except (RuntimeError, IndexError, TypeError):  # e.g. an Embedding given float zeros
            plan = plan_structure(problem, example.to(torch.int64))
    else:
        plan = plan_structure(problem, example)
    return choose_terms(problem, plan, options)
