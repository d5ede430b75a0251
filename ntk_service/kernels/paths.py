"""What a model gets from the kernel engine: the path each parameter takes, and why, and what AUTO picks.

    >>> report = describe_paths(model, x)            # x: two or more examples of the model's input
    >>> report.auto.implementation                   # AUTO at N = M = 64, FULL, e.g. "structured"
    >>> [(g.group, g.form) for g in report.groups()]  # [("blocks.0.fc1", "factored"), ("gate", "jacobian"), ...]

Every selected parameter takes one of two paths (NOTE [covered parameters] in structured/coverage.py). On the
*structured* path its op's input and output cotangents give it in one of three forms: **factored** (Θ from their
Grams; J is never formed), **jacobian** (J built from them with one matmul, or a sum for a norm's affine or an
elementwise scale or bias) or **unused** (no op read it on these inputs: J = 0). On the *autograd* path
(**jacrev**) an op without a structure rule takes it, and its J comes from per-example autograd, for this parameter
only. AUTO then weighs the whole engine against the Jacobian contraction and the NTK-vector products by estimated
FLOPs (NOTE [auto choice] in choice.py); the report gives that choice at a nominal size, which a request of another size
may make differently (every result names the implementation it ran).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ntk_service.errors import MemoryEstimateExceeded
from ntk_service.kernels.choice import plan_choice, weighted_costs
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.problem.batch import Inputs
from ntk_service.kernels.problem.outputs import parse_output
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime.device import default_memory_budget
from ntk_service.kernels.runtime.problem_pool import prepared_problem
from ntk_service.kernels.structured import Structured, StructuredTerms
from ntk_service.kernels.structured.capture import CAPTURES
from ntk_service.kernels.structured.rules import ElementwiseRule, NormRule
from ntk_service.kernels.types import NtkImplementation

__all__ = ["NOMINAL_EXAMPLES", "AutoChoice", "ParameterPath", "PathGroup", "PathReport", "describe_paths"]

NOMINAL_EXAMPLES = 64
"""N = M of the call AUTO's choice is reported for: a typical request (the benchmarks' size)."""

_CAPTURES = {
    "chain": "closed form: the model is a pipeline of Linear layers and activations, no autograd",
    "conv passes": "one batched forward, k reverse passes (a convolutional model)",
    "batched": "one batched forward, one reverse pass batched over the k outputs",
    "per example": "per example under vmap",
}
"""How each capture strategy (structured/capture.py) gets the op inputs and cotangents, for the report."""


@dataclass(frozen=True)
class ParameterPath:
    """One parameter's path: ``form`` factored / jacobian / jacrev / unused (module docstring), the ops that
    take it, and why."""

    name: str
    form: str
    ops: tuple[str, ...]
    reason: str
    numel: int

    @property
    def structured(self) -> bool:
        """From its ops' inputs and cotangents (factored or jacobian), not per-example autograd."""
        return self.form in ("factored", "jacobian", "unused")


@dataclass(frozen=True)
class PathGroup:
    """Parameters of one module prefix that take the same path (a layer's weight and bias)."""

    group: str
    parameters: tuple[str, ...]
    form: str
    ops: tuple[str, ...]
    reason: str

    def to_public(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "parameters": list(self.parameters),
            "path": "structured" if self.form != "jacrev" else "autograd",
            "form": self.form,
            "ops": list(self.ops),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class AutoChoice:
    """AUTO's pick for N = M = ``n`` in ``mode`` and the weighted estimate it compared (GFLOP); ``implementation``
    None when no plan of that call fits the memory budget (``reason`` then has the refusal)."""

    implementation: str | None
    n: int
    mode: str
    estimated_gflop: dict[str, float]
    reason: str

    def to_public(self) -> dict[str, Any]:
        return {
            "implementation": self.implementation,
            "n": self.n,
            "mode": self.mode,
            "estimated_gflop": self.estimated_gflop,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class PathReport:
    """The paths of every selected parameter, the structured capture and AUTO's choice (module docstring).

    Attributes:
        parameters: per selected parameter, in ``named_parameters()`` order.
        capture: how the structured engine gets the op inputs and cotangents, and why.
        auto: AUTO's choice at a nominal size.
    """

    parameters: tuple[ParameterPath, ...]
    capture: str
    auto: AutoChoice

    def groups(self) -> tuple[PathGroup, ...]:
        """Consecutive parameters of one module prefix taking the same form through the same ops (a layer's
        weight and bias), as one group with the first one's reason."""
        groups: list[PathGroup] = []
        for p in self.parameters:
            prefix, _, leaf = p.name.rpartition(".")
            last = groups[-1] if groups else None
            if last is not None and (last.group, last.form, last.ops) == (prefix, p.form, p.ops):
                groups[-1] = PathGroup(prefix, (*last.parameters, leaf), p.form, p.ops, last.reason)
            else:
                groups.append(PathGroup(prefix, (leaf,), p.form, p.ops, p.reason))
        return tuple(groups)

    def to_public(self) -> dict[str, Any]:
        """The JSON of a model record's ``parameter_paths``."""
        structured = sum(p.numel for p in self.parameters if p.structured)
        return {
            "capture": self.capture,
            "auto": self.auto.to_public(),
            "structured_parameters": structured,
            "jacrev_parameters": sum(p.numel for p in self.parameters) - structured,
            "groups": [g.to_public() for g in self.groups()],
        }


def describe_paths(
    model: Any,
    x: Inputs,
    *,
    params: Sequence[str] | None = None,
    output: str | None = None,
    n: int = NOMINAL_EXAMPLES,
    mode: KernelMode | str = KernelMode.FULL,
    memory_budget_bytes: int | None = None,
) -> PathReport:
    """The path each parameter of ``model`` takes in the kernel engine, and AUTO's choice at N = M = ``n``.

    Args:
        model (nn.Module): as ``compute_ntk``.
        x (Tensor, tuple or mapping): (B, *input) examples the model is run on, B >= 2 and not all equal (the
            engine learns on two different examples where a batched forward keeps them).
        params (Sequence[str], optional): glob patterns over parameter names. Default: None (all).
        output (str, optional): as ``compute_ntk``'s ``output``. Default: None.
        n (int): N = M of the call AUTO's choice is reported for. Default: ``NOMINAL_EXAMPLES``.
        mode (KernelMode or str): the mode of that call (an engine mode). Default: FULL.
        memory_budget_bytes (int, optional): the budget AUTO plans for. Default: the default budget.

    Returns:
        PathReport.

    Raises:
        As ``compute_ntk`` for the model and inputs.
    """
    kernel_mode = KernelMode(mode)
    with prepared_problem(model, x, None, params=params, dtype=None, output=parse_output(output)) as prepared:
        problem, xt = prepared.problem, prepared.x1
        budget = default_memory_budget() if memory_budget_bytes is None else memory_budget_bytes
        if problem.per_example_loop:  # every implementation but the contraction's loop is refused (choice.py)
            why = "the model refuses torch.func.vmap (data-dependent control flow): J one example at a time"
            parameters = tuple(ParameterPath(name, "jacrev", (), why, t.numel()) for name, t in problem.params.items())
            auto = AutoChoice(NtkImplementation.JACOBIAN_CONTRACTION.value, n, kernel_mode.value, {}, why)
            return PathReport(parameters, "per-example loop: " + why, auto)
        auto = _auto(problem, n, kernel_mode, budget)
        alg = Structured()
        terms = alg.learn(problem, xt)  # how the batched capture may run, from two forwards (no capture: k may be big)
        strategy = next(s for s in CAPTURES if s.applies(problem, terms, alg.options)).name
        capture = f"{strategy}: {_CAPTURES.get(strategy, strategy)}"
        if strategy == "per example" and terms.fallback:
            capture += " (parameters on the jacrev path need per-example autograd)"
        elif strategy == "per example":
            capture += (
                " (an op does not keep the examples apart in a batched forward: a lookup shared by all examples,"
                " such as positions, or the batch reshaped across examples)"
            )
        return PathReport(_parameters(problem, terms), capture, auto)


def _auto(problem: NtkProblem, n: int, mode: KernelMode, budget: int) -> AutoChoice:
    """AUTO's choice for N = M = n in ``mode``, else in TRACE (a smaller result) when ``mode`` does not fit."""
    refusal = None
    for candidate in dict.fromkeys((mode, KernelMode.TRACE)):
        costs = weighted_costs(problem, n, n, candidate)
        estimate = {impl.value: round(cost / 1e9, 3) for impl, cost in sorted(costs.items(), key=lambda kv: kv[1])}
        try:
            alg, _, _ = plan_choice(NtkImplementation.AUTO, (problem, n, n, candidate, False), budget)
        except MemoryEstimateExceeded as exc:
            refusal = refusal or str(exc)
            continue
        chosen = alg.implementation.value
        cheapest = min(costs, key=costs.__getitem__).value
        reason = "the fewest weighted estimated FLOPs"
        if chosen != cheapest:
            reason = "the cheapest plan that fits the budget"
        if refusal is not None:
            reason += f" (in {candidate.value}: {mode.value} does not fit the budget)"
        return AutoChoice(chosen, n, candidate.value, estimate, reason)
    return AutoChoice(None, n, mode.value, estimate, f"no plan fits the memory budget: {refusal}")


def _parameters(problem: NtkProblem, terms: StructuredTerms) -> tuple[ParameterPath, ...]:
    plan = terms.plan
    factored = {t.name: t for t in terms.factored}
    folded = {t.bias: t for t in terms.factored if t.bias is not None}
    out = []
    order = [name for name, _ in problem.module.named_parameters() if name in problem.params]
    for name in order:
        tensor = problem.params[name]
        if name in plan.outside:
            ops = tuple(dict.fromkeys(_short(op) for op in plan.outside[name]))
            reason = f"taken by {', '.join(ops)}, which no structure rule covers: J by per-example autograd"
            out.append(ParameterPath(name, "jacrev", ops, reason, tensor.numel()))
            continue
        uses = plan.param_uses.get(name, ())
        ops = tuple(dict.fromkeys(_short(plan.sites[u].op) for u, _ in uses))
        if not uses:
            out.append(ParameterPath(name, "unused", (), "no op reads it on these inputs: J = 0", tensor.numel()))
        elif name in factored or name in folded:
            term = factored.get(name) or folded[name]
            t = term.dims[1]
            where = "one position" if t == 1 else f"{t} positions"
            bias = " (with its bias)" if term.bias is not None else ""
            reason = f"Θ from Grams of its op's input and output cotangents over {where}, J never formed{bias}"
            out.append(ParameterPath(name, "factored", ops, reason, tensor.numel()))
        else:
            rules = {type(plan.sites[u].rule) for u, _ in uses}
            if rules <= {NormRule}:
                reason = "J = Σ δ ⊙ x̂ from its op's input and output cotangents (a normalisation's affine)"
            elif rules <= {ElementwiseRule}:
                reason = "J = Σ δ (⊙ the other operand) from its op's output cotangents (an elementwise bias or scale)"
            else:
                reason = "J built from its op's input and output cotangents by one matmul"
                t = _positions(terms, uses)
                if t:
                    reason += f" (over {t} positions this is cheaper than the factored form)"
            if len(uses) > 1:
                reason += f"; summed over its {len(uses)} uses"
            out.append(ParameterPath(name, "jacobian", ops, reason, tensor.numel()))
    return tuple(out)


def _positions(terms: StructuredTerms, uses: tuple[tuple[int, str], ...]) -> int:
    """The positions T summed over a weight's uses (0 for roles without factors)."""
    sites = terms.plan.sites
    return sum(
        sites[u].rule.factor_dims(sites[u].config, sites[u].in_shape, sites[u].out_shape)[1]
        for u, role in uses
        if role in sites[u].rule.factored
    )


def _short(op: str) -> str:
    """An op's name for the report: "linear" for ``aten.linear`` and ``F.linear`` alike."""
    return op.removeprefix("aten.").removeprefix("Tensor.").split(".")[0]
