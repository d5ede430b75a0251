"""The structured sketch (sketch/product_sketch.py) against the exact float64 kernel of tests/reference.py: its error's
rate in D and its constant (Isserlis' theorem on hand-computed δ and a, NOTE [product sketch error]), unbiasedness
over seeds on Linear layers over sequences, convolutions and models mixing covered and uncovered parameters, and
the uncovered parameters' columns being the Gaussian sketch's."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ntk_service.kernels import feature_kernel, ntk_features
from ntk_service.kernels.problem.preparation import build_problem
from ntk_service.kernels.problem.private_module import private_copy
from ntk_service.kernels.sketch.product_sketch import (
    STRUCTURED_SKETCH_OPTIONS,
    _factor_draws,
    _factored_columns,
    _through_jacobian,
    _weight_jacobian,
)
from ntk_service.kernels.structured import Structured
from tests.reference import reference_ntk

SEEDS = range(50)  # deterministic seeds: the tests are reproducible, their tolerances statistical


def _matrix(full: torch.Tensor | np.ndarray) -> np.ndarray:
    full = torch.as_tensor(full)
    n, m, k, _ = full.shape
    return full.permute(0, 2, 1, 3).reshape(n * k, m * k).numpy()


def _assert_unbiased(
    model: nn.Module, x: torch.Tensor, x2: torch.Tensor, dim: int = 64, seeds: range = SEEDS, z_max: float = 5.0
) -> None:
    """The mean of Φ1 Φ2ᵀ over ``seeds`` is within z_max standard errors of Θ(x, x2) in every entry, and near it."""
    exact = reference_ntk(model, x, x2).numpy()
    draws = np.stack(
        [
            feature_kernel(
                ntk_features(model, x, dim=dim, seed=s, sketch="structured"),
                ntk_features(model, x2, dim=dim, seed=s, sketch="structured"),
            ).numpy()
            for s in seeds
        ]
    )
    mean, sem = draws.mean(0), draws.std(0, ddof=1) / np.sqrt(len(seeds))
    # each draw averages 64 i.i.d. columns, nearly normal; at most ~100 entries: P(max |z| > 5) < 100 · 1e-5 for
    # an unbiased estimate (Student's t, 49 degrees of freedom; 16 entries · 4e-5 at 24)
    z = np.abs(mean - exact) / (sem + 1e-300)
    assert float(z.max()) < z_max, float(z.max())
    relative = float(np.linalg.norm(mean - exact) / np.linalg.norm(exact))
    assert relative < 0.25, relative  # and near, not just noisy (the 3200 columns give about 0.05)


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _factors(model: nn.Sequential, x: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per Linear layer (U, V): Grams over rows (example, output) of δ = ∂f_c/∂y and of the input with a 1
    appended (its bias), by plain autograd one example at a time."""
    layers = [i for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    deltas: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    for row in x:
        h, ys = row.unsqueeze(0), {}
        for i, m in enumerate(model):
            if i in layers:
                inputs[i].append(torch.cat([h.detach()[0], torch.ones(1, dtype=h.dtype)]))
                h = ys[i] = m(h)  # an intermediate of the graph (the weights require grad)
            else:
                h = m(h)
        out = h[0]
        grads = [torch.autograd.grad(out[c], [ys[i] for i in layers], retain_graph=True) for c in range(out.shape[0])]
        for j, i in enumerate(layers):
            deltas[i].append(torch.stack([g[j][0] for g in grads]))  # (k, out)
    k = out.shape[0]
    result = []
    for i in layers:
        d = torch.stack(deltas[i]).reshape(len(x) * k, -1)  # rows (example, output)
        a = torch.stack(inputs[i]).repeat_interleave(k, 0)
        result.append(((d @ d.T).numpy(), (a @ a.T).numpy()))
    return result


def test_error_falls_like_one_over_sqrt_d_with_the_product_constant() -> None:
    model, x = _mlp(), _x(5, 3)
    exact = _matrix(reference_ntk(model, x))
    factors = _factors(model, x)
    np.testing.assert_allclose(sum(u * v for u, v in factors), exact, rtol=1e-10, atol=1e-12)  # Θ = Σ_l U ⊙ V
    # NOTE [product sketch error]: D·E‖ΦΦᵀ − Θ‖²_F = Σ_l Σ_ij (U_ii U_jj + 2U_ij²)(V_ii V_jj + 2V_ij²) − U_ij² V_ij²
    constant = 0.0
    for u, v in factors:
        du, dv = np.diag(u), np.diag(v)
        constant += np.sum((np.outer(du, du) + 2 * u**2) * (np.outer(dv, dv) + 2 * v**2) - u**2 * v**2)
    gaussian = np.sum(exact**2) + np.trace(exact) ** 2  # the Gaussian sketch's constant, for comparison
    assert gaussian < constant < 9 * gaussian
    dims, seeds = (16, 64, 256, 1024), range(24)
    rms = []
    for d in dims:
        squared = [
            np.sum((_matrix(feature_kernel(ntk_features(model, x, dim=d, seed=s, sketch="structured"))) - exact) ** 2)
            for s in seeds
        ]
        rms.append(np.sqrt(np.mean(squared)))
    slope = np.polyfit(np.log(dims), np.log(rms), 1)[0]
    assert -0.6 < slope < -0.4, slope
    np.testing.assert_allclose(rms, np.sqrt(constant / np.asarray(dims)), rtol=0.35)


class _SequenceModel(nn.Module):
    """Linear layers on (N, T, in): the weight is shared over positions, J_W = Σ_t δ_t ⊗ a_t."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))  # (N, T, 4)
        h = torch.tanh(self.mix(h)) * h
        return self.head(h.mean(dim=1))


def test_unbiased_on_linear_layers_over_sequences() -> None:
    torch.manual_seed(0)
    model = _SequenceModel().double()
    _assert_unbiased(model, _x(3, 5, 3), _x(2, 5, 3, seed=2))


class _Mixed(nn.Module):
    """Linear and Embedding weights (factored) beside LayerNorm affines (rule Jacobians) and a bare parameter in
    custom math (the engine's fallback, jacrev)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.inner = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.scale = nn.Parameter(torch.tensor([0.7, -1.2, 0.4, 1.1]))
        self.head = nn.Linear(4, 2, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.inner(self.embed(ids))))  # (N, T, 4)
        return self.head(h.mean(dim=1) * self.scale)


def test_unbiased_on_a_model_mixing_covered_and_uncovered_parameters() -> None:
    torch.manual_seed(0)
    model = _Mixed().double()
    _assert_unbiased(model, torch.tensor([[1, 2, 3], [4, 4, 0], [5, 1, 2]]), torch.tensor([[0, 3, 5], [2, 2, 1]]))


def test_uncovered_parameters_get_the_gaussian_sketch_columns() -> None:
    torch.manual_seed(0)
    model, ids = _Mixed().double(), torch.tensor([[1, 2, 3], [4, 4, 0]])
    params = ["norm.*", "scale"]  # rule Jacobians and the fallback: J R with the Gaussian sketch's R
    structured = ntk_features(model, ids, dim=40, seed=5, params=params, sketch="structured")
    gaussian = ntk_features(model, ids, dim=40, seed=5, params=params, sketch="gaussian")
    torch.testing.assert_close(structured, gaussian, rtol=1e-10, atol=1e-12)
    tight = ntk_features(model, ids, dim=40, seed=5, params=params, sketch="structured", memory_budget_bytes=10_000)
    torch.testing.assert_close(tight, gaussian, rtol=1e-10, atol=1e-12)  # R drawn per block, not kept: the same
    other = ntk_features(model, ids, dim=40, seed=5, params=["inner.*"], sketch="structured")
    assert not torch.allclose(other, ntk_features(model, ids, dim=40, seed=5, params=["inner.*"], sketch="gaussian"))


def test_unbiased_on_a_convolution() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(3, 4, 3, stride=2, groups=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 2),
    ).double()
    _assert_unbiased(model, _x(2, 2, 5, 5), _x(2, 2, 5, 5, seed=2), seeds=range(25))  # 88 ms a call


def test_a_convolutions_columns_are_the_same_through_its_jacobian() -> None:
    # NOTE [contraction order]: the bilinear forms s^Dᵀ J s^A of the weight's Jacobian are the factors' products
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)
    ).double()
    x = _x(5, 1, 6, 6)
    private = private_copy(model)
    assert private is not None
    problem = build_problem(private, x, None, params=None, dtype=torch.float64)
    alg = Structured(STRUCTURED_SKETCH_OPTIONS)
    side = alg.left(problem, x)
    terms = alg.terms(problem)
    draws = _factor_draws(3, 64, terms, torch.float64)
    compared = 0
    for term, factors, term_draws in zip(terms.factored, side.factored, draws, strict=True):
        jacobian = _weight_jacobian(factors, term)
        if not _through_jacobian(terms, term, problem.k) or jacobian is None:
            continue
        columns = slice(0, 64)
        through = _factored_columns(factors, term, term_draws, columns, jacobian)
        torch.testing.assert_close(
            through, _factored_columns(factors, term, term_draws, columns), rtol=1e-12, atol=1e-12
        )
        compared += 1
    assert compared == 2  # both convolutions (36 and 16 positions); the Linear head keeps its factors
