"""NOTE [streamed right side] (planning.py): with x1 in one block, x2's side is built, contracted and freed in two."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch import nn

from ntk_service.kernels.blocks import run_blocks
from ntk_service.kernels.jacobian_contraction import JacobianChunks, JacobianContraction
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.planning import plan_blocks
from ntk_service.kernels.problem.batch import Batch
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime import problem_pool
from tests.reference import assert_matches, reference_ntk


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()


class _FreedBeforeNext(JacobianContraction):
    """The Jacobian contraction, checking that every right side built before is gone when the next is built."""

    def __init__(self) -> None:
        self.built: list[weakref.ref[torch.Tensor]] = []

    def joint_pays(self, problem: NtkProblem, n: int, m: int) -> bool:
        return False  # separate sides, as for any side past the mmap threshold (a tiny model's would be joint)

    def right(self, problem: NtkProblem, x: Batch) -> JacobianChunks:  # type: ignore[override]
        alive = sum(ref() is not None for ref in self.built)
        assert alive == 0, f"{alive} earlier right side(s) still held while the next is built"
        side = super().right(problem, x)
        self.built.append(weakref.ref(next(iter(side[0].values()))))
        return side


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_a_large_right_side_is_streamed_in_halves_and_matches_the_reference(mode: str) -> None:
    model = _mlp()
    x1, x2 = torch.randn(6, 3, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    alg = _FreedBeforeNext()
    with problem_pool.prepared_problem(model, x1, x2, params=None, dtype=None) as prepared:
        problem = prepared.problem
        side = alg.side_bytes(problem, 10, left=False)[1]  # the Jacobians of x2's 10 examples
        whole = plan_blocks(alg, problem, 6, 10, KernelMode(mode), symmetric=False, budget_bytes=2**30)
        streamed = plan_blocks(
            alg, problem, 6, 10, KernelMode(mode), symmetric=False, budget_bytes=2**30, streamed_side_bytes=side // 3
        )
        theta = run_blocks(alg, problem, x1, x2, KernelMode(mode), streamed)
    assert (whole.block_n, whole.block_m) == (6, 10)
    assert (streamed.block_n, streamed.block_m, streamed.keep_right_sides) == (6, 5, False)  # two halves
    assert streamed.estimate_bytes < whole.estimate_bytes  # one part's side is held instead of the whole side
    assert len(alg.built) == math.ceil(10 / streamed.block_m)
    assert_matches(theta, reference_ntk(model, x1, x2, mode))


def test_symmetric_kernels_are_not_streamed() -> None:
    model, x = _mlp(), torch.randn(8, 3, dtype=torch.float64)
    alg = JacobianContraction()
    with problem_pool.prepared_problem(model, x, None, params=None, dtype=None) as prepared:
        plan = plan_blocks(
            alg, prepared.problem, 8, 8, KernelMode.FULL, symmetric=True, budget_bytes=2**30, streamed_side_bytes=1
        )
    assert (plan.block_n, plan.block_m) == (8, 8)  # x2 = x1: its one side is the left side, kept anyway


def test_sides_of_a_blocked_plan_are_freed_before_the_next_is_built() -> None:
    model = _mlp()
    x1, x2 = torch.randn(7, 3, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    alg = _FreedBeforeNext()
    with problem_pool.prepared_problem(model, x1, x2, params=None, dtype=None) as prepared:
        problem = prepared.problem
        one_example = alg.side_bytes(problem, 1, left=True)[0]
        plan = plan_blocks(alg, problem, 7, 9, KernelMode.FULL, symmetric=False, budget_bytes=int(one_example * 12))
        theta = run_blocks(alg, problem, x1, x2, KernelMode.FULL, plan)
    assert plan.block_n < 7 and not plan.keep_right_sides  # several row blocks, right sides recomputed per row
    assert len(alg.built) > 2
    assert_matches(theta, reference_ntk(model, x1, x2, "full"))
