"""Cost and memory model: picks the implementation (AUTO) and the block sizes that fit a memory budget.

Memory: a plan with blocks of n x1-examples and m x2-examples holds the result, one left side being built or
kept, the right sides (all of them when they fit, so none is computed twice; else one at a time), and one
block contraction. Each implementation reports those sizes (``NtkAlgorithm.side_bytes``/``pair_bytes``); the
planner takes the largest blocks that fit. Nothing is allocated before the plan fits.

Cost: each implementation estimates the FLOPs of the whole kernel from P, k, N, M and the counted forward
FLOPs [FP] of one example (``FlopCounterMode``, deterministic, no timing noise); AUTO takes the cheapest one whose
plan fits. See NOTE [auto choice] in api.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ntk_service.errors import MemoryEstimateExceeded, format_bytes
from ntk_service.kernels._moved import moved
from ntk_service.kernels.algorithm import NtkAlgorithm
from ntk_service.kernels.modes import KernelMode, contraction, result_shape
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.vocabulary import MODES

__all__ = ["STREAMED_SIDE_BYTES", "BlockPlan", "plan_blocks"]

STREAMED_SIDE_BYTES = 768 * 2**20
"""Largest right side (what it keeps: the Jacobians, for the Jacobian contraction) built whole when x1 is one block.

NOTE [streamed right side]: with x1 in one block, x1's side is kept and x2's is used once, so x2's can be built,
contracted and freed in parts: the peak holds one part instead of the whole side, for one more side call per part.
On the benchmark transformer (N = M = 64, FULL; J = 1062 MiB a side) the peak fell from 2914 MiB in one part (the
torch.func tutorial's 2875–2944 MiB, the same work) to 2153 MiB in two, fresh processes. A side past this bound is
built in two halves, never more parts: a ``vmap(jacrev)`` call's efficiency falls with its batch and on odd sizes
(transformer N = M = 128 TRACE, idle, one process: 2 parts of 64 cost 2.5 % more than one call, 4 of 32 15 %,
3 of 43 36 %). Larger sides are cut by the memory budget's blocks instead."""


def _cheaper_modes(mode: KernelMode, n: int, m: int, k: int) -> str:
    """What a memory refusal suggests instead of ``mode``: the modes of example pairs whose result is smaller
    (read off the mode table, so a new mode is suggested where it fits), e.g. "mode trace or output_diagonal"."""
    size = math.prod(result_shape(mode, n, m, k))
    smaller = [spec.name for spec in MODES.values() if not spec.derived and spec.pairs
               and math.prod(spec.result_shape(n, m, k)) < size]  # fmt: skip
    return f"mode {' or '.join(smaller)}" if smaller else ""


@dataclass(frozen=True)
class BlockPlan:
    """How to walk the kernel: blocks of ``block_n`` x1-examples by ``block_m`` x2-examples.

    Attributes:
        block_n: examples of x1 per block.
        block_m: examples of x2 per block (equal to block_n when x2 is x1).
        keep_right_sides: keep every right side after first use (computed once each).
        estimate_bytes: estimated peak memory, result included.
        joint_sides: one block each of x1 and x2 (x2 given), and the algorithm builds both sides in one pass
            over x1 and x2 together (its ``joint_pass``, algorithm.py): one forward and reverse pass instead of two.
        first_choice: the planner's first candidate, which any larger budget picks too.
    """

    block_n: int
    block_m: int
    keep_right_sides: bool
    estimate_bytes: int
    joint_sides: bool = False
    first_choice: bool = False


def _block_sizes(n: int, m: int) -> list[int]:
    """Candidate block sizes, largest first: the whole batch, then powers of two down to 1."""
    largest = max(n, m)
    sizes = [largest] + [2**e for e in range(int(math.log2(largest)), -1, -1) if 2**e < largest]
    return sizes


def _estimate(
    alg: NtkAlgorithm,
    problem: NtkProblem,
    n: int,
    m: int,
    bn: int,
    bm: int,
    mode: KernelMode,
    keep: bool,
    groups: int = 1,
) -> float:
    """Peak bytes of a plan; with ``groups`` kernels from the same sides, the result and every block
    contraction's buffers are held once per group (the sides once)."""
    core = contraction(mode)
    result = math.prod(result_shape(mode, n, m, problem.k)) * problem.itemsize * groups
    left_peak, _ = alg.side_bytes(problem, bn, left=True)
    if not mode.spec.pairs:
        return result + left_peak + alg.pair_bytes(problem, bn, bn, core) * groups
    right_peak, right_kept = alg.side_bytes(problem, bm, left=False)
    kept_total = right_kept * math.ceil(m / bm) if keep else 0.0
    return result + left_peak + kept_total + right_peak + alg.pair_bytes(problem, bn, bm, core) * groups


def _streamed_block(alg: NtkAlgorithm, problem: NtkProblem, m: int, bound: int) -> int:
    """x2-examples per block when x1 is one block: all of them, unless their side outweighs ``bound`` bytes; then
    half of them (NOTE [streamed right side])."""
    return m if alg.side_bytes(problem, m, left=False)[1] <= bound else math.ceil(m / 2)


def plan_blocks(
    alg: NtkAlgorithm,
    problem: NtkProblem,
    n: int,
    m: int,
    mode: KernelMode,
    *,
    symmetric: bool,
    budget_bytes: int,
    groups: int = 1,
    streamed_side_bytes: int = STREAMED_SIDE_BYTES,
) -> BlockPlan:
    """The largest blocks whose estimated peak memory fits ``budget_bytes``.

    Args:
        alg: the implementation.
        problem: the prepared model.
        n, m: N and M (m = n when symmetric).
        mode: the kernel mode; the implementation is asked about its contraction (NOTE [mode contractions]).
        symmetric: x2 is x1 (square blocks, only blocks on and above the diagonal); a per-example mode uses no x2.
        budget_bytes: the memory budget.
        groups: the number of kernels computed from the same sides (``compute_ntk_groups``); 1 for one kernel.
        streamed_side_bytes: with x1 in one block, an x2 side larger than this is built in two halves (NOTE
            [streamed right side]). Default: ``STREAMED_SIDE_BYTES``.

    Returns:
        The BlockPlan.

    Raises:
        MemoryEstimateExceeded: even one example per block does not fit; carries the estimate and the budget.
        ValueError: a derived mode: the caller computes the base kernel of its derived model (``derived.py``).
    """
    if mode.spec.derived:  # a caller that did not apply the mode's output map would get the wrong kernel
        raise ValueError(
            f"plan_blocks: mode {mode.value!r} is derived; plan its base mode {mode.spec.contraction.value!r} for "
            "the derived model (derived.derived_model)"
        )
    symmetric = symmetric or not mode.spec.pairs
    joint_pass = alg.joint_pass
    joint = not symmetric and joint_pass is not None and joint_pass.joint_pays(problem, n, m)
    if joint:
        result = math.prod(result_shape(mode, n, m, problem.k)) * problem.itemsize * groups
        joint_peak, _ = alg.side_bytes(problem, n + m, left=True)
        estimate = result + joint_peak + alg.pair_bytes(problem, n, m, contraction(mode)) * groups
        if estimate <= budget_bytes:
            return BlockPlan(n, m, False, int(estimate), joint_sides=True, first_choice=True)
    smallest = math.inf
    first = not joint  # the first candidate tried
    for size in _block_sizes(n, m):
        bn = min(size, n)
        bm = bn if symmetric else min(size, m)
        single_pass = bn >= n  # every right side is used once: nothing to keep
        for keep in (False,) if single_pass else (True, False):
            if single_pass and not symmetric:
                bm = _streamed_block(alg, problem, m, streamed_side_bytes)
            estimate = _estimate(alg, problem, n, m, bn, bm, mode, keep, groups)
            smallest = min(smallest, estimate)
            if estimate <= budget_bytes:
                return BlockPlan(bn, bm, keep, int(estimate), first_choice=first)
            first = False
    result_only = math.prod(result_shape(mode, n, m, problem.k)) * problem.itemsize * groups
    per_group = f" and {groups} parameter groups" if groups > 1 else ""
    cheaper = _cheaper_modes(mode, n, m, problem.k)
    raise MemoryEstimateExceeded(
        f"compute_ntk: {alg.implementation.value} needs at least {format_bytes(smallest)} for mode "
        f"{mode.value} with N={n}, M={m}, k={problem.k}, P={problem.num_params}{per_group} (the result alone is "
        f"{format_bytes(result_only)}), over the memory budget of {format_bytes(budget_bytes)}; use "
        f"{cheaper + ', ' if cheaper else ''}fewer examples, a parameter subset, or a batch job",
        estimate_bytes=int(smallest),
        budget_bytes=int(budget_bytes),
    )


__getattr__ = moved(
    __name__,
    "ntk_service.kernels.runtime.device",  # reading the host's memory is the runtime's, not the planner's
    ("DEFAULT_MEMORY_FRACTION", "BUDGET_REFRESH_SECONDS", "default_memory_budget"),
)
