"""compute_nngp against kernels written out by hand from plain forward passes, and the readout identity: the
NTK block of a Linear readout's weight (the float64 reference restricted to that parameter) is ΦΦᵀ ⊗ I_k."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ntk_service.errors import MemoryEstimateExceeded, UnknownLayer, UnknownMode, UnsupportedModel
from ntk_service.kernels import DerivedMode, KernelMode, compute_nngp
from tests.reference import assert_matches, reference_ntk

MODES = [*KernelMode, *DerivedMode]


def _by_hand(f1: torch.Tensor, f2: torch.Tensor, mode: str) -> torch.Tensor:
    """The feature kernel of f1 (N, d), f2 (M, d), loops over entries (nothing shared with the library)."""
    n, d = f1.shape
    m = f2.shape[0]
    if mode == "example_diagonal":
        return torch.stack([torch.outer(f1[i], f1[i]) for i in range(n)])
    if mode == "example_output_diagonal":
        return f1 * f1
    if mode == "example_trace":
        return torch.stack([f1[i] @ f1[i] for i in range(n)])
    full = torch.empty(n, m, d, d, dtype=torch.float64)
    for i in range(n):
        for j in range(m):
            full[i, j] = torch.outer(f1[i], f2[j])
    return {
        "full": full,
        "trace": full.diagonal(dim1=2, dim2=3).sum(-1),
        "output_diagonal": full.diagonal(dim1=2, dim2=3),
        "pseudo": full.sum(dim=(2, 3)) / d,
    }[mode]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3))


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_output_nngp_is_the_outer_product_of_outputs_in_every_mode(mode: KernelMode | DerivedMode) -> None:
    model = _mlp()
    x1, x2 = torch.randn(5, 4), torch.randn(3, 4)
    plain = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        f1, f2 = plain(x1.double()), plain(x2.double())
    for other, f_other in ((x2, f2), (None, f1)):
        result = compute_nngp(model, x1, other, mode=mode, dtype=torch.float64)
        assert result.mode is mode and result.features == 3 and result.layer is None
        assert_matches(result.theta, _by_hand(f1, f_other, mode.value), 1e-13)
        if other is None and mode in (KernelMode.TRACE, KernelMode.FULL, DerivedMode.PSEUDO):
            swapped = result.theta.permute(1, 0, 3, 2) if mode is KernelMode.FULL else result.theta.T
            assert torch.equal(result.theta, swapped)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_conv_layer_features_are_flattened_per_example(mode: KernelMode | DerivedMode) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 2 * 2, 2)).double()
    x1, x2 = torch.randn(4, 2, 4, 4, dtype=torch.float64), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        f1, f2 = torch.relu(model[0](x1)).reshape(4, -1), torch.relu(model[0](x2)).reshape(2, -1)
    for other, f_other in ((x2, f2), (None, f1)):
        result = compute_nngp(model, x1, other, layer="1", mode=mode)
        assert result.features == 12
        assert_matches(result.theta, _by_hand(f1, f_other, mode.value), 1e-13)


def test_ntk_block_of_a_linear_readout_weight_is_the_conjugate_kernel_times_identity() -> None:
    model = _mlp()
    x1, x2 = torch.randn(5, 4), torch.randn(3, 4)
    eye = torch.eye(3, dtype=torch.float64)
    for other in (x2, None):
        phi_phi = compute_nngp(model, x1, other, layer="3", mode="trace", dtype=torch.float64).theta  # (N, M)
        weight_block = reference_ntk(model, x1, other, "full", params=["4.weight"])  # (N, M, k, k)
        assert_matches(weight_block, phi_phi[:, :, None, None] * eye, 1e-12)
        bias_block = reference_ntk(model, x1, other, "full", params=["4.bias"])
        assert_matches(bias_block, torch.ones_like(phi_phi)[:, :, None, None] * eye, 1e-12)


def test_bad_layers_modes_and_budgets_are_refused_clearly() -> None:
    model = _mlp()
    x = torch.randn(3, 4)
    with pytest.raises(UnknownLayer, match=r"compute_nngp: layer 'head' is not a module of the model; .*0, 1, 2"):
        compute_nngp(model, x, layer="head")
    with pytest.raises(UnknownLayer):
        compute_nngp(model, x, layer="")
    with pytest.raises(UnknownMode, match="compute_nngp: unknown mode 'diag'"):
        compute_nngp(model, x, mode="diag")
    with pytest.raises(MemoryEstimateExceeded, match="compute_nngp: mode full with N=3, M=3 and d=3"):
        compute_nngp(model, x, memory_budget_bytes=64)

    shared = nn.Linear(4, 4)
    twice = nn.Sequential(shared, nn.Tanh(), shared)
    with pytest.raises(UnsupportedModel, match="layer '0' ran 2 times"):
        compute_nngp(twice, x, layer="0")


def test_kernel_is_a_deprecated_alias_of_theta() -> None:
    """``NngpResult.theta`` is the kernel (the name ``NtkResult`` uses); ``.kernel`` still answers for one release,
    with a DeprecationWarning that names the new attribute."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    result = compute_nngp(model, x, mode="trace")
    f = model(x)
    assert_matches(result.theta, f @ f.T, 1e-13)
    with pytest.warns(DeprecationWarning, match=r"NngpResult.kernel is deprecated .* use NngpResult.theta"):
        alias = result.kernel
    assert alias is result.theta
