"""The interface every NTK implementation provides, so one block runner and one planner serve them all.

An implementation turns a block of examples into a *side* (whatever it needs from those examples: Jacobians,
VJP rows, layer activations and cotangents, or just the inputs), then contracts a left side of x1 with a right
side of x2 into one block of theta. The block runner (``blocks.py``) walks the blocks, reuses sides, exploits
symmetry; the planner (``planning.py``) sizes the blocks from the memory and cost estimates below.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.problem.batch import Batch
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.types import NtkImplementation

__all__ = ["NtkAlgorithm", "Side", "side_nbytes"]

Side = Any
"""What an implementation keeps from a block of examples; any nesting of tuples, dicts and tensors."""


def side_nbytes(side: Side) -> int:
    """Bytes held by the tensors in a side (walks tuples, lists and dicts)."""
    if isinstance(side, torch.Tensor):
        return side.numel() * side.element_size()
    if isinstance(side, dict):
        return sum(side_nbytes(v) for v in side.values())
    if isinstance(side, (tuple, list)):
        return sum(side_nbytes(v) for v in side)
    return 0


class NtkAlgorithm(Protocol):
    """One NTK implementation. All sizes are in bytes, all costs in FLOPs (see ``planning.py``)."""

    implementation: NtkImplementation

    right_is_left: bool
    """True when the right side of a block equals its left side (so x2 = x1 reuses it)."""

    def left(self, problem: NtkProblem, x: Batch) -> Side:
        """The x1-side of a block x (n, *input)."""
        ...

    def right(self, problem: NtkProblem, x: Batch) -> Side:
        """The x2-side of a block x (m, *input)."""
        ...

    def pair(self, problem: NtkProblem, left: Side, right: Side, mode: KernelMode) -> torch.Tensor:
        """One block of theta: (n, m, k, k) FULL, (n, m) TRACE, (n, m, k) OUTPUT_DIAGONAL."""
        ...

    def diagonal(self, problem: NtkProblem, left: Side) -> torch.Tensor:
        """EXAMPLE_DIAGONAL of a block: (n, k, k)."""
        ...

    def side_bytes(self, problem: NtkProblem, n: int, *, left: bool) -> tuple[float, float]:
        """(peak while building, kept afterwards) bytes of a side of n examples."""
        ...

    def pair_bytes(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        """Transient bytes of contracting an n-block with an m-block (the block result included)."""
        ...

    def flops(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        """Estimated FLOPs of the whole (N = n, M = m) kernel, for AUTO's choice."""
        ...

    # Optional: ``joint_sides(problem, x1, x2) -> (side of x1, side of x2)``, both built by one ``left`` pass over
    # x1 and x2 together (views of that side). An algorithm with it (and ``right_is_left``) gets both sides of a
    # one-block kernel from one pass (``BlockPlan.joint_sides``). With it, optionally
    # ``joint_pays(problem, n, m) -> bool``: False where two passes are cheaper (default: always True).
    # Optional: ``cost_weight(problem) -> float``, AUTO's cost of one estimated FLOP (default: api._EFFICIENCY).
    # Optional: ``pair_groups(problem, left, right, mode, groups) -> (G, *block)`` and ``diagonal_groups(problem,
    # left, groups) -> (G, n, k, k)``: the block per parameter group (``groups.ParameterGroups``), each term added
    # into its group's accumulator. Only algorithms with them serve ``compute_ntk_groups``.
