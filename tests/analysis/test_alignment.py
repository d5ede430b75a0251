"""alignment: every variant against its formula written with explicit loops (and H matrices), centered
alignment against linear CKA of the Jacobian features, and streamed tiles against the dense kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from torch import nn

from ntk_service.analysis import KernelTile, alignment
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels import compute_ntk
from tests.analysis.conftest import Features
from tests.reference import reference_jacobian

LABELS = np.array([0, 2, 1, 2, 0, 1, 2])


def _frob(a: np.ndarray, b: np.ndarray) -> float:
    total = 0.0
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            total += a[i, j] * b[i, j]
    return total


def _onehot(labels: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((labels.size, width))
    for i, label in enumerate(labels):
        out[i, label] = 1.0
    return out


def test_uncentered_and_centered_on_the_trace(features: Features) -> None:
    n = 7
    kernel = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            kernel[i, j] = sum(features.theta[i, j, a, a] for a in range(3))
    y = _onehot(LABELS, 3)
    target = y @ y.T
    want = _frob(kernel, target) / np.sqrt(_frob(kernel, kernel) * _frob(target, target))
    assert alignment(features.theta, LABELS, variant="uncentered") == pytest.approx(want, rel=1e-12)
    assert alignment(kernel, LABELS, variant="uncentered") == pytest.approx(want, rel=1e-12)
    h = np.eye(n) - np.ones((n, n)) / n
    kc, tc = h @ kernel @ h, h @ target @ h
    want_c = _frob(kc, tc) / np.sqrt(_frob(kc, kc) * _frob(tc, tc))
    assert alignment(features.theta, LABELS, variant="centered") == pytest.approx(want_c, rel=1e-12)


def test_centered_vec_y_and_rayleigh_on_the_full_kernel(features: Features) -> None:
    n, k = 7, 3
    y = np.random.default_rng(0).standard_normal((n, k))
    big = features.matrix  # (N·k, N·k), row n·k + a
    hk = np.kron(np.eye(n) - np.ones((n, n)) / n, np.eye(k))
    kc = hk @ big @ hk
    v = np.array([y[i, a] - y[:, a].mean() for i in range(n) for a in range(k)])
    want = v @ kc @ v / (np.sqrt(_frob(kc, kc)) * (v @ v))
    assert alignment(features.theta, y, variant="centered_vec_y") == pytest.approx(want, rel=1e-12)
    vec = y.reshape(-1)
    assert alignment(features.theta, y, variant="rayleigh") == pytest.approx(vec @ big @ vec / (vec @ vec), rel=1e-12)
    # TRACE reads as (trace / k) ⊗ I_k
    trace = np.einsum("nmaa->nm", features.theta)
    approx = np.kron(trace / k, np.eye(k))
    assert alignment(trace, y, variant="rayleigh") == pytest.approx(vec @ approx @ vec / (vec @ vec), rel=1e-12)
    kc2 = hk @ approx @ hk
    want2 = v @ kc2 @ v / (np.sqrt(_frob(kc2, kc2)) * (v @ v))
    assert alignment(trace, y, variant="centered_vec_y") == pytest.approx(want2, rel=1e-12)


def test_centered_alignment_is_linear_cka_of_jacobian_features() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 10), nn.Tanh(), nn.Linear(10, 2)).double()
    x = torch.randn(9, 3, dtype=torch.float64)
    y = np.random.default_rng(1).standard_normal((9, 4))
    theta = compute_ntk(model, x, mode="trace", dtype="float64").theta
    features = reference_jacobian(model, x).reshape(9, -1).numpy()  # (N, k·P): trace kernel = Φ Φᵀ
    phi, yc = features - features.mean(0), y - y.mean(0)
    cka = np.linalg.norm(yc.T @ phi) ** 2 / (np.linalg.norm(phi.T @ phi) * np.linalg.norm(yc.T @ yc))
    assert alignment(theta, y, variant="centered") == pytest.approx(cka, rel=1e-10)


def test_streamed_tiles_and_zarr_equal_the_dense_kernel(features: Features, tmp_path) -> None:
    y = np.random.default_rng(2).standard_normal((7, 3))
    tiles = [KernelTile(r, c, features.theta[r : r + 3, c : c + 4]) for r in range(0, 7, 3) for c in range(0, 7, 4)]
    stored = zarr.create_array(
        store=str(tmp_path / "k.zarr"), shape=features.theta.shape, chunks=(2, 7, 3, 3), dtype="f8"
    )
    stored[:] = features.theta
    for variant in ("uncentered", "centered", "centered_vec_y", "rayleigh"):
        dense = alignment(features.theta, y, variant=variant)
        assert alignment(iter(tiles), y, variant=variant) == pytest.approx(dense, rel=1e-12)
        assert alignment(stored, y, variant=variant, block_rows=2) == pytest.approx(dense, rel=1e-12)


def test_bad_inputs(features: Features) -> None:
    with pytest.raises(InvalidInput, match="name one of"):
        alignment(features.theta, LABELS, variant="cka")
    with pytest.raises(ShapeMismatch, match="N = len\\(y\\)"):
        alignment(features.theta, LABELS[:5], variant="centered")
    with pytest.raises(InvalidInput, match="undefined"):
        alignment(features.theta, np.zeros(7, dtype=int), variant="centered")
    with pytest.raises(InvalidInput, match="labels must be in 0..2"):
        alignment(features.theta, np.arange(7), variant="rayleigh")
