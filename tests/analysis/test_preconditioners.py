"""The shared-output Nyström preconditioner and the solver's budgets (memory of a basis, wall time), against dense
numpy references: np.linalg.solve on the kernel of tests/reference.py or on a kernel written out by hand."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.analysis import gp_inference
from ntk_service.analysis.solve import (
    CgOptions,
    conjugate_gradients,
    kernel_operator,
    nystrom_preconditioner,
    shared_nystrom_preconditioner,
)
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch
from ntk_service.kernels import ntk_operator
from tests.reference import reference_ntk

K = 3


def _kronecker(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """S (n, n) with a fast-falling spectrum and its FULL kernel S ⊗ I_k in the example-major layout."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = (q * np.logspace(3, -1, n)) @ q.T
    s = (s + s.T) / 2
    return s, np.kron(s, np.eye(K))


def test_on_an_exact_kronecker_kernel_it_is_the_scaled_inverse() -> None:
    """With every example a landmark, P⁻¹ = (λ_min(Λ) + μ)(S ⊗ I + μ)⁻¹ (NOTE [nystrom preconditioner]): checked
    against numpy's solve, and CG then needs a couple of iterations where plain CG needs dozens."""
    n, mu = 40, 1e-2
    s, a = _kronecker(n)
    op = kernel_operator(a.reshape(n, K, n, K).transpose(0, 2, 1, 3), k=K, name="a", operation="test")
    pre = shared_nystrom_preconditioner(op, ridge=mu, trace_columns=s * K, landmark_indices=np.arange(n))
    assert pre.outputs == K and pre.basis.shape[0] == n and "shared by 3 outputs" in pre.name
    r = np.random.default_rng(1).standard_normal((n * K, 2))
    floor = float(pre.eigenvalues[-1]) + mu
    expected = floor * np.linalg.solve(a + mu * np.eye(n * K), r)
    assert np.linalg.norm(pre.apply(r) - expected) / np.linalg.norm(expected) <= 1e-8
    b = r[:, :1]
    plain = conjugate_gradients(op, b, ridge=mu, options=CgOptions(rtol=1e-10, preconditioner="none"))
    shared = conjugate_gradients(op, b, ridge=mu, options=CgOptions(rtol=1e-10, preconditioner=pre))
    dense = np.linalg.solve(a + mu * np.eye(n * K), b)
    assert shared.converged and np.linalg.norm(shared.solution - dense) / np.linalg.norm(dense) <= 1e-8
    assert shared.iterations <= 3 < 10 <= plain.iterations


def test_on_an_mlp_operator_cg_equals_the_dense_solve_in_fewer_iterations() -> None:
    """The real use: a FULL NTK operator (not a Kronecker product), landmark examples' TRACE columns from the
    reference loop; the GP mean equals the dense solve of the reference FULL kernel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, K)).double()
    g = torch.Generator().manual_seed(1)
    x_train, x_test = torch.randn(30, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g).double()
    y = np.random.default_rng(2).standard_normal((30, K))
    lam = 1e-4
    full = reference_ntk(model, x_train)
    a = full.permute(0, 2, 1, 3).reshape(30 * K, 30 * K).numpy()
    c = reference_ntk(model, x_test, x_train).permute(0, 2, 1, 3).reshape(6 * K, 30 * K).numpy()
    expected = (c @ np.linalg.solve(a + lam * np.eye(30 * K), y.reshape(-1))).reshape(6, K)
    chosen = np.arange(0, 30, 3)
    columns = reference_ntk(model, x_train, x_train[chosen], mode="trace")
    train_op, cross_op = ntk_operator(model, x_train), ntk_operator(model, x_test, x_train)
    pre = shared_nystrom_preconditioner(
        kernel_operator(train_op, k=K, name="train", operation="test"),
        ridge=lam,
        trace_columns=columns,
        landmark_indices=chosen,
    )
    with_pre = gp_inference(train_op, y, cross_op, ridge=lam, cg=CgOptions(rtol=1e-11, preconditioner=pre))
    without = gp_inference(train_op, y, cross_op, ridge=lam, cg=CgOptions(rtol=1e-11, preconditioner="none"))
    assert with_pre.solve is not None and without.solve is not None and with_pre.solve.converged
    assert np.linalg.norm(with_pre.mean - expected) / np.linalg.norm(expected) <= 1e-6
    assert with_pre.solve.iterations < without.solve.iterations


def test_bad_input_and_a_basis_over_the_budget_are_refused_with_the_estimate() -> None:
    n = 20
    s, a = _kronecker(n)
    op = kernel_operator(a.reshape(n, K, n, K).transpose(0, 2, 1, 3), k=K, name="a", operation="test")
    idx = np.arange(5)
    with pytest.raises(ShapeMismatch, match=r"shared_nystrom_preconditioner: trace_columns has shape \(20, 4\)"):
        shared_nystrom_preconditioner(op, ridge=0.1, trace_columns=s[:, :4], landmark_indices=idx)
    with pytest.raises(ShapeMismatch, match=r"indices S in \[0, 20\)"):
        shared_nystrom_preconditioner(op, ridge=0.1, trace_columns=s[:, :5], landmark_indices=idx + 100)
    trace_op = kernel_operator(s, k=K, name="s", operation="test", mode="trace")
    with pytest.raises(InvalidInput, match="needs a square FULL kernel"):
        shared_nystrom_preconditioner(trace_op, ridge=0.1, trace_columns=s[:, :5], landmark_indices=idx)
    with pytest.raises(MemoryEstimateExceeded, match=r"m = 5 columns over 20 rows needs about .* use at most m = 2"):
        shared_nystrom_preconditioner(
            op, ridge=0.1, trace_columns=s[:, :5], landmark_indices=idx, memory_budget_bytes=3 * 20 * 8 * 2 + 7
        )
    with pytest.raises(MemoryEstimateExceeded, match=r"nystrom_preconditioner: a basis of m = 30 columns over 60"):
        nystrom_preconditioner(op, ridge=0.1, landmarks=30, memory_budget_bytes=10_000)


def test_a_solve_past_its_time_limit_stops_and_says_so() -> None:
    """max_seconds (what bench_solvers --max-minutes sets): the solve stops, reports "time_limit" and the true
    residual, and is not called converged; a bad limit is refused."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((300, 300)))
    a = (q * np.logspace(4, -4, 300)) @ q.T
    op = kernel_operator(a, k=1, name="a", operation="test")
    b = rng.standard_normal(300)
    result = conjugate_gradients(op, b, options=CgOptions(rtol=1e-12, preconditioner="none", max_seconds=1e-9))
    assert result.stop_reason == "time_limit" and not result.converged
    true = np.linalg.norm(b - a @ result.solution[:, 0]) / np.linalg.norm(b)
    assert result.residual[0] == pytest.approx(true, rel=1e-9) and true > 1e-12
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidInput, match="conjugate_gradients: max_seconds must be a positive number"):
            conjugate_gradients(op, b, options=CgOptions(max_seconds=bad))


def test_the_time_limit_starts_no_iteration_that_would_end_past_it() -> None:
    """An iteration starts only while it and the closing true residual fit in the limit: with products of at
    least 0.5 s (a TRACE operator's are minutes at scale) and a 1.2 s limit, one iteration runs and the solve ends
    near 1 s. A clock checked alone would start iterations at 0.5 and 1.0 s too and end past 2 s."""
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    a = (q * np.logspace(3, -3, 40)) @ q.T
    dense = kernel_operator(a, k=1, name="a", operation="test")

    def slow(v: np.ndarray) -> np.ndarray:
        time.sleep(0.5)
        return a @ v

    op = dataclasses.replace(dense, apply=slow, matrix=None)
    b = rng.standard_normal(40)
    result = conjugate_gradients(op, b, options=CgOptions(rtol=1e-12, preconditioner="none", max_seconds=1.2))
    assert result.stop_reason == "time_limit" and not result.converged
    assert result.iterations == 1 and result.products == 2  # the iteration and the closing residual
    true = np.linalg.norm(b - a @ result.solution[:, 0]) / np.linalg.norm(b)
    assert result.residual[0] == pytest.approx(true, rel=1e-9)
