"""planning.plan_blocks: the modes it plans (NOTE [mode contractions]) and the one it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntk_service.kernels.jacobian_contraction import JacobianContraction
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.ntk_vector_products import NtkVectorProducts
from ntk_service.kernels.planning import plan_blocks
from ntk_service.kernels.runtime import problem_pool


@pytest.fixture(scope="module")
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def test_a_derived_mode_is_refused_as_the_callers_mistake(mlp: nn.Module) -> None:
    """A derived mode is the base kernel of a derived model: planning it on the model itself would be wrong."""
    x = torch.randn(4, 3, dtype=torch.float64)
    with problem_pool.prepared_problem(mlp, x, None, params=None, dtype=None) as prepared:
        with pytest.raises(ValueError, match="mode 'pseudo' is derived; plan its base mode 'trace'"):
            plan_blocks(JacobianContraction(), prepared.problem, 4, 4, DerivedMode.PSEUDO, symmetric=True,  # type: ignore[arg-type]
                        budget_bytes=2**30)  # fmt: skip


def test_the_joint_pass_is_planned_only_for_an_algorithm_that_declares_it(mlp: nn.Module) -> None:
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    with problem_pool.prepared_problem(mlp, x1, x2, params=None, dtype=None) as prepared:
        problem = prepared.problem
        jacobians = plan_blocks(
            JacobianContraction(), problem, 4, 5, KernelMode.FULL, symmetric=False, budget_bytes=2**30
        )
        products = plan_blocks(NtkVectorProducts(), problem, 4, 5, KernelMode.FULL, symmetric=False, budget_bytes=2**30)
        diagonal = plan_blocks(
            JacobianContraction(), problem, 4, 5, KernelMode.EXAMPLE_DIAGONAL, symmetric=False, budget_bytes=2**30
        )
    assert jacobians.joint_sides  # a tiny side: under the mmap threshold, one pass pays
    assert NtkVectorProducts().joint_pass is None and not products.joint_sides
    assert not diagonal.joint_sides and diagonal.block_m == diagonal.block_n  # a per-example mode uses no x2
