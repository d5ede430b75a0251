"""linearized_predictions and max_learning_rate against independent references.

- gradient_descent: the linearized network f0 + J(θ − θ0) really trained with torch.func (jvp inside grad) for s
  steps of SGD on MSELoss(), kernels from compute_ntk in float64;
- gradient_flow: the ODE df/dt = −η·c·Θ(f − y) integrated by RK4 with many small steps;
- t = ∞: the pseudo-inverse limit written with numpy.linalg.pinv / a plain solve.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jvp

from ntk_service.analysis import linearized_predictions, max_learning_rate
from ntk_service.errors import InvalidInput, ShapeMismatch, UnstableLearningRate
from ntk_service.kernels import compute_ntk
from tests.analysis.conftest import Features, make_features


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _train_linearized(model: nn.Module, x_train, y, x_test, *, lr: float, steps: int, loss: nn.Module):
    """SGD (full batch) on the linearized model; returns its train and test outputs after each step count."""
    p0 = {name: p.detach().clone() for name, p in model.named_parameters()}

    def f(params, x):
        return functional_call(model, params, (x,))

    def f_lin(params, x):
        delta = {name: params[name] - p0[name] for name in p0}
        out, tangent = jvp(lambda q: f(q, x), (p0,), (delta,))
        return out + tangent

    step = grad(lambda params: loss(f_lin(params, x_train), y))
    params = dict(p0)
    outputs = {0: (f_lin(params, x_train), f_lin(params, x_test))}
    for s in range(1, steps + 1):
        g = step(params)
        params = {name: params[name] - lr * g[name] for name in params}
        outputs[s] = (f_lin(params, x_train).detach(), f_lin(params, x_test).detach())
    return outputs


@pytest.mark.parametrize(("loss_name", "loss"), [("mse", nn.MSELoss()), ("sum", nn.MSELoss(reduction="sum"))])
def test_gradient_descent_equals_training_the_linearized_mlp(loss_name: str, loss: nn.Module) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 24), nn.Tanh(), nn.Linear(24, 2)).double()
    x_train, x_test = torch.randn(6, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    theta = compute_ntk(model, x_train, dtype="float64").theta
    theta_test = compute_ntk(model, x_test, x_train, dtype="float64").theta
    with torch.no_grad():
        f0_train, f0_test = model(x_train), model(x_test)
    # lr at half the stable limit, from an eigvalsh of the reshaped Jacobian kernel (independent of the code).
    lam_max = np.linalg.eigvalsh(theta.permute(0, 2, 1, 3).reshape(12, 12).numpy())[-1]
    c = 2 / 12 if loss_name == "mse" else 2.0
    lr = 0.5 * 2 / (c * lam_max)
    steps = [0, 1, 5, 30]
    trained = _train_linearized(model, x_train, y, x_test, lr=lr, steps=max(steps), loss=loss)
    out = linearized_predictions(
        theta,
        y,
        times=steps,
        learning_rate=lr,
        loss=loss_name,
        k_test_train=theta_test,
        f0_train=f0_train,
        f0_test=f0_test,
        flow="gradient_descent",
    )
    assert out.train.shape == (4, 6, 2) and out.test is not None and out.test.shape == (4, 4, 2)
    for i, s in enumerate(steps):
        want_train, want_test = (t.numpy() for t in trained[s])
        assert _rel(out.train[i], want_train) <= 1e-8
        assert _rel(out.test[i], want_test) <= 1e-8
    assert not np.allclose(out.train[-1], out.train[0])  # training moved the outputs


def _rk4(theta: np.ndarray, theta_test: np.ndarray, r0: np.ndarray, rate: float, t: float, steps: int):
    """Integrate dr/dt = −rate·Θ r and df*/dt = −rate·Θ* r; returns (r(t), f*(t) − f*(0))."""
    h = t / steps
    r, moved = r0.copy(), np.zeros(theta_test.shape[0])
    for _ in range(steps):
        k1 = -rate * theta @ r
        k2 = -rate * theta @ (r + h / 2 * k1)
        k3 = -rate * theta @ (r + h / 2 * k2)
        k4 = -rate * theta @ (r + h * k3)
        # f* integrates −rate·Θ* r, with the same stages
        moved += h / 6 * (-rate) * theta_test @ (r + 2 * (r + h / 2 * k1) + 2 * (r + h / 2 * k2) + (r + h * k3))
        r = r + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return r, moved


def test_gradient_flow_matches_many_small_rk4_steps(features: Features) -> None:
    rng = np.random.default_rng(3)
    n, k = 7, 3
    y, f0, f0_test = rng.standard_normal((n, k)), rng.standard_normal((n, k)), rng.standard_normal((4, k))
    lr, t = 0.7, 4.0
    out = linearized_predictions(
        features.theta,
        y,
        times=[t],
        learning_rate=lr,
        loss="half_mse",
        k_test_train=features.theta_test,
        f0_train=f0,
        f0_test=f0_test,
    )
    rate = lr / (n * k)
    r, moved = _rk4(features.matrix, features.test_matrix, (f0 - y).reshape(-1), rate, t, steps=2000)
    np.testing.assert_allclose(out.train[0], y + r.reshape(n, k), rtol=0, atol=1e-11)
    assert out.test is not None
    np.testing.assert_allclose(out.test[0], f0_test + moved.reshape(4, k), rtol=0, atol=1e-11)


def test_trace_kernel_stands_for_trace_over_k_kron_identity(features: Features) -> None:
    rng = np.random.default_rng(4)
    y = rng.standard_normal((7, 3))
    trace = np.einsum("nmaa->nm", features.theta)
    trace_test = np.einsum("nmaa->nm", features.theta_test)
    out = linearized_predictions(trace, y, times=[2.0], learning_rate=0.3, k_test_train=trace_test)
    big, big_test = np.kron(trace / 3, np.eye(3)), np.kron(trace_test / 3, np.eye(3))
    r, moved = _rk4(big, big_test, -y.reshape(-1), 2 / 21 * 0.3, 2.0, steps=1000)
    np.testing.assert_allclose(out.train[0], y + r.reshape(7, 3), rtol=0, atol=1e-11)
    assert out.test is not None
    np.testing.assert_allclose(out.test[0], moved.reshape(4, 3), rtol=0, atol=1e-11)


def test_infinite_time_is_the_pseudo_inverse_limit(features: Features) -> None:
    rng = np.random.default_rng(5)
    y, f0, f0_test = rng.standard_normal((7, 3)), rng.standard_normal((7, 3)), rng.standard_normal((4, 3))
    out = linearized_predictions(
        features.theta,
        y,
        times=[math.inf],
        learning_rate=1.0,
        k_test_train=features.theta_test,
        f0_train=f0,
        f0_test=f0_test,
    )
    r0 = (f0 - y).reshape(-1)
    want_test = f0_test.reshape(-1) - features.test_matrix @ np.linalg.solve(features.matrix, r0)
    np.testing.assert_allclose(out.train[0], y, rtol=0, atol=1e-10)
    assert out.test is not None
    np.testing.assert_allclose(out.test[0].reshape(-1), want_test, rtol=0, atol=1e-9)
    assert "pseudo-inverse" in out.path


def test_losses_map_onto_each_other_by_the_learning_rate(features: Features) -> None:
    y = np.random.default_rng(6).standard_normal((7, 3))
    nk = 21
    mse = linearized_predictions(features.theta, y, times=[1.0, 3.0], learning_rate=0.4, loss="mse")
    half = linearized_predictions(features.theta, y, times=[1.0, 3.0], learning_rate=0.8, loss="half_mse")
    total = linearized_predictions(features.theta, y, times=[1.0, 3.0], learning_rate=0.4 / nk, loss="sum")
    np.testing.assert_allclose(mse.train, half.train, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(mse.train, total.train, rtol=1e-13, atol=1e-14)


def test_non_psd_and_singular_kernels_give_finite_outputs() -> None:
    # Rank-deficient (P < N·k) plus an injected eigenvalue of −5: never a NaN, and the policy is reported.
    f = make_features(n=6, m=3, k=2, p=5, seed=7)
    matrix = f.matrix
    lam, vec = np.linalg.eigh(matrix)
    lam[0] = -5.0
    bad = (vec * lam) @ vec.T
    theta = bad.reshape(6, 2, 6, 2).transpose(0, 2, 1, 3)
    y = np.random.default_rng(8).standard_normal((6, 2))
    for flow, times in (("gradient_flow", [0.0, 1.0, 1e6, math.inf]), ("gradient_descent", [0, 3, 10**6, math.inf])):
        out = linearized_predictions(theta, y, times=times, learning_rate=0.1, k_test_train=f.theta_test, flow=flow)
        assert np.all(np.isfinite(out.train)) and out.test is not None and np.all(np.isfinite(out.test))
        assert out.lambda_min == pytest.approx(-5.0)
        assert out.frozen_modes >= 7 - 1  # the −5 mode and the null space (rank 5 of 12) do not move
    # a zero eigenvalue exactly: frozen, not 0/0
    zero = np.zeros((3, 3, 1, 1))
    zero[0, 0] = 1.0
    out = linearized_predictions(zero, np.ones(3), times=[1.0], learning_rate=0.1)
    assert np.all(np.isfinite(out.train))
    np.testing.assert_array_equal(out.train[0, 1:], 0.0)  # frozen: the outputs stay at f0 = 0


def test_max_learning_rate_is_the_edge_of_stability(features: Features) -> None:
    y = np.random.default_rng(9).standard_normal((7, 3))
    limit = max_learning_rate(features.theta, loss="mse")
    lam_max = np.linalg.eigvalsh(features.matrix)[-1]
    assert limit == pytest.approx(21 / lam_max, rel=1e-12)
    c = 2 / 21

    def residual_after(lr: float, steps: int = 400) -> float:
        f = np.zeros(21)
        for _ in range(steps):  # plain gradient descent in f, written out
            f = f - lr * c * features.matrix @ (f - y.reshape(-1))
        return float(np.linalg.norm(f - y.reshape(-1)))

    start = float(np.linalg.norm(y))
    assert residual_after(0.9 * limit) < start
    assert residual_after(1.1 * limit) > 1e6 * start
    with pytest.raises(UnstableLearningRate, match=f"stable limit {limit:.6g}"):
        linearized_predictions(features.theta, y, times=[10], learning_rate=1.1 * limit, flow="gradient_descent")
    converged = linearized_predictions(
        features.theta, y, times=[400], learning_rate=0.9 * limit, flow="gradient_descent"
    )
    assert np.linalg.norm(converged.train[0] - y) < start
    assert converged.max_learning_rate == pytest.approx(limit)


def test_max_learning_rate_of_a_trace_kernel_needs_k(features: Features) -> None:
    trace = np.einsum("nmaa->nm", features.theta)
    with pytest.raises(InvalidInput, match="pass n_outputs=k"):
        max_learning_rate(trace)
    lam = np.linalg.eigvalsh(np.kron(trace / 3, np.eye(3)))[-1]
    assert max_learning_rate(trace, n_outputs=3) == pytest.approx(21 / lam, rel=1e-12)
    assert max_learning_rate(trace, n_outputs=3, loss="sum") == pytest.approx(1 / lam, rel=1e-12)


def test_bad_inputs_are_refused(features: Features) -> None:
    y = np.zeros((7, 3))
    with pytest.raises(InvalidInput, match="times must be ≥ 0"):
        linearized_predictions(features.theta, y, times=[-1.0], learning_rate=0.1)
    with pytest.raises(InvalidInput, match="step counts"):
        linearized_predictions(features.theta, y, times=[1.5], learning_rate=0.1, flow="gradient_descent")
    with pytest.raises(ShapeMismatch, match="expected \\(7, k\\)"):
        linearized_predictions(features.theta, np.zeros((6, 3)), times=[1.0], learning_rate=0.1)
    with pytest.raises(ShapeMismatch, match="must be square"):
        linearized_predictions(features.theta_test, np.zeros((4, 3)), times=[1.0], learning_rate=0.1)
    with pytest.raises(InvalidInput, match="unknown loss"):
        linearized_predictions(features.theta, y, times=[1.0], learning_rate=0.1, loss="l1")
    with pytest.raises(InvalidInput, match="learning_rate must be a positive"):
        linearized_predictions(features.theta, y, times=[1.0], learning_rate=0.0)
    with pytest.raises(ShapeMismatch, match="k_test_train pairs"):
        linearized_predictions(
            features.theta, y, times=[1.0], learning_rate=0.1, k_test_train=features.theta_test[:, :5]
        )
