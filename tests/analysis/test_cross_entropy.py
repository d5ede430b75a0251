"""loss="cross_entropy" in linearized_predictions against independent references:

- gradient descent: linearize(model) really trained with torch.optim.SGD on nn.CrossEntropyLoss(), kernels from
  compute_ntk in float64 (≤ 1e-8);
- TRACE: the iterate written out by hand with numpy and np.kron(trace / k, I_k);
- gradient flow: a hand-written RK4 with many small steps, and small-step gradient descent converging to it at
  first order (the error halves with the step).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.analysis import linearize, linearized_predictions
from ntk_service.errors import InvalidInput, ResourceLimit, ShapeMismatch
from ntk_service.kernels import compute_ntk
from tests.analysis.conftest import Features, make_features


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _softmax_grad(f: np.ndarray, labels: np.ndarray) -> np.ndarray:
    p = np.exp(f - f.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return (p - np.eye(f.shape[1])[labels]) / f.shape[0]


def test_gradient_descent_equals_sgd_on_the_linearized_network() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3)).double()
    x_train, x_test = torch.randn(8, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 2, 1])
    theta = compute_ntk(model, x_train, dtype="float64").theta
    theta_test = compute_ntk(model, x_test, x_train, dtype="float64").theta
    with torch.no_grad():
        f0_train, f0_test = model(x_train), model(x_test)
    lr, steps = 2.0, [0, 1, 7, 40]
    flin = linearize(model)
    opt = torch.optim.SGD(flin.parameters(), lr=lr)
    trained = {}
    for s in range(max(steps) + 1):
        with torch.no_grad():
            trained[s] = (flin(x_train).numpy(), flin(x_test).numpy())
        opt.zero_grad()
        nn.CrossEntropyLoss()(flin(x_train), labels).backward()
        opt.step()
    out = linearized_predictions(
        theta,
        labels,
        times=steps,
        learning_rate=lr,
        loss="cross_entropy",
        k_test_train=theta_test,
        f0_train=f0_train,
        f0_test=f0_test,
        flow="gradient_descent",
    )
    assert out.train.shape == (4, 8, 3) and out.test is not None and out.test.shape == (4, 5, 3)
    for i, s in enumerate(steps):
        assert _rel(out.train[i], trained[s][0]) <= 1e-8
        assert _rel(out.test[i], trained[s][1]) <= 1e-8
    assert np.max(np.abs(out.train[-1] - out.train[0])) > 0.5  # training moved the logits
    assert out.rtol is None and "exact function-space steps" in out.path
    assert math.isclose(out.max_learning_rate, 4 * 8 / np.linalg.eigvalsh(out_matrix(theta))[-1], rel_tol=1e-12)


def out_matrix(theta: torch.Tensor) -> np.ndarray:
    n, _, k, _ = theta.shape
    return theta.permute(0, 2, 1, 3).reshape(n * k, n * k).numpy()


def test_trace_kernel_is_trace_over_k_kron_identity(features: Features) -> None:
    k, n = 3, 7
    base = features.matrix[::k, ::k]  # any PSD (N, N) matrix T: the FULL kernel is T ⊗ I_k, its trace is k·T
    trace, trace_test = k * base, k * features.test_matrix[::k, ::k]
    labels = np.arange(n) % k
    rng = np.random.default_rng(1)
    f0, f0_test = rng.standard_normal((n, k)), rng.standard_normal((4, k))
    big, big_test = np.kron(base, np.eye(k)), np.kron(features.test_matrix[::k, ::k], np.eye(k))
    f, f_test = f0.copy(), f0_test.copy()
    lr = 3.0
    for _ in range(12):
        g = _softmax_grad(f, labels).reshape(-1)
        f, f_test = f - lr * (big @ g).reshape(n, k), f_test - lr * (big_test @ g).reshape(4, k)
    out = linearized_predictions(
        trace,
        labels,
        times=[12],
        learning_rate=lr,
        loss="cross_entropy",
        flow="gradient_descent",
        k_test_train=trace_test,
        f0_train=f0,
        f0_test=f0_test,
    )
    assert _rel(out.train[0], f) <= 1e-12 and out.test is not None and _rel(out.test[0], f_test) <= 1e-12


def _rk4(matrix: np.ndarray, test_matrix: np.ndarray, f0, f0_test, labels, rate: float, t: float, steps: int):
    """Hand-written RK4 of d[f; f*]/dt = −rate·[Θ; Θ*] vec(∇_f L(f))."""
    n, k = f0.shape
    stacked = np.vstack([matrix, test_matrix])

    def v(state):
        return -rate * (stacked @ _softmax_grad(state[:n], labels).reshape(-1)).reshape(-1, k)

    state, h = np.vstack([f0, f0_test]), t / steps
    for _ in range(steps):
        k1 = v(state)
        k2 = v(state + h / 2 * k1)
        k3 = v(state + h / 2 * k2)
        k4 = v(state + h * k3)
        state = state + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return state[:n], state[n:]


def test_gradient_flow_matches_rk4_and_small_step_descent() -> None:
    feats = make_features(n=6, m=3, k=3, p=50, seed=2)
    labels = np.array([0, 1, 2, 2, 1, 0])
    rng = np.random.default_rng(0)
    f0, f0_test = 0.3 * rng.standard_normal((6, 3)), 0.3 * rng.standard_normal((3, 3))
    lr, t = 4.0, 25.0
    out = linearized_predictions(
        feats.theta,
        labels,
        times=[0.0, t],
        learning_rate=lr,
        loss="cross_entropy",
        k_test_train=feats.theta_test,
        f0_train=f0,
        f0_test=f0_test,
    )
    want, want_test = _rk4(feats.matrix, feats.test_matrix, f0, f0_test, labels, lr, t, 2000)
    assert out.test is not None
    assert _rel(out.train[1], want) <= 1e-8 and _rel(out.test[1], want_test) <= 1e-8
    np.testing.assert_array_equal(out.train[0], f0)
    assert out.rtol == 1e-10 and out.atol == 1e-12 and "solve_ivp DOP853" in out.path
    assert np.max(np.abs(out.train[1] - f0)) > 0.5
    # gradient descent with m steps per unit of time at η/m is Euler on the same flow: error O(1/m)
    errors = []
    for m in (4, 8, 16):
        gd = linearized_predictions(
            feats.theta,
            labels,
            times=[t * m],
            learning_rate=lr / m,
            loss="cross_entropy",
            flow="gradient_descent",
            f0_train=f0,
        )
        errors.append(np.max(np.abs(gd.train[0] - out.train[1])))
    assert errors[0] / errors[1] == pytest.approx(2.0, rel=0.15) and errors[1] / errors[2] == pytest.approx(
        2.0, rel=0.1
    )


def test_bad_inputs_are_refused(features: Features) -> None:
    labels = np.arange(7) % 3

    def call(y=labels, **kwargs):
        options = {"times": [1], "learning_rate": 0.1, "loss": "cross_entropy", "flow": "gradient_descent"}
        return linearized_predictions(kwargs.pop("theta", features.theta), y, **(options | kwargs))

    with pytest.raises(InvalidInput, match="integer class indices.*got dtype float64"):
        call(labels.astype(np.float64))
    with pytest.raises(InvalidInput, match="class index 3, outside \\[0, 3\\)"):
        call(np.array([0, 1, 2, 3, 0, 1, 2]))
    with pytest.raises(InvalidInput, match="class index -1"):
        call(np.array([0, 1, 2, -1, 0, 1, 2]))
    with pytest.raises(ShapeMismatch, match="shape \\(7, 3\\).*shape \\(7,\\)"):
        call(np.zeros((7, 3), dtype=np.int64))
    with pytest.raises(ShapeMismatch, match="shape \\(5,\\)"):
        call(labels[:5])
    with pytest.raises(InvalidInput, match="no t = inf limit"):
        call(times=[1, math.inf], flow="gradient_flow")
    with pytest.raises(InvalidInput, match="TRACE kernel does not say how many classes"):
        call(theta=features.matrix[::3, ::3])
    with pytest.raises(ResourceLimit, match="multiply-adds, above the limit"):
        call(times=[10**12])
    with pytest.raises(InvalidInput, match="step counts and must be integers"):
        call(times=[1.5])


def test_a_flow_past_its_work_limit_is_stopped_with_a_resource_limit() -> None:
    from ntk_service.analysis.cross_entropy import _integrate

    def velocity(state: np.ndarray) -> np.ndarray:
        return -state

    out, path = _integrate(velocity, np.ones((2, 2)), np.array([0.0, 1.0]), rtol=1e-10, atol=1e-12,
                           max_evaluations=10_000)  # fmt: skip
    np.testing.assert_allclose(out[1], np.exp(-1.0) * np.ones((2, 2)), rtol=1e-9)  # e^{-t}, by hand
    assert "evaluations" in path
    with pytest.raises(ResourceLimit, match="needed more than 10 evaluations"):
        _integrate(velocity, np.ones((2, 2)), np.array([5.0]), rtol=1e-10, atol=1e-12, max_evaluations=10)
