"""ntk_operator: products against the float64 reference kernel as a dense matrix, and Lanczos on the SciPy
view against dense eigenvalues."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg
import torch
from torch import nn

from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, NonFiniteInput, ShapeMismatch, UnknownMode
from ntk_service.kernels import ntk_operator
from ntk_service.kernels.operators.linear_operator import MAX_CHUNK_BYTES
from tests.kernels.zoo import ZOO
from tests.reference import reference_jacobian, reference_ntk


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def _dense(
    model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, params: list[str] | None = None
) -> torch.Tensor:
    """The reference FULL kernel as the example-major (N·k, M·k) matrix."""
    full = reference_ntk(model, x1, x2, "full", params)
    n, m, k, _ = full.shape
    return full.permute(0, 2, 1, 3).reshape(n * k, m * k)


@pytest.mark.parametrize("budget", [None, 10_000], ids=["one_chunk", "chunked"])
def test_full_products_match_the_reference_kernel_times_v(budget: int | None) -> None:
    model = _mlp()
    x1, x2 = _inputs()
    g = torch.Generator().manual_seed(3)
    for other in (x2, None):
        for params in (None, ["2.*"]):
            dense = _dense(model, x1, other, params)
            op = ntk_operator(model, x1, other, params=params, dtype=torch.float64, memory_budget_bytes=budget)
            assert op.shape == tuple(dense.shape) and op.is_symmetric == (other is None)
            if budget is not None and params is None:
                assert op.examples_per_chunk < 5  # the data really is walked in chunks
            m = dense.shape[1] // 3
            v = torch.randn(m, 3, generator=g, dtype=torch.float64)
            assert _rel(op.matvec(v), (dense @ v.reshape(-1)).reshape(-1, 3)) <= 1e-10
            assert _rel(op.matvec(v.reshape(-1)), dense @ v.reshape(-1)) <= 1e-10  # flat in, flat out
            w = torch.randn(7, 3, generator=g, dtype=torch.float64)
            assert _rel(op.rmatvec(w), (dense.T @ w.reshape(-1)).reshape(-1, 3)) <= 1e-10
            assert _rel(op.T.matvec(w), (dense.T @ w.reshape(-1)).reshape(-1, 3)) <= 1e-10
            cols = torch.randn(dense.shape[1], 2, generator=g, dtype=torch.float64)
            assert _rel(op @ cols, dense @ cols) <= 1e-10


def test_the_two_halves_are_the_reference_jacobian_products() -> None:
    # pullback is J(x2)ᵀ v and pushforward J(x1) u, each against the reference Jacobian (n, k, P), parameters in
    # named_parameters() order; a sharded operator sums pullbacks, so they must be exact on their own
    model = _mlp().double()
    x1, x2 = _inputs()
    op = ntk_operator(model, x1, x2)
    j1, j2 = reference_jacobian(model, x1), reference_jacobian(model, x2)
    g = torch.Generator().manual_seed(4)
    v = torch.randn(5, 3, generator=g, dtype=torch.float64)
    u = op.pullback(v)
    names = [name for name, _ in model.named_parameters()]
    assert list(u) == names and op.num_params == j1.shape[2]
    flat_u = torch.cat([u[name].reshape(-1) for name in names])
    assert _rel(flat_u, torch.einsum("mkp,mk->p", j2, v)) <= 1e-12
    tangent = torch.randn(j1.shape[2], generator=g, dtype=torch.float64)
    shaped, start = {}, 0
    for name, p in model.named_parameters():
        shaped[name] = tangent[start : start + p.numel()].reshape(p.shape)
        start += p.numel()
    assert _rel(op.pushforward(shaped), torch.einsum("nkp,p->nk", j1, tangent)) <= 1e-12
    assert _rel(op.T.pushforward(shaped), torch.einsum("nkp,p->nk", j2, tangent)) <= 1e-12
    with pytest.raises(ShapeMismatch, match=r"pullback: the vector has shape \(7, 3\)"):
        op.pullback(torch.zeros(7, 3, dtype=torch.float64))
    with pytest.raises(ShapeMismatch, match=r"pushforward: u must hold .*0\.weight"):
        op.pushforward({**shaped, "0.weight": torch.zeros(2, 2)})
    with pytest.raises(ShapeMismatch, match=r"pushforward: u must hold .*4\.bias"):
        op.pushforward({name: t for name, t in shaped.items() if name != "4.bias"})


@pytest.mark.parametrize("mode", ["trace", "pseudo"])
def test_trace_and_pseudo_products_match_the_reference_kernel(mode: str) -> None:
    model = _mlp()
    x1, x2 = _inputs()
    g = torch.Generator().manual_seed(4)
    for other in (x2, None):
        kernel = reference_ntk(model, x1, other, mode)  # (N, M)
        op = ntk_operator(model, x1, other, mode=mode, dtype=torch.float64, memory_budget_bytes=10_000)
        assert op.shape == tuple(kernel.shape)
        v = torch.randn(kernel.shape[1], generator=g, dtype=torch.float64)
        w = torch.randn(kernel.shape[0], generator=g, dtype=torch.float64)
        assert _rel(op.matvec(v), kernel @ v) <= 1e-10
        assert _rel(op.rmatvec(w), kernel.T @ w) <= 1e-10


def test_conv_model_products_match_the_reference() -> None:
    entry = next(e for e in ZOO if e.name == "cnn")
    torch.manual_seed(0)
    model = entry.build()
    x1, x2 = entry.inputs(torch.Generator().manual_seed(1))
    dense = _dense(model, x1, x2)
    op = ntk_operator(model, x1, x2, dtype=torch.float64)
    v = torch.randn(dense.shape[1], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert _rel(op.matvec(v), dense @ v) <= 1e-10


def test_lanczos_on_the_scipy_view_finds_the_dense_eigenvalues() -> None:
    model = _mlp()
    x1, _ = _inputs()
    dense = _dense(model, x1, None).numpy()
    linear = ntk_operator(model, x1, dtype=torch.float64).as_linear_operator()
    assert linear.shape == dense.shape and linear.dtype == np.float64
    top = np.sort(scipy.sparse.linalg.eigsh(linear, k=4, which="LA", tol=1e-12)[0])
    expected = np.linalg.eigvalsh((dense + dense.T) / 2)[-4:]
    np.testing.assert_allclose(top, expected, rtol=1e-9, atol=0)
    rng = np.random.default_rng(0)
    x1, x2 = _inputs()
    rectangular = _dense(model, x1, x2).numpy()  # (N·k, M·k) = (21, 15)
    linear = ntk_operator(model, x1, x2, dtype=torch.float64).as_linear_operator()
    v, w = rng.standard_normal((15, 1)), rng.standard_normal(21)
    scale = 1e-10 * np.abs(rectangular).max() * 15
    np.testing.assert_allclose(linear.matvec(v), rectangular @ v, rtol=1e-10, atol=scale)
    np.testing.assert_allclose(linear.rmatvec(w), rectangular.T @ w, rtol=1e-10, atol=scale)


def test_wrong_vectors_modes_and_budgets_are_refused_clearly() -> None:
    model = _mlp()
    x1, x2 = _inputs()
    op = ntk_operator(model, x1, x2)
    with pytest.raises(ShapeMismatch, match=r"matvec: the vector has shape \(7, 3\).*expected .*\(5, 3\) or flat"):
        op.matvec(torch.zeros(7, 3))
    with pytest.raises(ShapeMismatch, match=r"rmatvec: the vector has shape \(5, 3\)"):
        op.rmatvec(torch.zeros(5, 3))
    with pytest.raises(ShapeMismatch, match="dtype torch.int64"):
        op.matvec(torch.zeros(5, 3, dtype=torch.int64))
    with pytest.raises(NonFiniteInput, match="NaN or inf"):
        op.matvec(torch.full((5, 3), float("nan")))
    with pytest.raises(ShapeMismatch, match=r"expected a float tensor of shape \(5,\) for mode trace"):
        ntk_operator(model, x1, x2, mode="trace").matvec(torch.zeros(5, 3))
    with pytest.raises(UnknownMode, match="'example_diagonal' is not a linear operator"):
        ntk_operator(model, x1, mode="example_diagonal")
    with pytest.raises(MemoryEstimateExceeded, match="ntk_operator: one product needs at least"):
        ntk_operator(model, x1, memory_budget_bytes=1_000)


@pytest.mark.parametrize("mode", ["full", "trace", "pseudo"])
def test_a_large_n_with_a_small_budget_is_walked_one_chunk_at_a_time(mode: str) -> None:
    """The memory claim's premise, observed: the model never sees more than ``examples_per_chunk`` examples in
    one call (so activations are one chunk's), the estimate stays within the budget, and the product is still
    right (against the dense reference on a subset of rows: Θ v restricted to the first rows)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    seen: list[int] = []
    model[0].register_forward_hook(lambda _m, args, _out: seen.append(int(args[0].shape[0])))
    n, budget = 1000, 110_000  # over the fixed O(P + N·k) part (97 KB here): ~12 KB for activations
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    op = ntk_operator(model, x, mode=mode, memory_budget_bytes=budget)
    assert op.estimate_bytes <= budget and 1 <= op.examples_per_chunk < n // 20
    v = torch.randn(
        *((n, 2) if mode == "full" else (n,)), generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    seen.clear()
    product = op.matvec(v)
    assert seen and max(seen) <= op.examples_per_chunk and sum(seen) >= 2 * n  # every example, chunk by chunk
    rows = 5
    kernel = reference_ntk(model, x[:rows], x, "full" if mode == "full" else mode)
    if mode == "full":
        expected = torch.einsum("nmab,mb->na", kernel, v)
    else:
        expected = kernel @ v
    assert _rel(product[:rows], expected) <= 1e-10


def test_the_default_chunk_is_bounded_in_bytes_whatever_the_budget() -> None:
    """With a budget that would take every example at once, the default still walks the data in chunks whose
    activations stay under MAX_CHUNK_BYTES (the peak is O(P + chunk), not O(P + N)): a model whose hidden layer
    makes one example ~1 MB of activations sees at most ~256 examples per call, and the product stays right."""
    torch.manual_seed(0)
    width = 2**16
    model = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 1))
    seen: list[int] = []
    model[0].register_forward_hook(lambda _m, args, _out: seen.append(int(args[0].shape[0])))
    n = 600
    x = torch.randn(n, 2, generator=torch.Generator().manual_seed(1))
    op = ntk_operator(model, x, memory_budget_bytes=2**40)
    assert 1 <= op.examples_per_chunk < n  # the budget alone would have allowed all 600
    assert op.examples_per_chunk * 4 * width <= MAX_CHUNK_BYTES  # each example holds ≥ its 2**16 hidden floats
    v = torch.randn(n, 1, generator=torch.Generator().manual_seed(2))
    seen.clear()
    product = op.matvec(v)
    assert max(seen) <= op.examples_per_chunk and sum(seen) >= 2 * n
    # Θ of f = w2 · tanh(W1 x + b1) + b2 written out by hand (float64): the hidden units' derivative terms
    # Σ_j w2_j² (1 − h_j²)(1 − h'_j²)(x · x' + 1), plus h · h' + 1 for the last layer
    w1, b1 = model[0].weight.detach().double(), model[0].bias.detach().double()
    w2 = model[2].weight.detach().double()[0]
    xd = x.double()
    h = torch.tanh(xd @ w1.T + b1)
    g = (1 - h**2) * w2
    kernel = (g @ g.T) * (xd @ xd.T + 1) + h @ h.T + 1
    assert _rel(product.double(), kernel @ v.double()) <= 1e-4  # float32 products


def test_examples_per_chunk_is_a_cap_and_is_checked() -> None:
    model = _mlp().double()
    x1, x2 = _inputs()
    op = ntk_operator(model, x1, x2, examples_per_chunk=2)
    assert op.examples_per_chunk == 2
    v = torch.randn(5, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = torch.einsum("nmab,mb->na", reference_ntk(model, x1, x2, "full"), v)
    assert _rel(op.matvec(v), expected) <= 1e-12
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidInput, match="ntk_operator: examples_per_chunk must be an integer ≥ 1"):
            ntk_operator(model, x1, examples_per_chunk=bad)  # type: ignore[arg-type]
