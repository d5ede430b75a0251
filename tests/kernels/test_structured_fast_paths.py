"""The structured path's shortcuts run where they should and agree with the float64 reference in every mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntk_service.kernels import KernelMode, compute_ntk, structured_contract
from tests.reference import reference_ntk


@pytest.mark.parametrize("mode", list(KernelMode), ids=str)
def test_output_layer_delta_shared_by_all_examples_is_contracted_as_an_outer_product(
    mode: KernelMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [example-independent δ]: the last Linear's δ is e_c for every example; its term is Δ ⊗ G^A."""
    shared: list[torch.Tensor] = []
    real = structured_contract._example_independent

    def spy(d1: torch.Tensor, d2: torch.Tensor) -> torch.Tensor | None:
        delta = real(d1, d2)
        if delta is not None:
            shared.append(delta)
        return delta

    monkeypatch.setattr(structured_contract, "_example_independent", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x1, x2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    theta = compute_ntk(model, x1, x2, mode=mode, implementation="structured").theta
    expected = reference_ntk(model, x1, x2, mode.value)
    torch.testing.assert_close(theta, expected, rtol=1e-10, atol=1e-10 * expected.abs().max().item())
    if mode is not KernelMode.EXAMPLE_DIAGONAL:  # the diagonal has its own contraction
        assert shared and torch.equal(shared[0], torch.eye(3, dtype=torch.float64))
