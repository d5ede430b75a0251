"""compare_training against independent references: a model linear in θ (its linearization is exact, its kernel
constant), and plain hand-written training loops of the network (torch) and of f0 + J(θ − θ0) (torch.func.jvp)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, jvp

from ntk_service.analysis import compare_training
from ntk_service.errors import InvalidInput, ShapeMismatch


def _data(n: int = 12, d: int = 4, k: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, k, (n,), generator=gen), torch.randn(5, d, generator=gen, dtype=torch.float64)


def test_a_model_linear_in_theta_has_no_gap_and_a_constant_kernel() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y, x_test = _data()
    out = compare_training(
        model,
        x,
        y,
        x_test,
        loss=nn.CrossEntropyLoss(),
        steps=15,
        batch_size=5,  # minibatches: a gap would open if the two sides saw different rows
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
        kernel_steps=[0, 7, 15],
    )
    assert out.test_gap is not None
    assert np.max(out.train_gap) <= 1e-12 and np.max(out.test_gap) <= 1e-12
    assert out.train_moved[-1] > 0.1  # it trained
    np.testing.assert_allclose(out.network_loss, out.linearized_loss, rtol=1e-12)
    assert out.network_loss[-1] < out.network_loss[0]
    np.testing.assert_array_equal(out.kernel_steps, [0, 7, 15])
    assert np.max(out.kernel_distance) <= 1e-12 and np.max(out.kernel_relative_change) <= 1e-12


def test_both_sides_match_hand_written_training_loops() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y, x_test = _data()
    lr, steps = 0.8, 20
    out = compare_training(model, x, y, x_test, loss=nn.CrossEntropyLoss(), steps=steps,
                           optimizer=lambda p: torch.optim.SGD(p, lr=lr))  # fmt: skip
    # the network: a plain loop on a deep copy
    net = copy.deepcopy(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net_losses, f_net = [], []
    for _ in range(steps + 1):
        with torch.no_grad():
            net_losses.append(float(nn.CrossEntropyLoss()(net(x), y)))
            f_net.append((net(x), net(x_test)))
        opt.zero_grad()
        nn.CrossEntropyLoss()(net(x), y).backward()
        opt.step()
    # the linearization: f0 + J(θ − θ0) by torch.func.jvp on dict parameters, SGD by hand
    p0 = {n: p.detach().clone() for n, p in model.named_parameters()}

    def f_lin(params, inputs):
        delta = {n: params[n] - p0[n] for n in p0}
        primal, tangent = jvp(lambda q: functional_call(model, q, (inputs,)), (p0,), (delta,))
        return primal + tangent

    params = {n: p.clone().requires_grad_(True) for n, p in p0.items()}
    lin_losses, gaps, test_gaps = [], [], []
    for s in range(steps + 1):
        value = nn.CrossEntropyLoss()(f_lin(params, x), y)
        lin_losses.append(float(value.detach()))
        with torch.no_grad():
            gaps.append(float((f_net[s][0] - f_lin(params, x)).pow(2).mean().sqrt()))
            test_gaps.append(float((f_net[s][1] - f_lin(params, x_test)).pow(2).mean().sqrt()))
        grads = torch.autograd.grad(value, list(params.values()))
        params = {
            n: (p - lr * g).detach().requires_grad_(True) for (n, p), g in zip(params.items(), grads, strict=True)
        }
    np.testing.assert_allclose(out.network_loss, net_losses, rtol=1e-12)
    np.testing.assert_allclose(out.linearized_loss, lin_losses, rtol=1e-10)
    np.testing.assert_allclose(out.train_gap, gaps, rtol=1e-8, atol=1e-14)
    assert out.test_gap is not None and out.test_moved is not None
    np.testing.assert_allclose(out.test_gap, test_gaps, rtol=1e-8, atol=1e-14)
    moved = [float((f_net[s][1] - f_net[0][1]).pow(2).mean().sqrt()) for s in range(steps + 1)]
    np.testing.assert_allclose(out.test_moved, moved, rtol=1e-12, atol=1e-15)
    assert out.train_gap[0] == 0.0 and out.train_gap[-1] > 1e-3  # a narrow net leaves its linearization
    assert out.kernel_distance[0] == 0.0 and out.kernel_distance[-1] > 0
    for p, q in zip(model.parameters(), p0.values(), strict=True):  # the caller's model did not train
        assert torch.equal(p, q)


def test_params_globs_train_the_same_subset_on_both_sides() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y, _ = _data()
    out = compare_training(model, x, y, loss=nn.CrossEntropyLoss(), steps=10, params=["2.*"])
    # only the readout trains: the network is linear in it, so the linearization is exact
    assert np.max(out.train_gap) <= 1e-12 and out.train_moved[-1] > 0
    assert out.test_gap is None


def test_bad_arguments() -> None:
    model = nn.Linear(4, 3).double()
    x, y, x_test = _data()
    ce = nn.CrossEntropyLoss()
    with pytest.raises(InvalidInput, match="steps must be an integer"):
        compare_training(model, x, y, loss=ce, steps=-1)
    with pytest.raises(InvalidInput, match="batch_size must be in \\[1, N = 12\\]"):
        compare_training(model, x, y, loss=ce, steps=1, batch_size=13)
    with pytest.raises(InvalidInput, match="kernel_steps must lie in \\[0, 3\\]"):
        compare_training(model, x, y, loss=ce, steps=3, kernel_steps=[5])
    with pytest.raises(ShapeMismatch, match="y_train has 11 rows"):
        compare_training(model, x, y[:11], loss=ce, steps=1)
    with pytest.raises(ShapeMismatch, match="x_test has per-example shape"):
        compare_training(model, x, y, x_test[:, :2], loss=ce, steps=1)
