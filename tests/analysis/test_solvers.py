"""Solvers on operators against dense float64 references: numpy / scipy solves, expm and eigvalsh on the kernel of
tests/reference.py (an independent per-example autograd loop), never another path of ours."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import scipy.sparse.linalg
import torch
from torch import nn

from ntk_service.analysis import gp_inference, linearized_predictions, max_learning_rate, spectrum
from ntk_service.analysis.solve import CgOptions, conjugate_gradients, kernel_operator, nystrom_preconditioner
from ntk_service.errors import InvalidInput, NonFiniteInput, ShapeMismatch
from ntk_service.kernels import ntk_operator
from tests.analysis.conftest import Features
from tests.reference import reference_ntk

K = 3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, K)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(1)
    x_train = torch.randn(12, 4, generator=g, dtype=torch.float64)
    x_test = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y = np.random.default_rng(2).standard_normal((12, K))
    return x_train, x_test, y


def _example_major(full: torch.Tensor) -> np.ndarray:
    n, m, k, _ = full.shape
    return full.permute(0, 2, 1, 3).reshape(n * k, m * k).numpy()


def _rel(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize("mode", ["full", "trace"])
@pytest.mark.parametrize("preconditioner", ["nystrom", "none"])
def test_cg_on_the_operator_equals_the_dense_solve(mode: str, preconditioner: str) -> None:
    model = _mlp()
    x_train, x_test, y = _data()
    lam = 1e-2
    if mode == "full":
        a = _example_major(reference_ntk(model, x_train))
        c = _example_major(reference_ntk(model, x_test, x_train))
        expected = (c @ np.linalg.solve(a + lam * np.eye(a.shape[0]), y.reshape(-1))).reshape(-1, K)
    else:  # our TRACE kernel is the sum over outputs, read as (trace / k) ⊗ I_k (NOTE [layout])
        a = reference_ntk(model, x_train, mode="trace").numpy() / K
        c = reference_ntk(model, x_test, x_train, mode="trace").numpy() / K
        expected = c @ np.linalg.solve(a + lam * np.eye(a.shape[0]), y)
    train_op = ntk_operator(model, x_train, mode=mode)
    cross_op = ntk_operator(model, x_test, x_train, mode=mode)
    options = CgOptions(rtol=1e-12, preconditioner=preconditioner, landmarks=8)  # type: ignore[arg-type]
    posterior = gp_inference(train_op, y, cross_op, ridge=lam, cg=options)
    assert posterior.solver == "cg" and posterior.solve is not None and posterior.solve.converged
    assert posterior.mean.shape == (5, K)
    assert _rel(posterior.mean, expected) <= 1e-6
    # the weights are the dense α too, and the cost is reported
    alpha = np.linalg.solve(a + lam * np.eye(a.shape[0]), y.reshape(-1) if mode == "full" else y)
    assert _rel(posterior.solve.solution.reshape(alpha.shape), alpha) <= 1e-6
    assert posterior.solve.iterations >= 1 and posterior.solve.time_s > 0
    assert posterior.solve.passes == posterior.solve.products * (K if mode == "trace" else 1)


def test_nystrom_cuts_iterations_on_a_decaying_spectrum() -> None:
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((200, 200)))
    a = (q * np.logspace(2, -2, 200)) @ q.T  # condition 10⁴ before the ridge
    b = rng.standard_normal(200)
    op = kernel_operator(a, k=1, name="a", operation="test")  # 2-D array: a TRACE-style (n, n) kernel with k = 1
    plain = conjugate_gradients(op, b, ridge=1e-2, options=CgOptions(rtol=1e-10, preconditioner="none"))
    for method in ("uniform", "pivoted_cholesky", "gaussian"):
        pre = conjugate_gradients(
            op,
            b,
            ridge=1e-2,
            options=CgOptions(rtol=1e-10, preconditioner="nystrom", landmarks=60, landmark_method=method),  # type: ignore[arg-type]
        )
        assert pre.converged and plain.converged
        # theory: √κ falls from √(100 / 0.02) to about √(λ₆₁ / 0.02) ≈ √315, i.e. 4x; measured 2.2-2.4x
        assert pre.iterations < 0.6 * plain.iterations, (method, pre.iterations, plain.iterations)
        assert _rel(pre.solution[:, 0], np.linalg.solve(a + 1e-2 * np.eye(200), b)) <= 1e-6


def test_a_solve_that_does_not_converge_says_so() -> None:
    model = _mlp()
    x_train, x_test, y = _data()
    train_op, cross_op = ntk_operator(model, x_train), ntk_operator(model, x_test, x_train)
    posterior = gp_inference(
        train_op, y, cross_op, ridge=1e-6, cg=CgOptions(rtol=1e-12, max_iterations=2, preconditioner="none")
    )
    assert posterior.solve is not None and not posterior.solve.converged
    assert posterior.solve.stop_reason == "max_iterations" and posterior.solve.iterations == 2
    assert posterior.solver.startswith("cg (not converged: max_iterations")
    assert float(posterior.solve.residual.max()) > 1e-12
    # an indefinite "kernel" breaks CG down, and that is reported, not returned as an answer
    op = kernel_operator(-np.eye(6), k=1, name="a", operation="test")
    broken = conjugate_gradients(op, np.ones(6), options=CgOptions(preconditioner="none"))
    assert not broken.converged and broken.stop_reason.startswith("breakdown")
    # linearized at t = ∞ through a capped CG also says so
    out = linearized_predictions(
        train_op, y, times=[math.inf], learning_rate=1.0, cg=CgOptions(max_iterations=1, preconditioner="none")
    )
    assert not out.converged and "NOT CONVERGED" in out.path


def test_warm_start_and_several_columns() -> None:
    rng = np.random.default_rng(3)
    j = rng.standard_normal((30, 50))
    a = j @ j.T
    b = rng.standard_normal((30, 4))
    op = kernel_operator(scipy.sparse.linalg.aslinearoperator(a), k=1, name="a", operation="test")
    first = conjugate_gradients(op, b, ridge=0.1, options=CgOptions(rtol=1e-12))
    assert first.converged and first.solution.shape == (30, 4)
    assert _rel(first.solution, np.linalg.solve(a + 0.1 * np.eye(30), b)) <= 1e-9
    again = conjugate_gradients(
        op, b, ridge=0.1, options=CgOptions(rtol=1e-10, preconditioner="none"), x0=first.solution
    )
    assert again.converged and again.iterations == 0 and again.products == 4  # only the residual check
    zero = conjugate_gradients(op, np.zeros(30), options=CgOptions(preconditioner="none"))
    assert zero.converged and not np.any(zero.solution)


def test_linearized_on_the_operator_matches_expm_and_the_dense_solve() -> None:
    model = _mlp()
    x_train, x_test, y = _data()
    a = _example_major(reference_ntk(model, x_train))
    c = _example_major(reference_ntk(model, x_test, x_train))
    lr, lam, n = 0.5, 1e-3, a.shape[0]
    rate = lr * 2.0 / n  # MSELoss(): c = 2 / (N·k)
    f0 = np.random.default_rng(5).standard_normal(y.shape)
    r0 = (f0 - y).reshape(-1)
    a_lam = a + lam * np.eye(n)
    times = [0.0, 3.0, 40.0, math.inf]
    out = linearized_predictions(
        ntk_operator(model, x_train),
        y,
        times=times,
        learning_rate=lr,
        k_test_train=ntk_operator(model, x_test, x_train),
        f0_train=f0,
        ridge=lam,
        cg=CgOptions(rtol=1e-12),
    )
    assert out.converged and out.train.shape == (4, 12, K) and out.test is not None and out.test.shape == (4, 5, K)
    for i, t in enumerate(times):
        if math.isinf(t):
            train = y.reshape(-1)
            test = -c @ np.linalg.solve(a_lam, r0)
        else:
            decay = scipy.linalg.expm(-rate * t * a_lam)
            train = y.reshape(-1) + decay @ r0
            test = -c @ np.linalg.solve(a_lam, (np.eye(n) - decay) @ r0)
        assert np.abs(out.train[i].reshape(-1) - train).max() <= 1e-6 * np.abs(train).max()
        if t > 0:
            assert _rel(out.test[i].reshape(-1), test) <= 1e-6
    expected_limit = 2.0 / (2.0 / n * float(np.linalg.eigvalsh(a_lam)[-1]))
    assert out.max_learning_rate == pytest.approx(expected_limit, rel=1e-8)
    op = ntk_operator(model, x_train)
    assert max_learning_rate(op) == pytest.approx(2.0 / (2.0 / n * float(np.linalg.eigvalsh(a)[-1])), rel=1e-8)


def test_max_learning_rate_and_spectrum_on_a_trace_operator() -> None:
    model = _mlp()
    x_train, _, _ = _data()
    trace = reference_ntk(model, x_train, mode="trace").numpy()
    op = ntk_operator(model, x_train, mode="trace")
    n = trace.shape[0]
    # read as (trace / k) ⊗ I_k: λmax(trace) / k, and MSELoss over N·k entries
    assert max_learning_rate(op) == pytest.approx(n * K / (float(np.linalg.eigvalsh(trace)[-1]) / K), rel=1e-8)
    s = spectrum(op, top=2, bottom=2)
    dense = np.linalg.eigvalsh(trace)
    np.testing.assert_allclose(s.eigenvalues, [dense[-1], dense[-2], dense[1], dense[0]], rtol=1e-8)
    assert s.lambda_min == pytest.approx(dense[0], rel=1e-8) and s.condition_number == pytest.approx(
        dense[-1] / dense[0], rel=1e-8
    )


def test_bad_input_is_refused_with_what_to_fix() -> None:
    model = _mlp()
    x_train, x_test, y = _data()
    train_op, cross_op = ntk_operator(model, x_train), ntk_operator(model, x_test, x_train)
    for ridge in (-1.0, float("nan")):
        with pytest.raises(InvalidInput, match="ridge must be a finite number ≥ 0"):
            gp_inference(train_op, y, cross_op, ridge=ridge)
        with pytest.raises(InvalidInput, match="ridge must be a finite number ≥ 0"):
            linearized_predictions(train_op, y, times=[1.0], learning_rate=1.0, ridge=ridge)
    with pytest.raises(ShapeMismatch, match="has 12 examples on its rows, the targets and the other kernel need 10"):
        gp_inference(train_op, y[:10], cross_op)  # y has 10 rows, the operator 12 examples
    with pytest.raises(ShapeMismatch, match="FULL operator with k = 3"):
        gp_inference(train_op, y[:, :2], cross_op)
    with pytest.raises(ShapeMismatch, match="columns"):
        gp_inference(train_op, y, ntk_operator(model, x_test))  # Θ(x_test, x_test) is not Θ(x_test, x_train)
    with pytest.raises(InvalidInput, match="k_test_test is an operator, whose diagonal is not known"):
        gp_inference(train_op, y, cross_op, ntk_operator(model, x_test))
    foreign = scipy.sparse.linalg.aslinearoperator(np.eye(36))  # an operator with no model behind it
    with pytest.raises(InvalidInput, match="relative"):
        gp_inference(foreign, y, np.ones((5, 12, K, K)), ridge=0.1, ridge_scale="relative")
    with pytest.raises(InvalidInput, match="unknown solver"):
        gp_inference(train_op, y, cross_op, solver="lu")
    with pytest.raises(InvalidInput, match="needs the kernel's diagonal"):
        nystrom_preconditioner(
            kernel_operator(train_op, k=K, name="a", operation="t"), ridge=0, method="pivoted_cholesky"
        )
    with pytest.raises(NonFiniteInput):
        conjugate_gradients(kernel_operator(np.eye(3), k=1, name="a", operation="t"), np.array([1.0, np.nan, 0.0]))
    with pytest.raises(InvalidInput, match="n_outputs"):
        max_learning_rate(scipy.sparse.linalg.aslinearoperator(np.eye(4)))


def test_cg_on_dense_kernels_equals_the_numpy_solve(features: Features) -> None:
    """solver="cg" also takes the dense arrays compute_ntk returns (the Jacobian-feature kernels of conftest)."""
    y = np.random.default_rng(4).standard_normal((7, 3))
    expected = features.test_matrix @ np.linalg.solve(features.matrix + 0.05 * np.eye(21), y.reshape(-1))
    post = gp_inference(features.theta, y, features.theta_test, ridge=0.05, solver="cg", cg=CgOptions(rtol=1e-12))
    assert post.solve is not None and post.solve.converged and post.solve.passes == 0
    assert _rel(post.mean.reshape(-1), expected) <= 1e-9
    relative = gp_inference(features.theta, y, features.theta_test, ridge=0.1, ridge_scale="relative", solver="cg")
    lam = 0.1 * float(np.mean(np.diag(features.matrix)))
    expected = features.test_matrix @ np.linalg.solve(features.matrix + lam * np.eye(21), y.reshape(-1))
    assert relative.ridge == pytest.approx(lam) and _rel(relative.mean.reshape(-1), expected) <= 1e-6
    s = spectrum(features.theta, top=1, bottom=2)
    dense = np.linalg.eigvalsh(features.matrix)
    np.testing.assert_allclose(s.eigenvalues, [dense[-1], dense[1], dense[0]], rtol=1e-7, atol=1e-12)


def test_auto_builds_the_preconditioner_only_from_its_size_threshold() -> None:
    from ntk_service.analysis.solve import AUTO_NYSTROM_MIN_SIZE

    for n, expected in ((AUTO_NYSTROM_MIN_SIZE - 1, "none"), (AUTO_NYSTROM_MIN_SIZE, "nystrom(uniform, m=100")):
        d = np.linspace(1.0, 2.0, n)
        diagonal = scipy.sparse.linalg.LinearOperator((n, n), matvec=lambda v, d=d: d * v.reshape(-1), dtype=float)
        result = conjugate_gradients(kernel_operator(diagonal, k=1, name="a", operation="t"), np.ones(n))
        assert result.converged and result.preconditioner.startswith(expected)
        np.testing.assert_allclose(result.solution[:, 0], 1.0 / d, rtol=1e-7)


def test_a_solve_below_the_products_rounding_says_so() -> None:
    """float32 products of a kernel of condition 10⁴ leave a true residual near 1e-4: the recursive residual gets to
    rtol = 1e-5, the recomputed one does not, and after the warm restarts the result says "rounding", not
    converged (numpy's float64 residual of the returned solution confirms it is above rtol)."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((120, 120)))
    a = (q * np.logspace(3, -1, 120)) @ q.T
    a32 = a.astype(np.float32)

    class Float32Kernel:
        shape = a.shape

        def matvec(self, v: np.ndarray) -> np.ndarray:
            return a32 @ v.astype(np.float32)

    b = rng.standard_normal(120)
    op = kernel_operator(Float32Kernel(), k=1, name="a", operation="test")
    result = conjugate_gradients(op, b, options=CgOptions(rtol=1e-5, preconditioner="none", max_iterations=2000))
    assert not result.converged and result.stop_reason.startswith("rounding: after 3 warm restarts")
    assert result.iterations < 2000
    assert np.linalg.norm(b - a32.astype(np.float64) @ result.solution[:, 0]) / np.linalg.norm(b) > 1e-5
