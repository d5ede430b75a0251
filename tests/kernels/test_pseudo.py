"""mode="pseudo": compute_ntk against the reference FULL kernel summed over both output axes and divided by k."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntk_service.errors import NoMatchingParameters, UnknownMode
from ntk_service.kernels import DerivedMode, NtkImplementation, SideCache, compute_ntk
from ntk_service.kernels.choice import ALGORITHMS
from tests.kernels.zoo import ZOO, ZooEntry
from tests.reference import assert_matches, reference_jacobian, reference_ntk


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_pseudo_matches_the_reference_full_kernel_summed_over_outputs(entry: ZooEntry) -> None:
    torch.manual_seed(0)
    model = entry.build()
    x1, x2 = entry.inputs(torch.Generator().manual_seed(1))
    for with_x2 in (True, False):
        for subset in (None, entry.subset):
            other = x2 if with_x2 else None
            full = reference_ntk(model, x1, other, "full", subset)
            expected = full.sum(dim=(2, 3)) / full.shape[2]  # written out here, independent of reference's mode
            # every implementation on the whole model; the subsets (the same wrapper, other globs) by AUTO alone
            for implementation in (
                (*ALGORITHMS, NtkImplementation.AUTO) if subset is None else (NtkImplementation.AUTO,)
            ):
                result = compute_ntk(
                    model, x1, other, mode="pseudo", implementation=implementation, params=subset, dtype=torch.float64
                )
                assert result.mode is DerivedMode.PSEUDO
                assert result.theta.shape == (x1.shape[0], (x2 if with_x2 else x1).shape[0])
                assert_matches(result.theta, expected, 1e-10)
                if not with_x2:
                    assert torch.equal(result.theta, result.theta.T)


def test_pseudo_is_the_kernel_of_one_gradient_of_the_summed_outputs_per_example() -> None:
    """Θ_p = (1/k) g1 g2ᵀ with g = Σ_a J_a, the gradient of Σ_a f_a (from the reference Jacobian rows)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 5)).double()
    x1, x2 = torch.randn(6, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    g1, g2 = reference_jacobian(model, x1).sum(1), reference_jacobian(model, x2).sum(1)
    theta = compute_ntk(model, x1, x2, mode="pseudo").theta
    assert_matches(theta, g1 @ g2.T / 5, 1e-12)


def test_pseudo_sides_never_share_the_cache_entries_of_the_model_itself() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    cache = SideCache(2**26)
    keys = {"x1_key": ("m", "a"), "x2_key": ("m", "b")}
    trace = compute_ntk(model, x1, x2, mode="trace", side_cache=cache, **keys).theta
    pseudo = compute_ntk(model, x1, x2, mode="pseudo", side_cache=cache, **keys).theta
    assert_matches(trace, reference_ntk(model, x1, x2, "trace"))
    assert_matches(pseudo, reference_ntk(model, x1, x2, "pseudo"))


def test_pseudo_reports_bad_globs_and_modes_in_the_models_own_terms() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(2, 3)
    with pytest.raises(NoMatchingParameters, match=r"'head\.\*' matches no parameter; the model has: 0\.weight"):
        compute_ntk(model, x, mode="pseudo", params=["head.*"])
    with pytest.raises(UnknownMode, match="'pseudo'"):
        compute_ntk(model, x, mode="pseudo_ntk")
