"""The block runner: walks theta block by block for any NtkAlgorithm, reusing sides and exploiting symmetry.

When x2 is x1 only blocks on and above the diagonal are contracted; each is mirrored below it, and diagonal
blocks are symmetrized as (B + Bᵀ)/2, so the result is exactly symmetric (IEEE addition commutes); the mirror is
the mode's ``example_swap`` (its row of ``vocabulary.MODES``). A per-example mode is the implementation's
per-example blocks, reduced to the mode's outputs when it keeps fewer (NOTE [mode contractions] in modes.py).
When x1 and x2 are one block each and the plan allows it (``BlockPlan.joint_sides``), both sides come from one
pass over x1 and x2 together (the algorithm's ``joint_pass``), unless a side cache is in play for a keyed side: a
cached side must not depend on which other examples shared its pass (its bits would then depend on hits and
misses). A cache that holds nothing (``max_bytes`` 0) or sides without keys leave the joint pass alone.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ntk_service.errors import UnknownImplementation
from ntk_service.kernels.algorithm import GroupKernels, NtkAlgorithm, Side
from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.modes import KernelMode, Outputs, contraction, result_shape
from ntk_service.kernels.planning import BlockPlan
from ntk_service.kernels.problem.batch import Batch, batch_size, take
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime.side_cache import SideCache

__all__ = ["reduce_outputs", "run_blocks"]


def _swap_examples(block: torch.Tensor, mode: KernelMode, lead: int = 0) -> torch.Tensor:
    """The block of Θ(x2, x1) from one of Θ(x1, x2): the mode's ``example_swap`` (the example axes, and the output
    axes for all outputs), after ``lead`` leading axes (1 for a stack of group blocks)."""
    return block.permute(*range(lead), *(lead + i for i in mode.spec.example_swap))


def reduce_outputs(blocks: torch.Tensor, outputs: Outputs) -> torch.Tensor:
    """Per-example blocks (..., k, k) reduced to ``outputs``: unchanged for all of them, (..., k) their diagonal,
    (...) its sum (NOTE [mode contractions] in modes.py)."""
    if outputs is Outputs.ALL:
        return blocks
    diagonal = blocks.diagonal(dim1=-2, dim2=-1)
    return diagonal if outputs is Outputs.DIAGONAL else diagonal.sum(-1)


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
        mode: the kernel mode; the algorithm contracts its ``contraction`` (NOTE [mode contractions]).
        plan: block sizes from ``plan_blocks``.
        side_cache: optional LRU of sides across calls; used for a side only when its key is given.
        x1_key, x2_key: content keys of x1 and x2 for ``side_cache``.
        groups: a partition of the problem's parameters: one kernel per group from the same sides, through the
            algorithm's ``group_kernels``.

    Returns:
        theta: the mode's shape (``ModeSpec.shape``, e.g. (N, M, k, k) FULL, (N,) EXAMPLE_TRACE); with
        ``groups`` (G, *that), one per group.

    Raises:
        UnknownImplementation: ``groups`` for an algorithm without ``group_kernels``.
    """
    spec, core = mode.spec, contraction(mode)
    if not spec.pairs:
        x2 = None  # a per-example mode uses x1 alone
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

    by_group = None if groups is None else (_group_kernels(alg), groups)

    def pair(left: Side, right: Side) -> torch.Tensor:
        if by_group is None:
            return alg.pair(problem, left, right, core)
        kernels, parts = by_group
        return kernels.pair_groups(problem, left, right, core, parts)

    def diagonal(left: Side) -> torch.Tensor:
        if by_group is None:
            return reduce_outputs(alg.diagonal(problem, left), spec.outputs)
        kernels, parts = by_group
        return reduce_outputs(kernels.diagonal_groups(problem, left, parts), spec.outputs)

    bn, bm = plan.block_n, plan.block_m
    if side_cache is not None and side_cache.max_bytes <= 0:
        side_cache = None  # a disabled cache: never consulted, never in the way of the joint pass
    cached = side_cache is not None and (x1_key is not None or x2_key is not None)
    joint_pass = alg.joint_pass
    # cached sides must not be views of a joint one
    if plan.joint_sides and joint_pass is not None and x2 is not None and not cached:
        with torch.no_grad():
            left, right = joint_pass.joint_sides(problem, x1, x2)
            return pair(left, right).contiguous()
    with torch.no_grad():
        for i0 in range(0, n, bn):
            i1 = min(i0 + bn, n)
            keep_left = symmetric and alg.right_is_left and plan.keep_right_sides  # it is a later row's right side
            left = sides.get(x1, i0, i1, left=True, key=x1_key, keep=keep_left)
            if not spec.pairs:
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


def _group_kernels(alg: NtkAlgorithm) -> GroupKernels:
    """The per-group contraction of ``alg``; raises UnknownImplementation where it has none (the caller's choice
    keeps to ``choice.GROUP_ALGORITHMS``, so this names a bug of a caller that does not)."""
    if alg.group_kernels is None:
        raise UnknownImplementation(
            f"run_blocks: implementation {alg.implementation.value!r} forms no per-parameter terms, so it cannot "
            "compute kernels per parameter group; use one of choice.GROUP_ALGORITHMS"
        )
    return alg.group_kernels
