"""AUTO's cost model and the dispatch table: which implementation and block plan a kernel call takes.

``compute_ntk`` and ``compute_ntk_groups`` (``api.py``) call :func:`choose`; the benchmarks and tests that look
at a plan call :func:`plan_choice` and read :data:`ALGORITHMS`. Moved here unchanged from ``api.py`` (same
constants, same logic), so ``api.py`` holds only the public functions.

NOTE [auto choice]: AUTO plans every implementation for the memory budget and takes the one with the fewest
estimated FLOPs (``NtkAlgorithm.flops``, from P, k, N, M and the counted forward FLOPs) among those that fit.
Forward-mode products run at a lower fraction of peak than the dense matmuls of a contraction on CPU, so on the CPU
each implementation's FLOPs are weighted by its ``cost_weight`` (the NTK-vector products' 3.0, measured with
benchmarks/bench_kernels.py, against the Jacobian contraction's 1.0). It never times the candidates.
Structured's weight depends on how it captures (``Structured.cost_weight``, measured with
benchmarks/bench_real_models.py, alternating in one process): 1.05 for the batched capture, whose k reverse
passes run at a lower rate per FLOP than ``vmap(jacrev)`` on deep convolutional models (the ResNet: ~2.5 against
~9 GFLOP per CPU second) while its estimate is within 1 % of the Jacobian contraction's (every weight in Jacobian
form), so the plain contraction wins there; every case where the batched capture won by measurement has an
estimate ratio <= 0.91 (CNN trace N = 16) and keeps it. 1.0 for the per-example capture (fallback parameters,
e.g. attention's packed projections): it is ``vmap(jacrev)``'s work too, and on the benchmark transformer it took
0.83-1.04 of the contraction's time per estimated FLOP (N = M = 8, 16, 32, FULL and TRACE) with estimates
1.05-1.17 of the contraction's, so the contraction is taken there (it was 0.92-0.97 of structured's time).
The weights are kept per device kind (``_EFFICIENCY_BY_DEVICE``); no GPU has measured any yet, so off the CPU every
estimated FLOP weighs 1 (docs/gpu.md).
The choice is kept with the problem per call shape (``NtkProblem.choices``) and reused while the budget gives the
same answer: a budget between the plan's estimate and the budget it was made for always does, a larger one only
when the plan is the planner's first candidate and the implementation the cheapest of all (fitting or not).
"""

from __future__ import annotations

from ntk_service.errors import MemoryEstimateExceeded, UnknownImplementation, UnsupportedModel
from ntk_service.kernels.algorithm import NtkAlgorithm
from ntk_service.kernels.jacobian_contraction import JacobianContraction
from ntk_service.kernels.modes import KernelMode, contraction
from ntk_service.kernels.ntk_vector_products import NtkVectorProducts
from ntk_service.kernels.planning import BlockPlan, plan_blocks
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime.device import model_device
from ntk_service.kernels.structured import Structured, StructuredOptions
from ntk_service.kernels.types import NtkImplementation

__all__ = ["ALGORITHMS", "GROUP_ALGORITHMS", "choose", "loop_implementation", "plan_choice", "weighted_costs"]

ALGORITHMS: dict[NtkImplementation, NtkAlgorithm] = {
    NtkImplementation.JACOBIAN_CONTRACTION: JacobianContraction(),
    NtkImplementation.NTK_VECTOR_PRODUCTS: NtkVectorProducts(),
    NtkImplementation.STRUCTURED: Structured(),
}
"""The dispatch table: one NtkAlgorithm per concrete implementation."""

GROUP_ALGORITHMS = {impl: alg for impl, alg in ALGORITHMS.items() if alg.group_kernels is not None}
"""The implementations that form per-parameter terms and so serve ``compute_ntk_groups`` (NOTE [group kernels])."""


def _algorithms(structured: StructuredOptions | None, groups: int) -> dict[NtkImplementation, NtkAlgorithm]:
    """The dispatch table of a call: ``ALGORITHMS`` (or ``GROUP_ALGORITHMS``), structured with the caller's
    options when given."""
    table = ALGORITHMS if not groups else GROUP_ALGORITHMS
    if structured is None or structured == StructuredOptions():
        return table
    return {**table, NtkImplementation.STRUCTURED: Structured(structured)}


def _weight(impl: NtkImplementation, alg: NtkAlgorithm, problem: NtkProblem) -> float:
    """The cost of one estimated FLOP of ``alg`` on ``problem`` (NOTE [auto choice]): on the CPU its ``cost_weight``;
    elsewhere the device kind's table (the CPU's weights are measured on this CPU only)."""
    kind = model_device(problem.module).type
    if kind != "cpu":
        return _EFFICIENCY_BY_DEVICE.get(kind, {}).get(impl, 1.0)
    return alg.cost_weight(problem)


_EFFICIENCY_BY_DEVICE: dict[str, dict[NtkImplementation, float]] = {
    # Not measured: no GPU has run this engine yet (docs/gpu.md), so every estimated FLOP weighs 1 on CUDA.
    # benchmarks/bench_gpu.py prints the ratios to set these from when a GPU is available.
    "cuda": {},
}
"""AUTO's weights per device kind (``torch.device.type``) off the CPU; a missing implementation weighs 1."""


_CHOICES_PER_PROBLEM = 64
"""Call shapes whose choice a kept problem remembers (a server sees few; all are forgotten past this many)."""


def choose(
    implementation: NtkImplementation,
    problem_args: tuple,  # type: ignore[type-arg]
    budget: int,
    groups: int = 0,
    structured: StructuredOptions | None = None,
) -> tuple[NtkAlgorithm, BlockPlan]:
    """The implementation and block plan for a call; reused from ``problem.choices`` when still the answer
    (NOTE [auto choice]).

    Args:
        implementation (NtkImplementation): the caller's, AUTO included.
        problem_args (tuple): ``(problem, n, m, mode, symmetric)`` of the call.
        budget (int): the peak bytes the plan must fit.
        groups (int): the number of group kernels (``compute_ntk_groups``), 0 for one kernel. Default: 0.
        structured (StructuredOptions, optional): the structured engine's options. Default: None (the defaults).

    Returns:
        (NtkAlgorithm, BlockPlan): what runs, and its blocks.

    Raises:
        UnknownImplementation: an implementation this build or a grouped call does not offer.
        MemoryEstimateExceeded: no candidate fits ``budget`` (the smallest refusal's estimate).
    """
    problem, n, m, mode, symmetric = problem_args
    key = (implementation, n, m, mode, symmetric, groups, structured)
    kept = problem.choices.get(key)
    if kept is not None:
        alg, plan, planned_for, any_larger = kept
        if plan.estimate_bytes <= budget and (budget <= planned_for or any_larger):
            return alg, plan
    alg, plan, any_larger = plan_choice(implementation, problem_args, budget, groups, structured)
    if len(problem.choices) >= _CHOICES_PER_PROBLEM:
        problem.choices.clear()
    problem.choices[key] = (alg, plan, budget, any_larger)
    return alg, plan


def plan_choice(
    implementation: NtkImplementation,
    problem_args: tuple,  # type: ignore[type-arg]
    budget: int,
    groups: int = 0,
    structured: StructuredOptions | None = None,
) -> tuple[NtkAlgorithm, BlockPlan, bool]:
    """``choose`` without the kept choices: the algorithm, its plan and whether any larger budget would make the
    same choice (arguments and errors as ``choose``)."""
    problem, n, m, mode, symmetric = problem_args
    candidates = _algorithms(structured, groups)
    kernels = max(groups, 1)
    if implementation is not NtkImplementation.AUTO:
        if implementation not in ALGORITHMS:
            raise UnknownImplementation(
                f"compute_ntk: implementation {implementation.value!r} is not available in this build; "
                f"use one of {[i.value for i in ALGORITHMS]} or 'auto'"
            )
        if implementation not in candidates:
            raise UnknownImplementation(
                f"compute_ntk_groups: implementation {implementation.value!r} forms no per-parameter terms (it "
                "never builds J), so it cannot split the kernel by group in one pass; use one of "
                f"{[i.value for i in candidates]} or 'auto', or compute_ntk(params=...) once per group"
            )
        alg = candidates[implementation]
        plan = plan_blocks(alg, problem, n, m, mode, symmetric=symmetric, budget_bytes=budget, groups=kernels)
        return alg, plan, plan.first_choice
    best: tuple[float, NtkAlgorithm, BlockPlan] | None = None
    refusal: MemoryEstimateExceeded | None = None
    costs = weighted_costs(problem, n, m, mode, candidates)
    for impl, alg in candidates.items():
        try:
            plan = plan_blocks(alg, problem, n, m, mode, symmetric=symmetric, budget_bytes=budget, groups=kernels)
        except MemoryEstimateExceeded as exc:
            if refusal is None or (exc.estimate_bytes or 0) < (refusal.estimate_bytes or 0):
                refusal = exc
            continue
        if best is None or costs[impl] < best[0]:
            best = (costs[impl], alg, plan)
    if best is None:
        assert refusal is not None
        raise refusal
    cost, alg, plan = best
    return alg, plan, plan.first_choice and cost <= min(costs.values())


def weighted_costs(
    problem: NtkProblem,
    n: int,
    m: int,
    mode: KernelMode,
    candidates: dict[NtkImplementation, NtkAlgorithm] | None = None,
) -> dict[NtkImplementation, float]:
    """AUTO's cost of each implementation for a call (NOTE [auto choice]): its estimated FLOPs times its weight.

    Args:
        problem: the prepared model; n, m: N and M; mode: the engine mode.
        candidates: the table to weigh. Default: ``ALGORITHMS``.

    Returns:
        implementation -> weighted FLOPs (the lowest is AUTO's pick among the plans that fit the budget).
    """
    table = ALGORITHMS if candidates is None else candidates
    core = contraction(mode)  # what the implementations contract for the mode (NOTE [mode contractions])
    return {impl: alg.flops(problem, n, m, core) * _weight(impl, alg, problem) for impl, alg in table.items()}


def loop_implementation(implementation: NtkImplementation, problem: NtkProblem) -> NtkImplementation:
    """The implementation for a problem that refused ``vmap`` over examples (NOTE [per-example loop] in
    jacobian_contraction.py): AUTO takes the Jacobian contraction, whose per-example loop works; the others
    batch examples through ``vmap`` and are refused up front. Any other problem: ``implementation`` unchanged.

    Raises:
        UnsupportedModel: NTK_VECTOR_PRODUCTS or STRUCTURED asked for such a problem.
    """
    if not problem.per_example_loop or implementation is NtkImplementation.JACOBIAN_CONTRACTION:
        return implementation
    if implementation is NtkImplementation.AUTO:
        return NtkImplementation.JACOBIAN_CONTRACTION
    raise UnsupportedModel(
        f"compute_ntk: implementation {implementation.value!r} evaluates examples under torch.func.vmap, which this "
        "model refuses (data-dependent control flow, e.g. a branch on an attention mask's values); use "
        "implementation='jacobian_contraction' or 'auto', which build its Jacobians one example at a time"
    )
