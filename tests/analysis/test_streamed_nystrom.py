"""The streamed, oversampled shared Nyström preconditioner (NOTE [streamed nystrom]) against a dense numpy
reference written out by hand from the float64 trace kernel of tests/reference.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.analysis import gp_inference
from ntk_service.analysis.solve import CgOptions, plan_streamed_nystrom, streamed_nystrom_preconditioner
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded
from ntk_service.kernels import ntk_operator
from tests.reference import reference_ntk

K = 3
N = 40


def _setup() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, K)).double()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(N, 4, generator=g).double(), torch.randn(6, 4, generator=g).double()


def _dense_top(trace: np.ndarray, chosen: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-m eigenpairs of C W⁺ Cᵀ / k with C = Θ_trace[:, S], W = Θ_trace[S, S], by numpy's pinv and eigh."""
    c = trace[:, chosen]
    approx = c @ np.linalg.pinv(c[chosen], rcond=1e-12, hermitian=True) @ c.T / K
    values, vectors = np.linalg.eigh((approx + approx.T) / 2)
    return values[::-1][:m], vectors[:, ::-1][:, :m]


def test_basis_and_eigenvalues_equal_the_dense_nystrom_approximation_whatever_the_chunks() -> None:
    model, x, _ = _setup()
    trace = reference_ntk(model, x, mode="trace").numpy()
    m = 5
    pre = streamed_nystrom_preconditioner(model, x, ridge=1e-3, outputs=K, landmarks=m, oversample=3.0)
    assert pre.landmarks.shape == (15,) and pre.outputs == K and pre.column_passes == 2 and pre.products == 0
    assert pre.build_seconds > 0 and "streamed 3x, float64 basis, s=15, rank=5" in pre.name
    values, vectors = _dense_top(trace, pre.landmarks, m)
    np.testing.assert_allclose(pre.eigenvalues, values, rtol=1e-8)
    assert np.linalg.norm(pre.basis.T @ pre.basis - np.eye(m)) <= 1e-8
    # the basis spans the same top-m space (each eigenvector is defined up to sign)
    assert np.linalg.norm(pre.basis @ pre.basis.T - vectors @ vectors.T) <= 1e-7
    for rows in (1, 7, N):  # chunking changes only the rounding
        other = streamed_nystrom_preconditioner(
            model, x, ridge=1e-3, outputs=K, landmarks=m, oversample=3.0, rows_per_chunk=rows
        )
        np.testing.assert_allclose(other.eigenvalues, pre.eigenvalues, rtol=1e-10)
        np.testing.assert_allclose(np.abs(other.basis), np.abs(pre.basis), rtol=1e-8, atol=1e-10)


def test_cg_with_it_equals_the_dense_float64_solve_in_fewer_iterations() -> None:
    model, x_train, x_test = _setup()
    y = np.random.default_rng(2).standard_normal((N, K))
    lam = 1e-4
    a = reference_ntk(model, x_train).permute(0, 2, 1, 3).reshape(N * K, N * K).numpy()
    c = reference_ntk(model, x_test, x_train).permute(0, 2, 1, 3).reshape(6 * K, N * K).numpy()
    expected = (c @ np.linalg.solve(a + lam * np.eye(N * K), y.reshape(-1))).reshape(6, K)
    train_op, cross_op = ntk_operator(model, x_train), ntk_operator(model, x_test, x_train)
    without = gp_inference(train_op, y, cross_op, ridge=lam, cg=CgOptions(rtol=1e-11, preconditioner="none"))
    assert without.solve is not None
    for basis_dtype in ("float64", "float32"):
        pre = streamed_nystrom_preconditioner(
            model, x_train, ridge=lam, outputs=K, landmarks=8, oversample=4.0, rows_per_chunk=9, basis_dtype=basis_dtype
        )
        assert pre.basis.dtype == np.dtype(basis_dtype)
        post = gp_inference(train_op, y, cross_op, ridge=lam, cg=CgOptions(rtol=1e-11, preconditioner=pre))
        assert post.solve is not None and post.solve.converged
        assert np.linalg.norm(post.mean - expected) / np.linalg.norm(expected) <= 1e-6
        assert post.solve.iterations < without.solve.iterations


def test_bad_input_and_a_build_over_the_budget_are_refused_before_computing() -> None:
    model, x, _ = _setup()
    with pytest.raises(InvalidInput, match=r"landmarks \(the rank m kept\) must be in \[1, N = 40\], got 41"):
        streamed_nystrom_preconditioner(model, x, ridge=0.1, outputs=K, landmarks=41)
    with pytest.raises(InvalidInput, match=r"oversample must be ≥ 1 .* got 0.5"):
        streamed_nystrom_preconditioner(model, x, ridge=0.1, outputs=K, landmarks=4, oversample=0.5)
    with pytest.raises(InvalidInput, match=r"oversample must be ≥ 1 .* got nan"):
        plan_streamed_nystrom(40, outputs=K, landmarks=4, oversample=float("nan"))
    with pytest.raises(InvalidInput, match="basis_dtype must be 'float64' or 'float32', got 'float16'"):
        plan_streamed_nystrom(40, outputs=K, landmarks=4, basis_dtype="float16")
    with pytest.raises(InvalidInput, match="rows_per_chunk must be ≥ 1, got 0"):
        plan_streamed_nystrom(40, outputs=K, landmarks=4, rows_per_chunk=0)
    # m = 1000 over N = 100,000 with s = 4000: 800 MB of float64 basis, 400 MB in float32, plus the chunk and s × s
    plan = plan_streamed_nystrom(100_000, outputs=10, landmarks=1000, basis_dtype="float32")
    assert plan.columns == 4000 and plan.rows_per_chunk == 256 * 2**20 // (4000 * 12)
    assert plan.estimate_bytes == 100_000 * 1000 * 4 + plan.rows_per_chunk * 4000 * 12 + 5 * 4000**2 * 8
    with pytest.raises(MemoryEstimateExceeded, match=r"needs about .* over the memory budget of .* use at most m = "):
        plan_streamed_nystrom(100_000, outputs=10, landmarks=1000, memory_budget_bytes=plan.estimate_bytes - 1,
                              basis_dtype="float32")  # fmt: skip
    with pytest.raises(MemoryEstimateExceeded, match=r"streamed_nystrom_preconditioner: a float64 basis of m = 4"):
        streamed_nystrom_preconditioner(model, x, ridge=0.1, outputs=K, landmarks=4, memory_budget_bytes=1000)
