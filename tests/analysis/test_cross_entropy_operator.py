"""loss="cross_entropy" on kernel operators (NtkOperator, FULL and TRACE) against hand-written numpy loops on the
dense float64 kernel of tests/reference.py: softmax gradient descent, and RK4 for the gradient flow."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg
import torch
from torch import nn

from ntk_service.analysis import linearized_predictions
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.operators.linear_operator import ntk_operator
from tests.reference import reference_ntk

N, M, K = 6, 3, 3


def _softmax_grad(f: np.ndarray, labels: np.ndarray) -> np.ndarray:
    p = np.exp(f - f.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return (p - np.eye(f.shape[1])[labels]) / f.shape[0]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, K)).double()
    x, x_test = torch.randn(N, 4, dtype=torch.float64), torch.randn(M, 4, dtype=torch.float64)
    with torch.no_grad():
        f0, f0_test = model(x).numpy(), model(x_test).numpy()
    return model, x, x_test, f0, f0_test, np.array([0, 1, 2, 2, 1, 0])


def _dense(model, x1, x2, mode: str) -> np.ndarray:
    """The operator's action as a dense matrix by hand: FULL (n·k, m·k) example-major, TRACE trace / k ⊗ I_k."""
    theta = reference_ntk(model, x1, x2, mode=mode).numpy()
    if mode == "full":
        n, m = theta.shape[:2]
        return theta.transpose(0, 2, 1, 3).reshape(n * K, m * K)
    return np.kron(theta / K, np.eye(K))


def _velocity(model, x, x_test, labels, rate, mode):
    stacked = np.vstack([_dense(model, x, None, mode), _dense(model, x_test, x, mode)])
    return lambda s: -rate * (stacked @ _softmax_grad(s[:N], labels).reshape(-1)).reshape(-1, K)


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_descent_and_flow_on_an_operator_match_hand_written_loops(setup, mode: str) -> None:
    model, x, x_test, f0, f0_test, labels = setup
    op, op_test = ntk_operator(model, x, mode=mode), ntk_operator(model, x_test, x, mode=mode)
    lr = 2.0
    v = _velocity(model, x, x_test, labels, lr, mode)
    state = np.vstack([f0, f0_test])
    for _ in range(9):
        state = state + v(state)
    gd = linearized_predictions(op, labels, times=[0, 9], learning_rate=lr, loss="cross_entropy",
        flow="gradient_descent", k_test_train=op_test, f0_train=f0, f0_test=f0_test)  # fmt: skip
    np.testing.assert_array_equal(gd.train[0], f0)
    np.testing.assert_allclose(gd.train[1], state[:N], rtol=0, atol=1e-10 * np.abs(state).max())
    assert gd.test is not None
    np.testing.assert_allclose(gd.test[1], state[N:], rtol=0, atol=1e-10 * np.abs(state).max())
    assert np.abs(state[:N] - f0).max() > 1e-2  # it moved
    assert f"{mode} operator" in gd.path and "Lanczos" in gd.path and np.isnan(gd.lambda_min)
    lam_max = np.linalg.eigvalsh(_dense(model, x, None, mode))[-1]
    assert gd.lambda_max == pytest.approx(lam_max, rel=1e-8)
    assert gd.max_learning_rate == pytest.approx(4 * N / lam_max, rel=1e-8)
    # gradient flow to t = 5 against RK4 with 500 steps
    t, steps = 5.0, 500
    state, h = np.vstack([f0, f0_test]), t / steps
    for _ in range(steps):
        k1 = v(state)
        k2 = v(state + h / 2 * k1)
        k3 = v(state + h / 2 * k2)
        k4 = v(state + h * k3)
        state = state + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    flow = linearized_predictions(op, labels, times=[t], learning_rate=lr, loss="cross_entropy",
                                  k_test_train=op_test, f0_train=f0, f0_test=f0_test)  # fmt: skip
    assert flow.test is not None and flow.rtol == 1e-10 and "solve_ivp DOP853" in flow.path
    scale = np.abs(state).max()
    np.testing.assert_allclose(flow.train[0], state[:N], rtol=0, atol=1e-8 * scale)
    np.testing.assert_allclose(flow.test[0], state[N:], rtol=0, atol=1e-8 * scale)


def test_an_absolute_ridge_on_a_scipy_operator_matches_the_hand_written_loop(setup) -> None:
    model, x, _, f0, _, labels = setup
    dense = _dense(model, x, None, "full")
    op = scipy.sparse.linalg.aslinearoperator(dense)
    lr, ridge = 1.5, 0.3
    f = f0.copy()
    for _ in range(5):
        f = f - lr * ((dense + ridge * np.eye(N * K)) @ _softmax_grad(f, labels).reshape(-1)).reshape(N, K)
    out = linearized_predictions(op, labels, times=[5], learning_rate=lr, loss="cross_entropy",
                                 flow="gradient_descent", f0_train=f0, ridge=ridge)  # fmt: skip
    np.testing.assert_allclose(out.train[0], f, rtol=0, atol=1e-11 * np.abs(f).max())
    assert out.test is None


def test_bad_input_on_an_operator_is_refused(setup) -> None:
    model, x, x_test, f0, _, labels = setup
    op = ntk_operator(model, x)
    call = dict(times=[1], learning_rate=0.1, loss="cross_entropy", flow="gradient_descent", f0_train=f0)
    with pytest.raises(InvalidInput, match="ridge_scale='relative' on an operator.*absolute ridge"):
        linearized_predictions(op, labels, ridge=0.1, ridge_scale="relative", **call)
    with pytest.raises(ShapeMismatch, match="6 examples on its rows.*need 4"):
        linearized_predictions(op, labels[:4], **call)
    with pytest.raises(ShapeMismatch, match="k_train_train.*5 examples"):
        linearized_predictions(ntk_operator(model, x[:5]), labels, **call)
    with pytest.raises(ShapeMismatch, match="k_test_train"):
        linearized_predictions(op, labels, k_test_train=ntk_operator(model, x_test, x[:4]), **call)
    with pytest.raises(InvalidInput, match="integer class indices"):
        linearized_predictions(op, labels.astype(float), **call)
