"""The interface every NTK implementation provides, so one block runner and one planner serve them all.

An implementation turns a block of examples into a *side* (whatever it needs from those examples: Jacobians,
VJP rows, layer activations and cotangents, or just the inputs), then contracts a left side of x1 with a right
side of x2 into one block of theta. The block runner (``blocks.py``) walks the blocks, reuses sides, exploits
symmetry; the planner (``planning.py``) sizes the blocks from the memory and cost estimates below.

The three implementations (``jacobian_contraction.py``, ``ntk_vector_products.py``, ``structured/``) have one
shape: the members of ``NtkAlgorithm`` in its order. Two capabilities are optional, and each is declared as data,
an attribute that is the capability or None, never found by probing for a method:

- ``joint_pass`` (``JointPass``): both sides of a one-block kernel from one pass over x1 and x2 together, where
  it pays (``BlockPlan.joint_sides``). The Jacobian contraction and structured have it; the NTK-vector products'
  right side is its inputs, so there is nothing to share.
- ``group_kernels`` (``GroupKernels``): one block per parameter group from the same sides (``compute_ntk_groups``,
  NOTE [group kernels] in groups.py). The NTK-vector products form no per-parameter terms, so they have none.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.problem.batch import Batch
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.types import NtkImplementation

__all__ = ["GroupKernels", "JointPass", "NtkAlgorithm", "Side", "side_nbytes"]

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


class JointPass(Protocol):
    """The capability of building the sides of x1 and x2 in one pass (``NtkAlgorithm.joint_pass``)."""

    def joint_sides(self, problem: NtkProblem, x1: Batch, x2: Batch) -> tuple[Side, Side]:
        """(side of x1, side of x2), both built by one ``left`` pass over x1 and x2 together (views of that side)."""
        ...

    def joint_pays(self, problem: NtkProblem, n: int, m: int) -> bool:
        """Whether one pass over n + m examples beats two passes (False where two are cheaper)."""
        ...


class GroupKernels(Protocol):
    """The capability of contracting one block per parameter group (``NtkAlgorithm.group_kernels``)."""

    def pair_groups(
        self, problem: NtkProblem, left: Side, right: Side, mode: KernelMode, groups: ParameterGroups
    ) -> torch.Tensor:
        """``pair`` per group, each term added into its group's accumulator: (G, *block)."""
        ...

    def diagonal_groups(self, problem: NtkProblem, left: Side, groups: ParameterGroups) -> torch.Tensor:
        """``diagonal`` per group: (G, n, k, k)."""
        ...


class NtkAlgorithm(Protocol):
    """One NTK implementation. All sizes are in bytes, all costs in FLOPs (see ``planning.py``). The engine asks it
    for the contractions of NOTE [mode contractions] (modes.py), each keyed to the axes of the mode it is given
    (``mode.spec.examples``, ``mode.spec.outputs``), never to which mode it is: ``pair`` for a block of example
    pairs with all outputs, their diagonal or their sum, ``diagonal`` for the per-example blocks of all outputs;
    ``pair_bytes`` and ``flops`` read the same axes (a per-example mode: its blocks of all outputs)."""

    implementation: NtkImplementation

    right_is_left: bool
    """True when the right side of a block equals its left side (so x2 = x1 reuses it)."""

    @property
    def joint_pass(self) -> JointPass | None:
        """Its joint pass over x1 and x2, or None where it has none."""
        ...

    @property
    def group_kernels(self) -> GroupKernels | None:
        """Its per-group contraction, or None: then it does not serve ``compute_ntk_groups``."""
        ...

    def left(self, problem: NtkProblem, x: Batch) -> Side:
        """The x1-side of a block x (n, *input)."""
        ...

    def right(self, problem: NtkProblem, x: Batch) -> Side:
        """The x2-side of a block x (m, *input)."""
        ...

    def pair(self, problem: NtkProblem, left: Side, right: Side, mode: KernelMode) -> torch.Tensor:
        """One block of theta for a mode of example pairs, by its outputs axis: (n, m, k, k) all outputs (FULL),
        (n, m, k) their diagonal (OUTPUT_DIAGONAL), (n, m) their sum (TRACE)."""
        ...

    def diagonal(self, problem: NtkProblem, left: Side) -> torch.Tensor:
        """The per-example blocks of all outputs Θ(x_n, x_n) (EXAMPLE_DIAGONAL): (n, k, k)."""
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

    def cost_weight(self, problem: NtkProblem) -> float:
        """AUTO's cost of one estimated FLOP on the CPU, relative to the Jacobian contraction's (NOTE [auto choice]
        in choice.py): its FLOPs run at another fraction of the machine's peak."""
        ...
