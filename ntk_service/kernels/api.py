"""``compute_ntk``: the one public entry point of the kernel engine, and its dispatch table.

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
    >>> compute_ntk(model, x1, x2).theta.shape                      # (N, M, k, k)
    torch.Size([5, 4, 2, 2])
    >>> compute_ntk(model, x1, mode="trace").theta.shape            # (N, N), exactly symmetric
    torch.Size([5, 5])
    >>> compute_ntk(model, x1, mode="example_diagonal").theta.shape # (N, k, k)
    torch.Size([5, 2, 2])

NOTE [auto choice]: AUTO plans every implementation for the memory budget and takes the one with the fewest
estimated FLOPs (``NtkAlgorithm.flops``, from P, k, N, M and the counted forward FLOPs) among those that fit.
Forward-mode products run at a lower fraction of peak than the dense matmuls of a contraction on CPU, so their
FLOPs are weighted by ``_EFFICIENCY`` (measured with benchmarks/bench_kernels.py). It never times the candidates.
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

NOTE [device context]: off the CPU, ``compute_ntk`` runs inside ``torch.device(device)``, so every tensor the
engine creates without naming a device (block results, probes, identity bases, scratch buffers) is made on the
computing device: no allocation site names a device, and none can be missed. The mode is thread-local and costs
a Python hop per torch call, so the CPU path, where the default device is already right, does not enter it.
Module-level caches of tensors must key on the device (``structured.contraction._one``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
from collections.abc import Hashable, Sequence

import torch
from torch import nn

from ntk_service.errors import MemoryEstimateExceeded, UnknownImplementation
from ntk_service.kernels.algorithm import NtkAlgorithm
from ntk_service.kernels.allocator import retain_freed_memory
from ntk_service.kernels.blocks import run_blocks
from ntk_service.kernels.device import device_memory_budget, model_device, parse_device, tf32_policy
from ntk_service.kernels.functional import NtkProblem, check_model, select_parameters
from ntk_service.kernels.groups import GroupSpec, NtkGroupsResult, ParameterGroups, parameter_groups
from ntk_service.kernels.jacobian_contraction import JacobianContraction
from ntk_service.kernels.modes import DerivedMode, KernelMode, parse_any_mode
from ntk_service.kernels.ntk_vector_products import NtkVectorProducts
from ntk_service.kernels.planning import BlockPlan, plan_blocks
from ntk_service.kernels.problem_pool import Prepared, prepared_problem
from ntk_service.kernels.pseudo import SUMMED_OUTPUTS_PREFIX, SummedOutputs, pseudo_key, pseudo_params
from ntk_service.kernels.side_cache import SideCache
from ntk_service.kernels.structured import Structured, StructuredOptions
from ntk_service.kernels.types import NtkImplementation, NtkResult, parse_implementation

__all__ = ["DEFAULT_IMPLEMENTATION", "compute_ntk", "compute_ntk_groups", "warm_up"]

DEFAULT_IMPLEMENTATION = NtkImplementation.AUTO
"""AUTO: users get the cheapest implementation that fits without having to know the trade-offs."""

_ALGORITHMS: dict[NtkImplementation, NtkAlgorithm] = {
    NtkImplementation.JACOBIAN_CONTRACTION: JacobianContraction(),
    NtkImplementation.NTK_VECTOR_PRODUCTS: NtkVectorProducts(),
    NtkImplementation.STRUCTURED: Structured(),
}
"""The dispatch table: one NtkAlgorithm per concrete implementation."""

_GROUP_ALGORITHMS = {impl: alg for impl, alg in _ALGORITHMS.items() if hasattr(alg, "pair_groups")}
"""The implementations that form per-parameter terms and so serve ``compute_ntk_groups`` (NOTE [group kernels])."""


def _algorithms(structured: StructuredOptions | None, groups: int) -> dict[NtkImplementation, NtkAlgorithm]:
    """The dispatch table of a call: ``_ALGORITHMS`` (or ``_GROUP_ALGORITHMS``), structured with the caller's
    options when given."""
    table = _ALGORITHMS if not groups else _GROUP_ALGORITHMS
    if structured is None or structured == StructuredOptions():
        return table
    return {**table, NtkImplementation.STRUCTURED: Structured(structured)}


_EFFICIENCY: dict[NtkImplementation, float] = {
    NtkImplementation.JACOBIAN_CONTRACTION: 1.0,
    NtkImplementation.NTK_VECTOR_PRODUCTS: 3.0,
}
"""Relative cost of one estimated FLOP per implementation without a ``cost_weight``; see NOTE [auto choice]."""


def _weight(impl: NtkImplementation, alg: NtkAlgorithm, problem: NtkProblem) -> float:
    """The cost of one estimated FLOP of ``alg`` on ``problem`` (NOTE [auto choice]): on the CPU its ``cost_weight``
    if it has one, else ``_EFFICIENCY``; elsewhere the device kind's table (both measured on this CPU only)."""
    kind = model_device(problem.module).type
    if kind != "cpu":
        return _EFFICIENCY_BY_DEVICE.get(kind, {}).get(impl, 1.0)
    cost_weight = getattr(alg, "cost_weight", None)
    return float(cost_weight(problem)) if cost_weight is not None else _EFFICIENCY.get(impl, 1.0)


_EFFICIENCY_BY_DEVICE: dict[str, dict[NtkImplementation, float]] = {
    "cpu": _EFFICIENCY,
    # Not measured: no GPU has run this engine yet (docs/gpu.md), so every estimated FLOP weighs 1 on CUDA.
    # benchmarks/bench_gpu.py prints the ratios to set these from when a GPU is available.
    "cuda": {},
}
"""AUTO's weights per device kind (``torch.device.type``); a missing implementation weighs 1."""


_CHOICES_PER_PROBLEM = 64
"""Call shapes whose choice a kept problem remembers (a server sees few; all are forgotten past this many)."""


def _choose(
    implementation: NtkImplementation,
    problem_args: tuple,  # type: ignore[type-arg]
    budget: int,
    groups: int = 0,
    structured: StructuredOptions | None = None,
) -> tuple[NtkAlgorithm, BlockPlan]:
    """The implementation and block plan for a call; reused from ``problem.choices`` when still the answer
    (NOTE [auto choice]). ``groups``: the number of group kernels (``compute_ntk_groups``), 0 for one kernel;
    ``structured``: the structured engine's options (None: the defaults)."""
    problem, n, m, mode, symmetric = problem_args
    key = (implementation, n, m, mode, symmetric, groups, structured)
    kept = problem.choices.get(key)
    if kept is not None:
        alg, plan, planned_for, any_larger = kept
        if plan.estimate_bytes <= budget and (budget <= planned_for or any_larger):
            return alg, plan
    alg, plan, any_larger = _plan_choice(implementation, problem_args, budget, groups, structured)
    if len(problem.choices) >= _CHOICES_PER_PROBLEM:
        problem.choices.clear()
    problem.choices[key] = (alg, plan, budget, any_larger)
    return alg, plan


def _plan_choice(
    implementation: NtkImplementation,
    problem_args: tuple,  # type: ignore[type-arg]
    budget: int,
    groups: int = 0,
    structured: StructuredOptions | None = None,
) -> tuple[NtkAlgorithm, BlockPlan, bool]:
    """The choice and whether any larger budget would make it too."""
    problem, n, m, mode, symmetric = problem_args
    candidates = _algorithms(structured, groups)
    kernels = max(groups, 1)
    if implementation is not NtkImplementation.AUTO:
        if implementation not in _ALGORITHMS:
            raise UnknownImplementation(
                f"compute_ntk: implementation {implementation.value!r} is not available in this build; "
                f"use one of {[i.value for i in _ALGORITHMS]} or 'auto'"
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
    costs = {impl: alg.flops(problem, n, m, mode) * _weight(impl, alg, problem) for impl, alg in candidates.items()}
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


def compute_ntk(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None = None,
    *,
    mode: KernelMode | DerivedMode | str = KernelMode.FULL,
    implementation: NtkImplementation | str = DEFAULT_IMPLEMENTATION,
    params: Sequence[str] | None = None,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
    side_cache: SideCache | None = None,
    x1_key: Hashable | None = None,
    x2_key: Hashable | None = None,
    device: torch.device | str | None = None,
    allow_tf32: bool = False,
    structured_options: StructuredOptions | None = None,
) -> NtkResult:
    """Empirical NTK Θ(x1, x2) = J(x1) J(x2)ᵀ of ``model``, J = ∂f(x)/∂θ per example, shape (k, P).

    Args:
        model (nn.Module): maps a batch (N, *input) to (N, *out); k = prod(out). Run in eval semantics
            (dropout off) and never mutated; BatchNorm in train mode is refused.
        x1 (Tensor): (N, *input), float or integer (token ids).
        x2 (Tensor, optional): (M, *input). Default: None, meaning x2 = x1: the x1 side is computed once and
            the result is exactly symmetric.
        mode (KernelMode or str): "full" (N, M, k, k), "trace" (N, M) (the plain sum over outputs;
            neural-tangents divides by k), "example_diagonal" (N, k, k), "output_diagonal" (N, M, k),
            "pseudo" (N, M): the pseudo-NTK (1/k) Σ_ab Θ_ab from one gradient per example (``pseudo.py``).
            Default: "full".
        implementation (NtkImplementation or str): "auto", "jacobian_contraction", "ntk_vector_products",
            "structured". Default: "auto" (cheapest by the cost model; ``result.implementation`` says which).
        params (list of str, optional): glob patterns over parameter names, e.g. ``["head.*"]``: the kernel
            of that subset only. Tied weights count once. Default: None (all parameters).
        dtype (torch.dtype or str, optional): float32 or float64. Default: the model's dtype.
        memory_budget_bytes (int, optional): the engine chunks to fit this peak. Default: half the memory
            available now on the computing device (``device.device_memory_budget``).
        side_cache (SideCache, optional): reuse per-side intermediates across calls, for sides with a key.
        x1_key, x2_key (hashable, optional): keys naming the model version and the content of x1 / x2.
        device (torch.device or str, optional): "cpu", "cuda" or "cuda:N". The inputs are moved there; a model
            elsewhere is copied there for this call (place it once with ``model.to(device)`` to avoid the copy)
            and the plan fits that device's memory (NOTE [device budgets] in device.py). Default: the model's device.
        allow_tf32 (bool): let float32 matmuls and convolutions on CUDA use TF32 tensor cores (NOTE [TF32]).
            Default: False.
        structured_options (StructuredOptions, optional): the structured engine's fast paths, e.g.
            ``StructuredOptions().without("chain")`` to compute without one (each is exact either way; for
            debugging and A/B timing). Default: None, every fast path on.

    Returns:
        NtkResult: ``theta`` (N, M, k, k) FULL, (N, M) TRACE, (N, k, k) EXAMPLE_DIAGONAL, (N, M, k)
        OUTPUT_DIAGONAL, (N, M) PSEUDO, on the computing device; plus the mode, the implementation that ran and the
        memory estimate.

    Raises:
        InvalidInput: bad input: UnknownMode, UnknownImplementation, ShapeMismatch, EmptyBatch, NonFiniteInput,
            NoMatchingParameters, UnsupportedModel or UnknownDevice.
        MemoryEstimateExceeded: even the smallest blocks would not fit the budget (before allocating).
    """
    kernel_mode = parse_any_mode(mode)
    impl = parse_implementation(implementation)
    dev = model_device(model) if device is None else parse_device(device)
    budget = device_memory_budget(dev) if memory_budget_bytes is None else int(memory_budget_bytes)
    if kernel_mode is DerivedMode.PSEUDO:  # the TRACE kernel (k = 1) of Σ_a f_a / √k: see pseudo.py
        check_model(model)
        if params is not None:
            select_parameters(model, params)  # bad globs are reported in the model's own names
        model, params = SummedOutputs(model), pseudo_params(params)
        x1_key, x2_key = pseudo_key(x1_key), pseudo_key(x2_key)
    engine_mode = KernelMode.TRACE if kernel_mode is DerivedMode.PSEUDO else kernel_mode
    with _on_device(dev, allow_tf32), prepared_problem(model, x1, x2, params=params, dtype=dtype, device=dev) as p:
        result = _compute(p, engine_mode, impl, budget, side_cache, x1_key, x2_key, structured=structured_options)
    return result if engine_mode is kernel_mode else dataclasses.replace(result, mode=kernel_mode)


def compute_ntk_groups(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None = None,
    *,
    groups: GroupSpec,
    rest: bool = False,
    mode: KernelMode | DerivedMode | str = KernelMode.FULL,
    implementation: NtkImplementation | str = DEFAULT_IMPLEMENTATION,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
    side_cache: SideCache | None = None,
    x1_key: Hashable | None = None,
    x2_key: Hashable | None = None,
    device: torch.device | str | None = None,
    allow_tf32: bool = False,
    structured_options: StructuredOptions | None = None,
) -> NtkGroupsResult:
    """The NTK split by parameter group, Θ_g = Σ_{p ∈ g} J_p(x1) J_p(x2)ᵀ, every group from one pass of the engine.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> res = compute_ntk_groups(model, torch.randn(5, 3), groups="modules", mode="trace")
        >>> {name: tuple(t.shape) for name, t in res.thetas.items()}
        {'0': (5, 5), '2': (5, 5)}

    Args:
        model, x1, x2, mode, implementation, dtype, memory_budget_bytes, side_cache, x1_key, x2_key, device,
            allow_tf32, structured_options: as for ``compute_ntk``; every mode, "pseudo" included.
        groups (dict or str): ``{"name": ["glob", ...]}`` over ``named_parameters()`` names (a tied weight
            answers to each of its names), or ``"modules"``: one group per module with parameters of its own,
            named by its ``named_modules()`` name ("<root>" for the model's own). Groups must not overlap and
            every glob must match a parameter.
        rest (bool): collect the parameters no group lists as a group "rest". Default: False: they take no part,
            as parameters outside ``compute_ntk(params=...)`` do.

    Returns:
        NtkGroupsResult: ``thetas`` group name -> Θ_g in the layout of ``compute_ntk``'s theta for the mode, and
        ``stacked`` (G, *theta); Σ_g Θ_g equals ``compute_ntk`` over the grouped parameters to round-off.

    Raises:
        InvalidInput: as for ``compute_ntk``; NoMatchingParameters for a glob that matches nothing or an empty
            group, OverlappingGroups for a parameter in two groups, UnknownImplementation for
            "ntk_vector_products" (NOTE [group kernels] in groups.py).
        MemoryEstimateExceeded: the G results and block buffers would not fit the budget (before allocating).
    """
    kernel_mode = parse_any_mode(mode, operation="compute_ntk_groups")
    impl = parse_implementation(implementation)
    check_model(model)
    resolved = engine_groups = parameter_groups(model, groups, rest=rest)
    dev = model_device(model) if device is None else parse_device(device)
    budget = device_memory_budget(dev) if memory_budget_bytes is None else int(memory_budget_bytes)
    if kernel_mode is DerivedMode.PSEUDO:  # the TRACE kernel of Σ_a f_a / √k, whose parameters gain a prefix
        model, engine_groups = SummedOutputs(model), resolved.prefixed(SUMMED_OUTPUTS_PREFIX)
        x1_key, x2_key = pseudo_key(x1_key), pseudo_key(x2_key)
    engine_mode = KernelMode.TRACE if kernel_mode is DerivedMode.PSEUDO else kernel_mode
    params = [glob.escape(name) for name in engine_groups.selected()]  # exact names, as globs
    with _on_device(dev, allow_tf32), prepared_problem(model, x1, x2, params=params, dtype=dtype, device=dev) as p:
        result = _compute(p, engine_mode, impl, budget, side_cache, x1_key, x2_key, engine_groups, structured_options)
    stacked = result.theta
    return NtkGroupsResult(
        thetas={name: stacked[g] for g, name in enumerate(resolved.names)},
        stacked=stacked,
        parameters=dict(zip(resolved.names, resolved.members, strict=True)),
        mode=kernel_mode,
        implementation=result.implementation,
        estimate_bytes=result.estimate_bytes,
        block_size=result.block_size,
    )


def _on_device(device: torch.device, allow_tf32: bool) -> contextlib.AbstractContextManager[object]:
    """Off the CPU: tensors the engine creates land on ``device``, under the TF32 policy (NOTE [device context])."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device(device))
    stack.enter_context(tf32_policy(allow_tf32))
    return stack


def _compute(
    prepared: Prepared,
    mode: KernelMode,
    impl: NtkImplementation,
    budget: int,
    side_cache: SideCache | None,
    x1_key: Hashable | None,
    x2_key: Hashable | None,
    groups: ParameterGroups | None = None,
    structured: StructuredOptions | None = None,
) -> NtkResult:
    """The kernel of a prepared call; with ``groups`` its theta is the stack (G, *theta) of the group kernels."""
    problem, x1t, x2t = prepared.problem, prepared.x1, prepared.x2
    n = x1t.shape[0]
    symmetric = x2t is None or mode is KernelMode.EXAMPLE_DIAGONAL
    m = n if x2t is None else x2t.shape[0]
    alg, plan = _choose(
        impl, (problem, n, m, mode, symmetric), budget, 0 if groups is None else len(groups), structured
    )
    theta = run_blocks(
        alg,
        problem,
        x1t,
        None if symmetric else x2t,
        mode,
        plan,
        side_cache=side_cache,
        x1_key=x1_key,
        x2_key=x2_key,
        groups=groups,
    )
    return NtkResult(
        theta=theta,
        mode=mode,
        implementation=alg.implementation,
        estimate_bytes=plan.estimate_bytes,
        block_size=plan.block_n,
    )


def warm_up(device: torch.device | str | None = None) -> None:
    """Prepare a long-running process for kernels on ``device`` (Default: the CPU): on the CPU keep freed memory
    (``retain_freed_memory``, NOTE [allocator]); everywhere load the engine's lazy machinery (torch.func
    transforms, the FLOP counter, the device's math libraries) with a tiny kernel.

    The first ``compute_ntk`` in a process pays a one-time import of about 1.3 s on an idle 2-core CPU (several
    seconds under load); a server calls this before it reports ready, so no request pays it.
    """
    dev = parse_device(device, operation="warm_up")
    if dev.type == "cpu":
        retain_freed_memory()  # a host malloc tweak: CPU kernels only
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    x = torch.zeros(2, 2)
    for implementation in _ALGORITHMS:
        compute_ntk(model, x, implementation=implementation, device=dev)
