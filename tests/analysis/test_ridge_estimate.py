"""estimate_ridge: the exact GCV and leave-one-out from a dense kernel against brute force written out here (the
hat matrix formed, each example really left out and the ridge regression refitted), and the Nyström estimate from
an operator against that exact one on the FULL kernel of tests/reference.py (NOTE [ridge estimate])."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg
import torch
from torch import nn

from ntk_service.analysis.solve import estimate_ridge
from ntk_service.errors import InvalidInput
from ntk_service.kernels import ntk_operator
from tests.reference import reference_ntk

K = 3


def _setup(n: int = 60, d: int = 16) -> tuple[nn.Module, torch.Tensor, np.ndarray, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, K)).double()
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    teacher = torch.randn(d, K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y = (x @ teacher).numpy() + 0.3 * np.random.default_rng(3).standard_normal((n, K))
    return model, x, y, reference_ntk(model, x)


def test_exact_gcv_and_loo_equal_brute_force() -> None:
    model, x, y, theta = _setup(n=30)
    n = 30
    matrix = theta.permute(0, 2, 1, 3).reshape(n * K, n * K).numpy()
    ridges = np.array([1e-3, 1e-1, 10.0]) * float(np.mean(np.diag(matrix)))
    est = estimate_ridge(theta, y, ridges=ridges)
    assert est.method == "exact" and est.rank == n * K
    b = y.reshape(-1)
    for i, lam in enumerate(ridges):
        hat = matrix @ np.linalg.inv(matrix + lam * np.eye(n * K))
        residual = b - hat @ b
        gcv = np.mean(residual**2) / np.mean(1 - np.diag(hat)) ** 2
        assert est.gcv[i] == pytest.approx(gcv, rel=1e-8)
        errors = []
        for left in range(n):  # leave example `left` out (all its k outputs), refit, predict it
            keep = np.array([j for j in range(n * K) if j // K != left])
            out = np.arange(left * K, (left + 1) * K)
            alpha = np.linalg.solve(matrix[np.ix_(keep, keep)] + lam * np.eye(keep.size), b[keep])
            errors.append(b[out] - matrix[np.ix_(out, keep)] @ alpha)
        assert est.loo[i] == pytest.approx(float(np.mean(np.square(errors))), rel=1e-7)
    assert est.best_gcv == ridges[int(np.argmin(est.gcv))] and est.best_loo == ridges[int(np.argmin(est.loo))]


def test_the_nystrom_estimate_picks_a_ridge_the_exact_criteria_agree_with() -> None:
    """How far to trust it (NOTE [ridge estimate]): on a small FULL kernel the exact criterion at the ridge the
    Nyström estimate picks is within 20 % of the exact minimum over the grid (its own values are up to 2x off: the
    flat tail; the curves are flat near their minimum, so the argmins themselves may sit decades apart)."""
    model, x, y, theta = _setup()
    exact = estimate_ridge(theta, y)
    approx = estimate_ridge(ntk_operator(model, x), y, ridges=exact.ridges)
    assert approx.method == "nystrom" and 1 <= approx.rank <= 60 and approx.floor >= 0
    assert approx.mean_diagonal == pytest.approx(exact.mean_diagonal, rel=1e-10)
    for criterion in ("gcv", "loo"):
        picked = getattr(approx, f"best_{criterion}")
        values = getattr(exact, criterion)
        at_pick = values[int(np.argmin(np.abs(exact.ridges - picked)))]
        assert at_pick <= 1.2 * values.min(), (criterion, at_pick, values.min())


def test_bad_ridges_are_refused() -> None:
    model, x, y, theta = _setup(n=10)
    for ridges in ([0.0, 1.0], [-1.0], [float("nan")], []):
        with pytest.raises(InvalidInput, match="ridges must be finite numbers > 0"):
            estimate_ridge(theta, y, ridges=ridges)
    with pytest.raises(InvalidInput, match="needs its model"):
        estimate_ridge(scipy.sparse.linalg.aslinearoperator(np.eye(30)), y)
