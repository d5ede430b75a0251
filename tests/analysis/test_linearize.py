"""linearize / taylor_expand: the outputs against tests/reference.py's explicit float64 Jacobian and against the
network itself (the Taylor remainder's order by halving ε), and the parameter contract (names, order, optimizers,
state_dict, globs, frozen θ0, buffers in eval semantics)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ntk_service.analysis import linearize, taylor_expand
from ntk_service.errors import InvalidInput, NoMatchingParameters
from tests.reference import reference_columns, reference_jacobian


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def _flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params.values()])


def _random_step(flin: nn.Module, scale: float, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: scale * torch.randn(p.shape, generator=gen, dtype=p.dtype) for name, p in flin.named_parameters()}


def _move(flin: nn.Module, step: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in flin.named_parameters():
            p.add_(step[name])


def test_equals_f0_at_theta0_and_f0_plus_j_d_after_a_step() -> None:
    model = _mlp()
    x = torch.randn(5, 3, dtype=torch.float64)
    flin = linearize(model)
    with torch.no_grad():
        f0 = model(x)
    torch.testing.assert_close(flin(x), f0, rtol=0, atol=1e-14)
    d = _random_step(flin, 0.3)
    _move(flin, d)
    j = reference_jacobian(model, x)  # (N, k, P), named_parameters order
    want = f0 + torch.einsum("nkp,p->nk", j, _flat(d))
    got = flin(x)
    assert (got - f0).abs().max() > 0.1  # the step moved the output: the comparison is not vacuous
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_names_order_state_dict_and_optimizers() -> None:
    model = _mlp()
    flin = linearize(model)
    assert [n for n, _ in flin.named_parameters()] == [n for n, _ in model.named_parameters()]
    for (_, p), (_, q) in zip(flin.named_parameters(), model.named_parameters(), strict=True):
        assert p is not q and torch.equal(p, q)
    assert list(flin.state_dict()) == [n for n, _ in model.named_parameters()]  # θ0 and the base are not state
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    for opt in (torch.optim.SGD(flin.parameters(), lr=0.05, momentum=0.9), torch.optim.Adam(flin.parameters())):
        for _ in range(3):
            opt.zero_grad()
            nn.MSELoss()(flin(x), y).backward()
            opt.step()
    for name, p in model.named_parameters():  # the model and θ0 did not move
        assert torch.equal(p, before[name])
    torch.testing.assert_close(flin.theta0(), before)
    # a state_dict round trip restores θ (and the outputs) in a fresh expansion of the same model
    fresh = linearize(model)
    fresh.load_state_dict(flin.state_dict())
    torch.testing.assert_close(fresh(x), flin(x), rtol=0, atol=0)


def test_training_the_model_in_place_does_not_move_the_expansion() -> None:
    model = _mlp()
    x = torch.randn(4, 3, dtype=torch.float64)
    flin = linearize(model)
    with torch.no_grad():
        f0 = model(x)
        for p in model.parameters():
            p.add_(1.0)
    torch.testing.assert_close(flin(x), f0, rtol=0, atol=1e-14)


def test_params_globs_keep_the_others_at_theta0() -> None:
    model = _mlp()
    x = torch.randn(5, 3, dtype=torch.float64)
    flin = linearize(model, params=["4.*", "0.bias"])
    names = ["0.bias", "4.weight", "4.bias"]
    assert [n for n, _ in flin.named_parameters()] == names
    assert flin.frozen_names == ("0.weight", "2.weight", "2.bias")
    d = _random_step(flin, 0.5)
    _move(flin, d)
    j = reference_jacobian(model, x)[..., reference_columns(model, names)]
    with torch.no_grad():
        want = model(x) + torch.einsum("nkp,p->nk", j, _flat(d))
    torch.testing.assert_close(flin(x), want, rtol=0, atol=1e-12)


def test_requires_grad_false_parameters_are_frozen() -> None:
    model = _mlp()
    model[0].weight.requires_grad_(False)
    flin = linearize(model)
    assert "0.weight" not in dict(flin.named_parameters())
    assert "0.weight" in flin.frozen_names


def test_batchnorm_buffers_in_eval_semantics_even_in_train_mode() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.train()
    x = torch.randn(5, 3, dtype=torch.float64)
    flin = linearize(model)
    assert dict(flin.named_buffers()) == {}
    model.eval()
    with torch.no_grad():
        want = model(x)
    model.train()
    torch.testing.assert_close(flin(x), want, rtol=0, atol=1e-14)
    assert model.training  # the caller's flags are untouched


def test_minibatches_and_tied_weights() -> None:
    torch.manual_seed(0)
    emb = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(emb, nn.Tanh(), emb).double()  # one weight used twice
    flin = linearize(model)
    assert [n for n, _ in flin.named_parameters()] == ["0.weight"]
    x = torch.randn(6, 4, dtype=torch.float64)
    d = _random_step(flin, 0.2)
    _move(flin, d)
    j = reference_jacobian(model, x)
    with torch.no_grad():
        want = model(x) + torch.einsum("nkp,p->nk", j, _flat(d))
    torch.testing.assert_close(torch.cat([flin(x[:2]), flin(x[2:])]), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("order", "ratio"), [(1, 4.0), (2, 8.0), (3, 16.0)])
def test_taylor_remainder_shrinks_as_eps_to_the_order_plus_one(order: int, ratio: float) -> None:
    model = _mlp()
    x = torch.randn(6, 3, dtype=torch.float64)
    direction = _random_step(linearize(model), 1.0, seed=3)
    errors = []
    for eps in (0.04, 0.02, 0.01):
        series = taylor_expand(model, order=order)
        _move(series, {n: eps * d for n, d in direction.items()})
        moved = _mlp()  # the network itself at θ0 + εd: the independent reference
        _move(moved, {n: eps * d for n, d in direction.items()})
        with torch.no_grad():
            errors.append((series(x) - moved(x)).abs().max().item())
    ratios = [errors[0] / errors[1], errors[1] / errors[2]]
    assert all(abs(math.log2(r) - math.log2(ratio)) < 0.25 for r in ratios), (errors, ratios)


def test_taylor_order_one_is_the_linearization() -> None:
    model = _mlp()
    x = torch.randn(3, 3, dtype=torch.float64)
    a, b = linearize(model), taylor_expand(model, order=1)
    d = _random_step(a, 0.1)
    _move(a, d)
    _move(b, d)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_bad_arguments() -> None:
    model = _mlp()
    with pytest.raises(InvalidInput, match="order must be an integer from 1 to 4"):
        taylor_expand(model, order=0)
    with pytest.raises(NoMatchingParameters, match="^linearize: parameter glob 'nope.\\*' matches no parameter"):
        linearize(model, params=["nope.*"])
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(InvalidInput, match="no trainable parameter"):
        linearize(model)


def test_double_moves_theta0_and_buffers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 1)).eval()
    flin = linearize(model).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        want = model.double()(x)
    assert flin(x).dtype == torch.float64
    torch.testing.assert_close(flin(x), want, rtol=0, atol=1e-6)


def test_attention_runs_on_its_math_path_under_forward_ad() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(8 * 3, 2)).double().eval()  # eval: the fused fast path
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    flin = linearize(model)
    d = _random_step(flin, 0.05)
    _move(flin, d)
    j = reference_jacobian(model, x)
    with torch.no_grad():
        want = model(x) + torch.einsum("nkp,p->nk", j, _flat(d))
    torch.testing.assert_close(flin(x), want, rtol=0, atol=1e-12)
