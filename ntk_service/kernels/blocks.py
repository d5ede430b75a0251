"""The block runner: walks theta block by block for any NtkAlgorithm, reusing sides and exploiting symmetry.

When x2 is x1 only blocks on and above the diagonal are contracted; each is mirrored below it, and diagonal
blocks are symmetrized as (B + Bᵀ)/2, so the result is exactly symmetric (IEEE addition commutes). When x1 and x2
are one block each and the plan allows it (``BlockPlan.joint_sides``), both sides come from one pass over x1 and
x2 together, unless a side cache is in play for a keyed side: a cached side must not depend on which other examples
shared its pass (its bits would then depend on hits and misses). A cache that holds nothing (``max_bytes`` 0) or
sides without keys leave the joint pass alone.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ntk_service.kernels.algorithm import NtkAlgorithm, Side
from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.modes import KernelMode, result_shape
from ntk_service.kernels.planning import BlockPlan
from ntk_service.kernels.problem.batch import Batch, batch_size, take
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime.side_cache import SideCache

__all__ = ["run_blocks"]


def _swap_examples(block: torch.Tensor, mode: KernelMode, lead: int = 0) -> torch.Tensor:
    """The block of Θ(x2, x1) from one of Θ(x1, x2): swap the example axes (and the output axes for FULL), after
    ``lead`` leading axes (1 for a stack of group blocks)."""
    first = tuple(range(lead))
    if mode is KernelMode.FULL:
        return block.permute(*first, *(lead + i for i in (1, 0, 3, 2)))
    if mode is KernelMode.TRACE:
        return block.transpose(lead, lead + 1)
    return block.permute(*first, *(lead + i for i in (1, 0, 2)))


def _symmetrize_into(out: torch.Tensor, block: torch.Tensor, mode: KernelMode, lead: int) -> None:
    """out = (block + its example-swapped self) / 2, written in place (no temporary block, no copy), one group at
    a time: exactly symmetric (a + b = b + a), and each group's strided read of its swapped self stays within one
    block (a stack of G blocks swapped at once strides across all of them)."""
    pairs = zip(block.unbind(0), out.unbind(0), strict=True) if lead else [(block, out)]
    for b, o in pairs:
        torch.add(b, _swap_examples(b, mode), out=o).div_(2)


class _Sides:
    """Computes sides once per plan (and once per SideCache key across calls)."""

    def __init__(
        self,
        alg: NtkAlgorithm,
        problem: NtkProblem,
        cache: SideCache | None,
        cache_tag: Hashable,
    ) -> None:
        self.alg, self.problem, self.cache, self.cache_tag = alg, problem, cache, cache_tag
        self.kept: dict[tuple[bool, int, int, int], Side] = {}

    def get(self, x: Batch, start: int, stop: int, *, left: bool, key: Hashable | None, keep: bool) -> Side:
        role = left or self.alg.right_is_left  # right sides equal to left sides share entries
        local = (role, start, stop, id(x))  # ...of the same tensor only: x2's blocks are not x1's
        if local in self.kept:
            return self.kept[local]
        cache_key = None if key is None or self.cache is None else (key, self.cache_tag, role, start, stop)
        side = None if cache_key is None or self.cache is None else self.cache.get(cache_key)
        if side is None:
            block = take(x, start, stop)
            side = self.alg.left(self.problem, block) if left else self.alg.right(self.problem, block)
            if cache_key is not None and self.cache is not None:
                self.cache.put(cache_key, side)
        if keep:
            self.kept[local] = side
        return side


def run_blocks(
    alg: NtkAlgorithm,
    problem: NtkProblem,
    x1: Batch,
    x2: Batch | None,
    mode: KernelMode,
    plan: BlockPlan,
    *,
    side_cache: SideCache | None = None,
    x1_key: Hashable | None = None,
    x2_key: Hashable | None = None,
    groups: ParameterGroups | None = None,
) -> torch.Tensor:
    """Compute theta for ``mode`` block by block.

    Args:
        alg: the implementation.
        problem: the prepared model.
        x1: (N, *input). x2: (M, *input), or None for x2 = x1.
        mode: the kernel mode.
        plan: block sizes from ``plan_blocks``.
        side_cache: optional LRU of sides across calls; used for a side only when its key is given.
        x1_key, x2_key: content keys of x1 and x2 for ``side_cache``.
        groups: a partition of the problem's parameters: one kernel per group from the same sides, through the
            algorithm's ``pair_groups`` / ``diagonal_groups``.

    Returns:
        theta: (N, M, k, k) FULL, (N, M) TRACE, (N, k, k) EXAMPLE_DIAGONAL, (N, M, k) OUTPUT_DIAGONAL; with
        ``groups`` (G, *that), one per group.
    """
    n = batch_size(x1)
    symmetric = x2 is None
    xr = x1 if x2 is None else x2
    m = batch_size(xr)
    right_key = x1_key if symmetric else x2_key
    tag = (alg.implementation.value, tuple(problem.params), str(problem.dtype))
    sides = _Sides(alg, problem, side_cache, tag)
    lead = 0 if groups is None else 1
    head = (slice(None),) * lead  # the group axis of theta, when there is one
    stack = () if groups is None else (len(groups),)
    theta = torch.empty((*stack, *result_shape(mode, n, m, problem.k)), dtype=problem.dtype)

    def pair(left: Side, right: Side) -> torch.Tensor:
        if groups is None:
            return alg.pair(problem, left, right, mode)
        return alg.pair_groups(problem, left, right, mode, groups)  # type: ignore[attr-defined,no-any-return]

    def diagonal(left: Side) -> torch.Tensor:
        if groups is None:
            return alg.diagonal(problem, left)
        return alg.diagonal_groups(problem, left, groups)  # type: ignore[attr-defined,no-any-return]

    bn, bm = plan.block_n, plan.block_m
    if side_cache is not None and side_cache.max_bytes <= 0:
        side_cache = None  # a disabled cache: never consulted, never in the way of the joint pass
    cached = side_cache is not None and (x1_key is not None or x2_key is not None)
    if plan.joint_sides and x2 is not None and not cached:  # cached sides must not be views of a joint one
        with torch.no_grad():
            left, right = alg.joint_sides(problem, x1, x2)  # type: ignore[attr-defined]
            return pair(left, right).contiguous()
    with torch.no_grad():
        for i0 in range(0, n, bn):
            i1 = min(i0 + bn, n)
            keep_left = symmetric and alg.right_is_left and plan.keep_right_sides  # it is a later row's right side
            left = sides.get(x1, i0, i1, left=True, key=x1_key, keep=keep_left)
            if mode is KernelMode.EXAMPLE_DIAGONAL:
                theta[(*head, slice(i0, i1))] = diagonal(left)
                continue
            for j0 in range(i0 if symmetric else 0, m, bm):
                j1 = min(j0 + bm, m)
                if symmetric and j0 == i0 and alg.right_is_left:
                    right = left
                else:
                    right = sides.get(xr, j0, j1, left=False, key=right_key, keep=plan.keep_right_sides)
                block = pair(left, right)
                if symmetric and j0 == i0:
                    _symmetrize_into(theta[(*head, slice(i0, i1), slice(j0, j1))], block, mode, lead)
                else:
                    theta[(*head, slice(i0, i1), slice(j0, j1))] = block
                if symmetric and j0 != i0:
                    theta[(*head, slice(j0, j1), slice(i0, i1))] = _swap_examples(block, mode, lead)
                # a side not kept is freed before the next one is built: peak = one left + one right side
                del right, block
            del left
    return theta
