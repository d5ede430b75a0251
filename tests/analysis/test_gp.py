"""gp_inference against scikit-learn's KernelRidge(kernel="precomputed") and the covariance written with solves."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.kernel_ridge import KernelRidge

from ntk_service.analysis import gp_inference
from ntk_service.errors import InvalidInput, ShapeMismatch
from tests.analysis.conftest import Features, make_features


def test_mean_matches_kernel_ridge_and_covariance_the_formula(features: Features) -> None:
    y = np.random.default_rng(0).standard_normal((7, 3))
    post = gp_inference(features.theta, y, features.theta_test, features.theta_test_test, ridge=1e-2)
    ridge = KernelRidge(alpha=1e-2, kernel="precomputed").fit(features.matrix, y.reshape(-1))
    np.testing.assert_allclose(post.mean.reshape(-1), ridge.predict(features.test_matrix), rtol=1e-10, atol=1e-12)
    a = features.matrix + 1e-2 * np.eye(21)
    jt = features.j_test.reshape(12, -1)
    want = jt @ jt.T - features.test_matrix @ np.linalg.solve(a, features.test_matrix.T)
    assert post.covariance is not None and post.covariance.shape == (12, 12)
    np.testing.assert_allclose(post.covariance, want, rtol=0, atol=1e-12)
    assert post.solver == "cholesky" and post.jitter == 0.0


def test_relative_ridge_scales_by_the_mean_diagonal(features: Features) -> None:
    y = np.random.default_rng(1).standard_normal((7, 3))
    post = gp_inference(features.theta, y, features.theta_test, ridge=0.5, ridge_scale="relative")
    lam = 0.5 * np.mean(np.diag(features.matrix))
    assert post.ridge == pytest.approx(lam, rel=1e-14)
    want = features.test_matrix @ np.linalg.solve(features.matrix + lam * np.eye(21), y.reshape(-1))
    np.testing.assert_allclose(post.mean.reshape(-1), want, rtol=1e-11, atol=1e-13)


def test_trace_kernel_is_trace_over_k_for_every_output(features: Features) -> None:
    y = np.random.default_rng(2).standard_normal((7, 3))
    trace, trace_test = np.einsum("nmaa->nm", features.theta), np.einsum("nmaa->nm", features.theta_test)
    post = gp_inference(trace, y, trace_test, ridge=1e-3)
    ridge = KernelRidge(alpha=1e-3, kernel="precomputed").fit(trace / 3, y)
    np.testing.assert_allclose(post.mean, ridge.predict(trace_test / 3), rtol=1e-10, atol=1e-12)


def test_singular_and_non_psd_kernels_stay_finite() -> None:
    f = make_features(n=6, m=3, k=2, p=4, seed=3)  # rank 4 of 12: Cholesky at ridge 0 fails, jitter rescues
    y = np.random.default_rng(4).standard_normal((6, 2))
    post = gp_inference(f.theta, y, f.theta_test, f.theta_test_test)
    assert np.all(np.isfinite(post.mean)) and post.covariance is not None and np.all(np.isfinite(post.covariance))
    assert post.solver in ("cholesky+jitter", "eigen pseudo-inverse")
    lam, vec = np.linalg.eigh(f.matrix)
    lam[-1] = -5.0
    theta = ((vec * lam) @ vec.T).reshape(6, 2, 6, 2).transpose(0, 2, 1, 3)
    post = gp_inference(theta, y, f.theta_test, f.theta_test_test)
    assert post.solver == "eigen pseudo-inverse" and post.lambda_min == pytest.approx(-5.0)
    assert np.all(np.isfinite(post.mean)) and post.covariance is not None and np.all(np.isfinite(post.covariance))


def test_bad_inputs(features: Features) -> None:
    with pytest.raises(ShapeMismatch, match="expected \\(7, k\\)"):
        gp_inference(features.theta, np.zeros(5), features.theta_test)
    with pytest.raises(ShapeMismatch, match="training examples"):
        gp_inference(features.theta, np.zeros((7, 3)), features.theta_test[:, :3])
    with pytest.raises(InvalidInput, match="ridge must be"):
        gp_inference(features.theta, np.zeros((7, 3)), features.theta_test, ridge=-1.0)
