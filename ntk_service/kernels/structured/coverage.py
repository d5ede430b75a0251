"""The analysis pass of the structured engine: which op calls the rules cover (``plan_structure``) and how each
parameter is contracted (``choose_terms``), together ``analyze``, whose frozen ``StructuredTerms`` the engine keeps
on the prepared problem.

NOTE [covered parameters]: the engine reads a model by its operators, not its module types, so an ``nn.Module``'s
forward and an exported program's graph (which calls ``aten.linear``, ``aten.conv2d``, ... and none of its
submodules) are read the same way. ``plan_structure`` runs the model once on one example under a
``TorchFunctionMode`` that sees every torch operation and its arguments. A selected parameter reaches ops either
through *derivations* (a scale by a number, a transpose, a view or slice: ``tracking.py``) or as an operand; every
op call taking one is a *use*. A use is covered when the op's rule reads it (``rules.py``: linear/matmul/addmm,
conv, embedding, the affine parameters of the normalisations, an elementwise scale or bias of an activation);
a parameter is covered only if *every* use is. One use without a rule (a parameter in ``torch.einsum``, divided
into, multiplied by another parameter, read by an op the engine does not know) sends that parameter, and only
it, to the Jacobian path, with the ops named in ``StructurePlan.outside``; nothing is skipped silently. A layer
called several times (weight sharing) has one use per call; a tied weight (one tensor in several ops: an embedding
and a head) collects every use. ``F.multi_head_attention_forward`` runs as the ops it is made of
(``attention.py``), so its projections are covered uses too.

Shapes: ``example`` is (1, *input); the plan records every covered call's input and output shapes on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ntk_service.kernels.problem.batch import Batch
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured.attention import decomposition
from ntk_service.kernels.structured.chain import sequential_chain
from ntk_service.kernels.structured.ops import METADATA, OPS, Op, op_name
from ntk_service.kernels.structured.options import StructuredOptions
from ntk_service.kernels.structured.plan import FactoredTerm, JacobianTerm, Site, StructuredTerms, StructurePlan
from ntk_service.kernels.structured.recorder import saved_activation_bytes
from ntk_service.kernels.structured.rules import Call, rule_for
from ntk_service.kernels.structured.tracking import ParameterTracker

__all__ = ["NOMINAL_PARTNERS", "analyze", "choose_terms", "plan_structure"]


@dataclass(frozen=True)
class _Seen:
    call: Call
    op: Op
    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


class _StructureProbe(TorchFunctionMode):
    """The one-example run of ``plan_structure``: derivations tracked, uses read by the rules or set aside."""

    def __init__(self, tracker: ParameterTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.seen: list[_Seen] = []
        self.outside: dict[str, list[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        body = decomposition(func, args, kwargs)
        if body is not None:
            with self:
                return body()
        if METADATA(func):
            return func(*args, **kwargs)
        maps = self.tracker.tracked_leaves(args, kwargs)
        out = func(*args, **kwargs)
        if not maps:
            return out
        op = OPS.get(func)
        if op is not None:
            bound = op.bind(args, kwargs)
            if self.tracker.derive(op, bound, func, args, kwargs, out):
                return out
            rule = rule_for(op)
            call = rule.parse(op, bound, self.tracker) if rule is not None else None
            if call is not None and isinstance(out, torch.Tensor) and len(call.params) == len(maps):
                a = bound.get(call.input_arg) if call.input_arg is not None else None
                in_shape = tuple(a.shape) if isinstance(a, torch.Tensor) else ()
                self.seen.append(_Seen(call, op, op_name(func), in_shape, tuple(out.shape)))
                return out
        for mp in maps:
            self.outside.setdefault(mp.name, []).append(op_name(func))
        return out


def plan_structure(problem: NtkProblem, example: Batch) -> StructurePlan:
    """Run one example to record every use of the selected parameters, and assign each to a rule or the Jacobian
    path.

    Args:
        problem: the prepared model.
        example: (1, *input), one example (values only steer data-dependent control flow).

    Returns:
        The plan; every selected parameter is in ``param_uses`` or ``fallback`` (see NOTE [covered parameters]).
    """
    probe = _StructureProbe(ParameterTracker(dict(problem.params), exact=True))
    with torch.no_grad(), probe:
        problem.f_batch(problem.params, example)
    fallback = tuple(name for name in problem.params if name in probe.outside)
    dropped = set(fallback)
    sites: list[Site] = []
    param_uses: dict[str, list[tuple[int, str]]] = {name: [] for name in problem.params if name not in dropped}
    for seen in probe.seen:
        roles = tuple((role, mp) for role, mp in seen.call.params.items() if mp.name not in dropped)
        if not roles:
            continue
        for role, mp in roles:
            param_uses[mp.name].append((len(sites), role))
        call = seen.call
        sites.append(
            Site(call.rule, call.config, seen.op.family, seen.name, call.input_arg, roles, call.state,
                 seen.in_shape, seen.out_shape)
        )  # fmt: skip
    plan = StructurePlan(
        sites=tuple(sites),
        param_uses={name: tuple(uses) for name, uses in param_uses.items()},
        fallback=fallback,
        outside={name: tuple(dict.fromkeys(probe.outside[name])) for name in fallback},
        saved_bytes=0.0,
        chain=None,
    )
    chain = None
    if not fallback and isinstance(example, torch.Tensor):  # a chain takes one tensor, never a tuple or mapping
        chain = sequential_chain(problem, example[:1], plan.sites)
    return dataclasses.replace(plan, saved_bytes=saved_activation_bytes(problem, plan, example), chain=chain)


NOMINAL_PARTNERS = 64
"""Examples a side is assumed to be contracted with when weighing the one-off cost of building a Jacobian
against the per-pair cost of the factored form (a side does not know M; blocks are rarely smaller)."""


def _factorable(plan: StructurePlan, uses: tuple[tuple[int, str], ...]) -> list[tuple[int, ...]] | None:
    """Each use's factor dims (G, T, da, dd) when the uses can form one factored term: every one a factored role
    of one rule with one meaning of its factors, the parameter itself (no view), equal G, da, dd; else None."""
    sites = [plan.sites[u] for u, _ in uses]
    if not uses or any(role not in site.rule.factored for site, (_, role) in zip(sites, uses, strict=True)):
        return None
    if len({site.rule.factor_key(site.config) for site in sites}) != 1:
        return None
    if any(site.param(role).index is not None for site, (_, role) in zip(sites, uses, strict=True)):
        return None
    dims = [site.rule.factor_dims(site.config, site.in_shape, site.out_shape) for site in sites]
    return dims if len({(d[0], *d[2:]) for d in dims}) == 1 else None


def choose_terms(problem: NtkProblem, plan: StructurePlan, options: StructuredOptions) -> StructuredTerms:
    """How each rule-covered parameter is contracted (NOTE [factored or Jacobian] in algorithm.py)."""
    k = problem.k
    factored: list[FactoredTerm] = []
    jacobian: list[JacobianTerm] = []
    folded: set[str] = set()
    for name, uses in plan.param_uses.items():
        if name in folded:
            continue
        numel = problem.params[name].numel()
        dims = _factorable(plan, uses)
        build = sum(2.0 * k * d[0] * d[1] * d[2] * d[3] for d in dims) if dims else 0.0
        if dims:
            g, _, da, dd = dims[0]
            t = sum(d[1] for d in dims)
            first = plan.sites[uses[0][0]]
            index = first.rule.index_rows(first.config) > 0
            factored_cost = 2.0 * g * t * t * (k * k * dd + (1 if index else da) + k * k)
            jacobian_cost = 2.0 * k * k * numel + 2 * build / NOMINAL_PARTNERS
            form = options.form
            if form == "factored" or (form == "cheaper" and factored_cost < jacobian_cost):
                bias = _foldable_bias(plan, name) if not index and options.fold_bias else None
                if bias is not None:
                    folded.add(bias[0])
                scales = tuple(plan.sites[u].param(role).scale for u, role in uses)
                factored.append(
                    FactoredTerm(
                        name,
                        tuple(u for u, _ in uses),
                        None if bias is None else bias[0],
                        index,
                        (g, t, da, dd),
                        scales,
                        1.0 if bias is None else bias[1],
                    )
                )
                continue
        build = sum(
            2.0 * k * d[0] * d[1] * d[2] * d[3]
            for d in (
                plan.sites[u].rule.factor_dims(plan.sites[u].config, plan.sites[u].in_shape, plan.sites[u].out_shape)
                for u, role in uses
                if role in plan.sites[u].rule.factored
            )
        )
        jacobian.append(JacobianTerm(name, tuple(uses), numel, build))
    return StructuredTerms(
        plan,
        tuple(factored),
        tuple(t for t in jacobian if t.name not in folded),
        channels_last=options.channels_last,
    )


def _foldable_bias(plan: StructurePlan, weight: str) -> tuple[str, float] | None:
    """The bias used in exactly the calls that use ``weight``, as the parameter itself with one scale in all of
    them, if it is rule-covered: (its name, that scale)."""
    sites = tuple(u for u, _ in plan.param_uses[weight])
    for name, uses in plan.param_uses.items():
        if name == weight or tuple(u for u, _ in uses) != sites or not uses:
            continue
        if not all(role == "bias" for _, role in uses):
            continue
        maps = [plan.sites[u].param(role) for u, role in uses]
        if all(mp.index is None for mp in maps) and len({mp.scale for mp in maps}) == 1:
            return name, maps[0].scale
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
