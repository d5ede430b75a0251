"""Block CG and the GP variance by CG against dense float64 references: scipy.linalg.solve on SPD matrices, and
the dense GP formula on the kernel of tests/reference.py (an independent per-example autograd loop)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from ntk_service.analysis import gp_inference
from ntk_service.analysis.solve import CgOptions, conjugate_gradients, kernel_operator
from ntk_service.analysis.solve.cg import cg_memory_bytes
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch
from ntk_service.kernels import compute_ntk, ntk_operator
from tests.reference import reference_ntk

K = 3


def _spd(n: int, seed: int, top: float = 2.0, bottom: float = -3.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return (q * np.logspace(top, bottom, n)) @ q.T


def _rel(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def _true_residual(a: np.ndarray, lam: float, x: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(b - (a + lam * np.eye(a.shape[0])) @ x, axis=0) / np.linalg.norm(b, axis=0)


@pytest.mark.parametrize("r", [1, 4, 12])
@pytest.mark.parametrize("preconditioner", ["none", "nystrom"])
def test_block_cg_equals_the_dense_solve(r: int, preconditioner: str) -> None:
    """CG's guarantee, not one CPU's digits: a converged solve's true residual (numpy's, recomputed here) is at
    most rtol, and its error at most cond(A + λI) × rtol. rtol sits 100× above the rounding floor eps × cond."""
    a, lam = _spd(150, seed=r, bottom=-2.0), 1e-3
    cond = (1e2 + lam) / (1e-2 + lam)  # the spectrum runs from 1e2 down to 1e-2
    rtol = 1e-9
    assert rtol >= 100 * np.finfo(np.float64).eps * cond
    b = np.random.default_rng(10 + r).standard_normal((150, r))
    options = CgOptions(rtol=rtol, preconditioner=preconditioner, landmarks=20, method="block")  # type: ignore[arg-type]
    result = conjugate_gradients(kernel_operator(a, k=1, name="a", operation="t"), b, ridge=lam, options=options)
    expected = scipy.linalg.solve(a + lam * np.eye(150), b, assume_a="pos")
    assert result.converged and result.stop_reason == "converged"
    truth = _true_residual(a, lam, result.solution, b)
    assert np.all(truth <= rtol * (1 + 1e-2)), truth  # the recomputed residual, plus the recomputation's rounding
    np.testing.assert_allclose(result.residual, truth, rtol=1e-2)
    assert _rel(result.solution, expected) <= cond * rtol
    assert result.preconditioner.startswith("nystrom" if preconditioner == "nystrom" else "none")


def test_shared_space_costs_fewer_products_than_a_space_per_column() -> None:
    """Eight columns of one kernel with a few large outlying modes (like an NTK's): block CG resolves them once
    for all columns; both answers equal scipy's."""
    n = 300
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    spectrum = np.concatenate([np.logspace(4, 3, 10), np.logspace(0, -2, n - 10)])
    a = (q * spectrum) @ q.T
    b = rng.standard_normal((n, 8))
    op = kernel_operator(a, k=1, name="a", operation="t")
    expected = scipy.linalg.solve(a + 1e-2 * np.eye(n), b, assume_a="pos")
    runs = {
        method: conjugate_gradients(op, b, ridge=1e-2, options=CgOptions(rtol=1e-9, preconditioner="none", method=m))
        for method, m in (("block", "block"), ("batched", "batched"))
    }
    for result in runs.values():
        assert result.converged and _rel(result.solution, expected) <= 1e-7
    assert runs["block"].products < 0.8 * runs["batched"].products, (runs["block"].products, runs["batched"].products)


def test_a_rank_deficient_block_does_not_break_down() -> None:
    """Two equal columns, a multiple of one, a zero column and one already solved by x0: one search direction
    serves the dependent columns (fewer products per iteration than columns), the answers equal scipy's."""
    a, lam = _spd(120, seed=3), 1e-2
    rng = np.random.default_rng(4)
    u, w, solved = rng.standard_normal(120), rng.standard_normal(120), rng.standard_normal(120)
    b = np.stack([u, u, 3 * u, np.zeros(120), w, solved], axis=1)
    exact = scipy.linalg.solve(a + lam * np.eye(120), b, assume_a="pos")
    x0 = np.zeros_like(b)
    x0[:, 5] = exact[:, 5]
    op = kernel_operator(a, k=1, name="a", operation="t")
    result = conjugate_gradients(
        op, b, ridge=lam, options=CgOptions(rtol=1e-10, preconditioner="none", method="block"), x0=x0
    )
    assert result.converged, result.stop_reason
    assert _rel(result.solution, exact) <= 1e-8 and not np.any(result.solution[:, 3])
    np.testing.assert_allclose(result.solution[:, 0], result.solution[:, 1], rtol=1e-9, atol=1e-12)
    # the residual check of x0 and each sweep's final check cost 5 products (the nonzero columns; at most the
    # 3 warm restarts of NOTE [cg]); in between at most 2 directions (u, w) per iteration, not the 4 moving columns
    assert result.products <= 2 * result.iterations + 5 * 5, (result.products, result.iterations)


@pytest.mark.parametrize("method", ["block", "batched"])
def test_non_convergence_is_reported(method: str) -> None:
    a = _spd(200, seed=5, top=3.0, bottom=-4.0)
    b = np.random.default_rng(6).standard_normal((200, 5))
    op = kernel_operator(a, k=1, name="a", operation="t")
    options = CgOptions(rtol=1e-12, preconditioner="none", max_iterations=4, method=method)  # type: ignore[arg-type]
    result = conjugate_gradients(op, b, options=options)
    assert not result.converged and result.stop_reason == "max_iterations" and result.iterations == 4
    truth = _true_residual(a, 0.0, result.solution, b)
    assert np.all(truth > 1e-12)
    np.testing.assert_allclose(result.residual, truth, rtol=1e-6)
    broken = conjugate_gradients(
        kernel_operator(-np.eye(6), k=1, name="a", operation="t"), np.ones((6, 2)), options=CgOptions(method=method)
    )
    assert not broken.converged and broken.stop_reason.startswith("breakdown")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, K)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(14, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)


def _example_major(full: torch.Tensor) -> np.ndarray:
    n, m, k, _ = full.shape
    return full.permute(0, 2, 1, 3).reshape(n * k, m * k).numpy()


@pytest.mark.parametrize("method", ["block", "batched"])
def test_block_cg_on_an_ntk_operator_equals_the_dense_solve(method: str) -> None:
    model = _mlp()
    x, _ = _data()
    a = reference_ntk(model, x, mode="trace").numpy() / K  # read as (trace / k) ⊗ I_k (NOTE [layout])
    y = np.random.default_rng(7).standard_normal((14, K))
    op = kernel_operator(ntk_operator(model, x, mode="trace"), k=K, name="a", operation="t")
    result = conjugate_gradients(op, y, ridge=1e-3, options=CgOptions(rtol=1e-12, method=method))  # type: ignore[arg-type]
    assert result.converged and result.passes == result.products * K
    assert _rel(result.solution, scipy.linalg.solve(a + 1e-3 * np.eye(14), y, assume_a="pos")) <= 1e-7


def _dense_posterior(model: nn.Module, x: torch.Tensor, xs: torch.Tensor, lam: float, mode: str) -> np.ndarray:
    """Σ* = Θ** − Θ*ₓ (Θ + λI)⁻¹ Θₓ* from the reference kernels, in the layout of NOTE [layout]."""
    if mode == "full":
        a, c = _example_major(reference_ntk(model, x)), _example_major(reference_ntk(model, xs, x))
        t = _example_major(reference_ntk(model, xs))
    else:
        a, c = (reference_ntk(model, u, v, mode="trace").numpy() / K for u, v in ((x, x), (xs, x)))
        t = reference_ntk(model, xs, mode="trace").numpy() / K
    return np.asarray(t - c @ scipy.linalg.solve(a + lam * np.eye(a.shape[0]), c.T, assume_a="pos"))


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_gp_variance_by_cg_on_operators_equals_the_dense_formula(mode: str) -> None:
    model = _mlp()
    x, xs = _data()
    y = np.random.default_rng(8).standard_normal((14, K))
    lam, m = 1e-2, xs.shape[0]
    dense = _dense_posterior(model, x, xs, lam, mode)
    if mode == "full":
        expected = np.stack([dense[i * K : (i + 1) * K, i * K : (i + 1) * K] for i in range(m)])
    else:
        expected = np.diag(dense)
    diagonal = compute_ntk(model, xs, mode="example_diagonal", dtype="float64").theta  # (M, k, k)
    train, cross = ntk_operator(model, x, mode=mode), ntk_operator(model, xs, x, mode=mode)
    post = gp_inference(train, y, cross, diagonal, ridge=lam, cg=CgOptions(rtol=1e-12))
    assert post.solver == "cg" and post.variance_solve is not None and post.variance_solve.converged
    assert post.variance is not None and post.variance.shape == expected.shape
    assert _rel(post.variance, expected) <= 1e-6
    assert post.covariance is None
    assert post.variance_solve.solution.shape == (14 * K, m * K) if mode == "full" else (14, m)
    # the dense Θ** gives the whole covariance too
    with_dense = gp_inference(
        train, y, cross, reference_ntk(model, xs, mode=mode).numpy(), ridge=lam, cg=CgOptions(rtol=1e-12)
    )
    assert with_dense.covariance is not None and _rel(with_dense.covariance, dense) <= 1e-6
    if mode == "trace":  # the (M,) diagonal of the trace kernel is enough
        trace_diagonal = np.einsum("maa->m", diagonal.numpy())
        assert _rel(gp_inference(train, y, cross, trace_diagonal, ridge=lam).variance, expected) <= 1e-6


def test_direct_and_cg_variance_agree_on_dense_kernels() -> None:
    """Dense kernels: the direct path's variance is the diagonal of its covariance, and CG's equals both."""
    model = _mlp()
    x, xs = _data()
    y = np.random.default_rng(9).standard_normal((14, K))
    kxx, kxs, kss = (reference_ntk(model, u, v) for u, v in ((x, None), (xs, x), (xs, None)))
    direct = gp_inference(kxx, y, kxs, kss, ridge=1e-2, solver="direct")
    by_cg = gp_inference(kxx, y, kxs, kss, ridge=1e-2, solver="cg", cg=CgOptions(rtol=1e-12))
    assert direct.variance is not None and by_cg.variance is not None and by_cg.variance_solve is not None
    dense = _dense_posterior(model, x, xs, 1e-2, "full")
    assert _rel(direct.variance, np.stack([dense[i * K : (i + 1) * K, i * K : (i + 1) * K] for i in range(6)])) <= 1e-9
    assert _rel(by_cg.variance, direct.variance) <= 1e-6 and by_cg.variance_solve.passes == 0


class _CountingKernel:
    """A dense kernel seen only through matvec / rmatvec, counting the products."""

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix, self.shape, self.calls = matrix, matrix.shape, 0

    def matvec(self, v: np.ndarray) -> np.ndarray:
        self.calls += 1
        return np.asarray(self.matrix @ v)

    def rmatvec(self, v: np.ndarray) -> np.ndarray:
        self.calls += 1
        return np.asarray(self.matrix.T @ v)


def test_the_variance_is_refused_up_front_when_it_would_not_fit() -> None:
    a, c = _spd(40, seed=1), np.random.default_rng(2).standard_normal((30, 40))
    train, cross = _CountingKernel(a), _CountingKernel(c)
    y = np.ones((40, 1))
    budget = cg_memory_bytes(40, 30) - 1
    with pytest.raises(MemoryEstimateExceeded, match="over the memory budget") as info:
        gp_inference(train, y, cross, np.ones(30), ridge=0.1, cg=CgOptions(memory_budget_bytes=budget))
    assert info.value.estimate_bytes == cg_memory_bytes(40, 30) and info.value.budget_bytes == budget
    assert train.calls == 0 and cross.calls == 0  # refused before any product
    # at the budget it runs, through rmatvec: the variance equals the dense formula
    post = gp_inference(
        train, y, cross, np.full(30, 5.0), ridge=0.1, cg=CgOptions(rtol=1e-12, memory_budget_bytes=budget + 1)
    )
    expected = 5.0 - np.einsum("mi,im->m", c, scipy.linalg.solve(a + 0.1 * np.eye(40), c.T))
    assert post.variance is not None and post.variance.shape == (30, 1, 1)  # k = 1: FULL blocks of one
    assert _rel(post.variance.reshape(-1), expected) <= 1e-8


@pytest.mark.parametrize(("n", "r"), [(400, 40), (400, 1), (300, 200)])
def test_the_memory_estimate_covers_the_solve(n: int, r: int) -> None:
    a = _spd(n, seed=6)
    b = np.random.default_rng(7).standard_normal((n, r))
    op = kernel_operator(a, k=1, name="a", operation="t")
    for method in ("block", "batched"):
        tracemalloc.start()
        conjugate_gradients(op, b, ridge=1e-2, options=CgOptions(rtol=1e-8, preconditioner="none", method=method))  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak <= cg_memory_bytes(n, r), (method, peak, cg_memory_bytes(n, r))


def test_bad_variance_input_says_what_to_pass() -> None:
    model = _mlp()
    x, xs = _data()
    y = np.zeros((14, K))
    train, cross = ntk_operator(model, x), ntk_operator(model, xs, x)
    with pytest.raises(InvalidInput, match="example_diagonal"):
        gp_inference(train, y, cross, ntk_operator(model, xs))
    with pytest.raises(ShapeMismatch, match=r"pass \(6, 3, 3\) or \(6, 6, 3, 3\)"):
        gp_inference(train, y, cross, np.ones((5, K, K)))
    with pytest.raises(InvalidInput, match="unknown method"):
        conjugate_gradients(
            kernel_operator(np.eye(3), k=1, name="a", operation="t"), np.ones(3), options=CgOptions(method="lu")
        )
    no_transpose = type("NoTranspose", (), {"shape": (6, 14), "matvec": lambda self, v: np.zeros(6)})()
    dense = reference_ntk(model, x, mode="trace").numpy()
    with pytest.raises(InvalidInput, match="rmatvec"):
        gp_inference(dense, y, no_transpose, np.ones(6), solver="cg")


def test_auto_runs_batched_on_a_dense_kernel_and_block_on_an_operator() -> None:
    # NOTE [cg method]: on a dense kernel a product is cheap and block CG's small algebra is not; on an operator
    # every product is a pass over the data and block CG's fewer products win
    model, (x, _) = _mlp(), _data()
    dense = compute_ntk(model, x, mode="trace").theta.numpy()
    b = np.random.default_rng(3).standard_normal((14, K))
    expected = np.linalg.solve(dense / K + 1e-2 * np.eye(14), b)  # TRACE read as (trace / k) ⊗ I_k
    for kernel, method in ((dense, "batched"), (ntk_operator(model, x, mode="trace"), "block")):
        result = conjugate_gradients(
            kernel_operator(kernel, k=K, name="theta", operation="t"), b, ridge=1e-2, options=CgOptions(rtol=1e-12)
        )
        assert result.method == method and result.converged
        assert _rel(result.solution, expected) < 1e-9
