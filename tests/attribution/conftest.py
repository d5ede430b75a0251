"""The attribution tests' problem and their independent reference: TRAK's formula written out in parameter space.

``reference_scores`` builds every quantity by hand in float64 from ``tests/reference.py``'s explicit Jacobian
(a plain autograd loop) and numpy: the margin weights from a numpy softmax, the Hessian rows G, the loss-gradient
rows, F = GᵀG (P × P), λ = ridge · tr(F) / rows and τ = M (F + λI)⁻¹ Lᵀ (a pseudo-inverse for ridge 0). Nothing
of ntk_service.attribution is used, so agreement is evidence, not an identity.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from tests.reference import reference_jacobian


@dataclass(frozen=True)
class Problem:
    """A small classifier / regressor with training and test sets (float32 weights, as users pass them)."""

    model: nn.Module
    x: torch.Tensor
    labels: torch.Tensor
    targets: torch.Tensor
    xq: torch.Tensor
    labels_q: torch.Tensor
    targets_q: torch.Tensor


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3))


@pytest.fixture(scope="package")
def problem() -> Problem:
    gen = torch.Generator().manual_seed(0)
    return Problem(
        model=make_mlp(0),
        x=torch.randn(24, 5, generator=gen),
        labels=torch.randint(0, 3, (24,), generator=gen),
        targets=torch.randn(24, 3, generator=gen),
        xq=torch.randn(6, 5, generator=gen),
        labels_q=torch.randint(0, 3, (6,), generator=gen),
        targets_q=torch.randn(6, 3, generator=gen),
    )


def _softmax(f: np.ndarray) -> np.ndarray:
    e = np.exp(f - f.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def margin_weights(f: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """∂(f_y − log Σ_{a≠y} e^{f_a})/∂f (n, k) and 1 − p_y (n,), by hand."""
    p = _softmax(f)
    rows = np.arange(len(labels))
    p_y = p[rows, labels]
    w = -p / (1.0 - p_y)[:, None]
    w[rows, labels] = 1.0
    return w, 1.0 - p_y


def reference_scores(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    xq: torch.Tensor,
    yq: torch.Tensor,
    *,
    loss: str,
    ridge: float,
) -> np.ndarray:
    """τ (M, N) of one checkpoint (module docstring)."""
    m64 = copy.deepcopy(model).double()
    j, jq = reference_jacobian(m64, x).numpy(), reference_jacobian(m64, xq).numpy()  # (n, k, P)
    with torch.no_grad():
        f, fq = m64(x.double()).numpy(), m64(xq.double()).numpy()
    if loss == "cross_entropy":
        w, s = margin_weights(f, y.numpy())
        g = np.einsum("na,nap->np", w, j)  # Hessian rows = the margin gradients
        train_rows = g * s[:, None]  # −∇ℓ_n = (1 − p_y) ∇margin_n
        wq, _ = margin_weights(fq, yq.numpy())
        measure = np.einsum("na,nap->np", wq, jq)
    else:
        g = j.reshape(-1, j.shape[-1])  # all k rows
        train_rows = np.einsum("na,nap->np", y.numpy() - f, j)
        measure = np.einsum("na,nap->np", yq.numpy() - fq, jq)
    gram = g.T @ g
    lam = ridge * np.trace(gram) / g.shape[0]
    inverse = np.linalg.pinv(gram) if ridge == 0 else np.linalg.inv(gram + lam * np.eye(gram.shape[0]))
    return np.asarray(measure @ inverse @ train_rows.T)


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
