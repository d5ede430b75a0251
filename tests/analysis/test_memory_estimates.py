"""Each analysis's memory estimate beside it (what the routes check against the budget before computing), and
``outputs_float64``, the f0 of the linearized predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service import analysis
from ntk_service.analysis.spectrum import DENSE_MAX_SIZE, SPECTRUM_COPIES, lanczos_vectors
from ntk_service.errors import InvalidInput
from ntk_service.kernels.problem.outputs import parse_output


def test_spectrum_estimate_follows_the_method_spectrum_takes() -> None:
    small, large = 100, DENSE_MAX_SIZE + 1
    assert analysis.spectrum_memory_bytes(small) == 8 * SPECTRUM_COPIES["eigh"] * small**2  # every eigenvalue
    assert analysis.spectrum_memory_bytes(small, top=5) == 8 * SPECTRUM_COPIES["eigh"] * small**2  # auto: dense
    assert analysis.spectrum_memory_bytes(large, top=5) == 8 * SPECTRUM_COPIES["lanczos"] * large**2
    assert analysis.spectrum_memory_bytes(large, top=5, method="eigh") == 8 * SPECTRUM_COPIES["eigh"] * large**2
    assert analysis.spectrum_memory_bytes(large, top=large) == 8 * SPECTRUM_COPIES["eigh"] * large**2  # top ≥ n
    # an operator is never formed: only ARPACK's basis, max(2·top + 1, 20) vectors and as much workspace
    assert analysis.spectrum_memory_bytes(10**6, top=10, operator=True) == 8 * 2 * 21 * 10**6
    assert lanczos_vectors(3, 10) == 20  # capped at n
    with pytest.raises(InvalidInput, match="give top"):
        analysis.spectrum_memory_bytes(100, operator=True)


def test_linearized_and_distance_estimates_grow_with_the_kernels_they_hold() -> None:
    n, m, k = 10, 4, 3
    full = analysis.linearized_memory_bytes(n, m, k, full=True)
    trace = analysis.linearized_memory_bytes(n, m, k, full=False)
    assert full == 8 * (analysis.linearized.PREDICTION_COPIES * (n * k) ** 2 + 2 * (m * k) * (n * k))
    assert trace == 8 * (analysis.linearized.PREDICTION_COPIES * n**2 + 2 * m * n)
    assert analysis.linearized_memory_bytes(n, 0, k, full=True) < full  # no test side
    assert analysis.distances_memory_bytes(3, 50) == 8 * 4 * 50 * 50


def test_outputs_float64_computes_in_float64_without_touching_the_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).eval()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.randn(4, 3)
    f0 = analysis.outputs_float64(model, x)
    reference = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    reference.load_state_dict({name: t.double() for name, t in before.items()})
    expected = reference(x.double()).detach().numpy()
    assert f0.dtype == np.float64 and f0.shape == (4, 2)
    np.testing.assert_allclose(f0, expected, rtol=1e-12, atol=1e-12)  # float64 math, far above its ~1e-16 floor
    assert all(torch.equal(t, before[name]) and t.dtype == torch.float32 for name, t in model.state_dict().items())


def test_outputs_float64_selects_from_a_dict_output() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 6)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            h = self.body(x)
            return {"logits": h.reshape(-1, 2, 3), "hidden": h}

    torch.manual_seed(1)
    model = TwoHeads().eval()
    x = torch.randn(5, 3)
    f0 = analysis.outputs_float64(model, x, output=parse_output("logits[:, 1]"))
    with torch.no_grad():
        expected = model.double()(x.double())["logits"][:, 1].numpy()
    assert f0.shape == (5, 3)
    np.testing.assert_allclose(f0, expected, rtol=1e-12, atol=1e-12)
