"""The structured sketch of ``ntk_features``: Φ of a rule-covered weight from its factors δ and a, never forming J.

A weight the structured engine factors (``structured/rules.py``: Linear over any leading dims, Conv1d/Conv2d,
Embedding) has, per example and output c, J_c = Σ_g Σ_t D_c[g, t] ⊗ A[g, t] (δ and the layer input a, or its
patches; A with a trailing 1 when the bias is folded in). Its features are

    Φ_c[:, r] = Σ_g Σ_t (S^D_g D_c[g, t])_r · (S^A_g A[g, t])_r,        S^D_g (D, dd), S^A_g (D, da) Gaussian,

a Kronecker Gaussian sketch: row r of S^D_g ⊗ S^A_g is s ⊗ s' with s, s' independent Gaussians, so
E[(s·u)(s·u')(s'·v)(s'·v')] = (u·u')(v·v') and E[Φ1 Φ2ᵀ] = J1 J2ᵀ for every pair (unbiased; independent draws per
weight and group make cross terms vanish in mean). An Embedding's A is a one-hot id: S^A A is a column of S^A.
Every other selected parameter (a bias without its weight, normalisation affines, the engine's fallback) has its
Jacobian (n, k, p) built by the engine, and is sketched by J R with the Gaussian sketch's own R (the same draws,
``sketch_draws.gaussian_block`` by the parameter's name): those columns equal the Gaussian sketch's to rounding.

Cost per example: one structured capture (a forward and a reverse pass batched over k: (1 + k)·[FP], the chain's
closed form for an MLP), then per factored weight T·D·(k·dd + da) multiply-adds and per Jacobian parameter k·p·D;
against D·[FP] ≈ D·Σ T·dd·da for the Gaussian sketch's D forward-mode products. The draws are D·Σ G·(dd + da)
numbers instead of D·P. Memory: Φ, the draws, one capture of a chunk of examples and its (n, k, G, T, c) products
for c columns at a time.

NOTE [contraction order]: Σ_t (S^D D_c[t])_r (S^A A[t])_r is also the bilinear form s^D_rᵀ J_c s^A_r of the weight's
Jacobian J_c = Σ_t D_c[t] ⊗ A[t] (one matmul, k·T·dd·da), so the same Φ, to rounding, costs k·dd·da per column that
way against T·(da + k·dd) by projecting the factors. Weight sharing over many positions (convolutions: T = 64 on
8×8 images) favours J (``_through_jacobian``); Linear layers on vectors (T = 1) and wide outputs favour the factors.
On the digits CNN (two 3×3 convolutions, k = 1, N = 1000, D = 2048) the features took 1.1 s of CPU against 3.6-4.8 s.

NOTE [product sketch error]: the price is variance. For one factored term with T = 1 and i = (example, output),
u_i = δ, v_i = a (Grams U = u uᵀ, V = v vᵀ, Θ = U ⊙ V), Isserlis' theorem per row gives

    D · Var(Φ_i · Φ_j) = (U_ii U_jj + 2 U_ij²)(V_ii V_jj + 2 V_ij²) − U_ij² V_ij²,

against Θ_ii Θ_jj + Θ_ij² for the Gaussian sketch: at most 8 Θ_ii Θ_jj + Θ_ij² instead (on the diagonal 8 Θ_ii²
against 2 Θ_ii²), so the same error needs up to about 4× the columns; variances of independent terms add. Each
column costs ≈ Σ (k·dd + da) / Σ dd·da of a Gaussian one (≈ 1/60 on the benchmark MLP), which is why the
structured sketch wins at equal time (docs/benchmarks.md). TensorSketch (Pham & Pagh 2013: CountSketch of each
factor, product by FFT) would cost T·(dd + da + D log D) per output but its variance is larger still; a matmul-shaped
Kronecker sketch is what this CPU runs fastest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ntk_service.errors import MemoryEstimateExceeded, format_bytes
from ntk_service.kernels.problem.batch import Batch, batch_size, take
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.sketch.sketch_draws import BLOCK, gaussian_block
from ntk_service.kernels.structured import Structured, StructuredOptions
from ntk_service.kernels.structured.descriptors import FactorSide
from ntk_service.kernels.structured.plan import FactoredTerm, StructuredTerms

__all__ = ["STRUCTURED_SKETCH_OPTIONS", "structured_features"]

STRUCTURED_SKETCH_OPTIONS = StructuredOptions(form="factored")
"""Every weight with factors in factored form: its sketch is then a product of two small sketches, whatever the
kernel's cost model would pick for contracting it (NOTE [factored or Jacobian] weighs pairs, which a sketch has
not)."""


@dataclass(frozen=True)
class _FactorDraws:
    """S^D (G, D, dd) and S^A (G, D, width) of one factored term: width = da (+ 1 for a folded bias), or the
    embedding's number of rows for ids."""

    delta: torch.Tensor
    inputs: torch.Tensor


def _index_rows(terms: StructuredTerms, term: FactoredTerm) -> int:
    site = terms.plan.sites[term.uses[0]]
    return site.rule.index_rows(site.config)


def _stacked(seed: int, name: str, dim: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The first ``dim`` columns of the Gaussian matrix ``name``, (G, dim, width) for shape (G, width)."""
    blocks = [gaussian_block(seed, name, b, shape, dtype) for b in range(math.ceil(dim / BLOCK))]
    return torch.cat(blocks)[:dim].transpose(0, 1)


def _width(terms: StructuredTerms, term: FactoredTerm) -> int:
    """S^A's width: the embedding's rows for ids, else da (+ 1 for a folded bias)."""
    return _index_rows(terms, term) if term.index else term.dims[2] + (term.bias is not None)


def _factor_draws(seed: int, dim: int, terms: StructuredTerms, dtype: torch.dtype) -> list[_FactorDraws]:
    out = []
    for term in terms.factored:
        g, _, _, dd = term.dims
        width = _width(terms, term)
        delta = _stacked(seed, f"{term.name}\x00delta", dim, (g, dd), dtype)
        out.append(_FactorDraws(delta, _stacked(seed, f"{term.name}\x00input", dim, (g, width), dtype)))
    return out


def _through_jacobian(terms: StructuredTerms, term: FactoredTerm, k: int) -> bool:
    """Whether the term's columns are cheaper as bilinear forms of its Jacobian (NOTE [contraction order])."""
    _, t, _, dd = term.dims
    width = _width(terms, term)
    return not term.index and t > 1 and k * dd * width < t * (width + k * dd)


def _weight_jacobian(side: FactorSide, term: FactoredTerm) -> torch.Tensor | None:
    """J = Σ_t D[t] ⊗ A[t] (n, k, G, dd, width), A with its trailing 1 for a folded bias; None for a shared δ
    (projected once by ``_factored_columns``)."""
    if side.d.shared:
        return None
    a = side.a
    if term.bias is not None:
        a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)
    return torch.einsum("nkgtd,ngta->nkgda", side.d.tensor, a)


def _factored_columns(
    side: FactorSide, term: FactoredTerm, draws: _FactorDraws, cols: slice, jacobian: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_g Σ_t (S^D D_c[g, t]) ⊙ (S^A A[g, t]) for the columns ``cols``: (n, k, c); from the weight's Jacobian
    (n, k, G, dd, width) when given (NOTE [contraction order])."""
    s_d, s_a = draws.delta[:, cols], draws.inputs[:, cols]  # (G, c, dd), (G, c, width)
    if jacobian is not None:
        w = jacobian @ s_a.transpose(-1, -2).unsqueeze(0)  # (n, k, G, dd, width) @ (1, G, width, c)
        return (w * s_d.transpose(-1, -2).unsqueeze(0).unsqueeze(0)).sum((2, 3))
    d = side.d.tensor  # (n, k, G, T, dd)
    if term.index:  # ids (n, 1, T): S^A one-hot(id) is column id of S^A
        v = s_a[0].T[side.a]  # (n, 1, T, c)
    else:
        da = side.a.shape[-1]
        v = side.a @ s_a[:, :, :da].transpose(-1, -2)  # (n, G, T, da) @ (G, da, c) -> (n, G, T, c)
        if term.bias is not None:  # the folded bias: A's trailing c (its scale) at every position
            v = v + term.bias_scale * s_a[:, :, da].unsqueeze(1)
    if side.d.shared:  # the same δ for every example (the head's identity): project it once
        d = d[:1]
    u = d @ s_d.transpose(-1, -2).unsqueeze(0)  # (n or 1, k, G, T, c)
    return (u * v.unsqueeze(1)).sum((2, 3))  # v (n, 1, G, T, c) broadcasts a shared u over the examples


def _column_bytes(problem: NtkProblem, terms: StructuredTerms) -> float:
    """Bytes per example and per column of the products of ``_factored_columns`` (either order) and the Jacobian
    matmuls."""
    k = problem.k
    per = sum(max(2 * k + 1, k * dd) * g * t for g, t, _, dd in (term.dims for term in terms.factored))
    return float((per + 2 * k) * problem.itemsize)


def _jacobian_bytes(problem: NtkProblem, terms: StructuredTerms) -> int:
    """Bytes per example of the weight Jacobians the terms through J keep (``_weight_jacobian``)."""
    k = problem.k
    return problem.itemsize * sum(
        k * t.dims[0] * t.dims[3] * _width(terms, t) for t in terms.factored if _through_jacobian(terms, t, k)
    )


def structured_features(
    problem: NtkProblem, x: Batch, *, dim: int, seed: int, memory_budget_bytes: int, operation: str
) -> torch.Tensor:
    """Φ·√D of the structured sketch (module docstring): (N, k, D), unscaled.

    Args:
        problem: the prepared model. x: (N, *input). dim: D. seed: picks the draws (NOTE [sketch determinism]).
        memory_budget_bytes: the peak to stay under. operation: the public call, for messages.

    Raises:
        MemoryEstimateExceeded: Φ, the draws and one example's capture exceed the budget.
    """
    alg = Structured(STRUCTURED_SKETCH_OPTIONS)
    terms = alg.terms(problem, take(x, 0, 1))
    n, k, item = batch_size(x), problem.k, problem.itemsize
    jacobian_numel = [problem.params[name].numel() for name in terms.fallback] + [t.numel for t in terms.jacobian]
    draws_bytes = sum(t.dims[0] * dim * (t.dims[3] + _width(terms, t)) for t in terms.factored) * item
    fixed = n * k * dim * item + draws_bytes + BLOCK * max(jacobian_numel, default=0) * (item + 8)
    available = memory_budget_bytes - fixed
    # R of the Jacobian parameters drawn once when it takes at most a quarter of what is left, else per chunk
    keep_r = dim * sum(jacobian_numel) * item <= available / 4
    if keep_r:
        available -= dim * sum(jacobian_numel) * item
    per_column = _column_bytes(problem, terms)
    # columns per step: all of them when their products for the whole batch take at most half of what is left
    cols = min(dim, max(BLOCK, BLOCK * int(available / (2 * n * per_column * BLOCK)))) if available > 0 else BLOCK
    per_example = alg.side_bytes(problem, 1, left=True)[0] + cols * per_column + _jacobian_bytes(problem, terms)
    chunk = min(n, int(available // per_example)) if available > 0 else 0
    if chunk < 1:
        needed = int(fixed + per_example)
        raise MemoryEstimateExceeded(
            f"{operation}: structured features of N={n} examples with k={k}, D={dim} (P={problem.num_params}) need "
            f"at least {format_bytes(needed)}, over the memory budget of {format_bytes(memory_budget_bytes)}; "
            "use a smaller dim, fewer examples per call (rows do not interact), or a larger budget",
            estimate_bytes=needed,
            budget_bytes=memory_budget_bytes,
        )
    factor_draws = _factor_draws(seed, dim, terms, problem.dtype)
    kept_r: dict[str, torch.Tensor] = {}  # name -> R (D, p), when kept
    if keep_r:
        names = [*terms.fallback, *(t.name for t in terms.jacobian)]
        kept_r = {name: _jacobian_columns(problem, seed, name, 0, dim) for name in names}
    phi = torch.zeros(n, k, dim, dtype=problem.dtype)
    for i in range(0, n, chunk):
        side = alg.left(problem, take(x, i, i + chunk))
        terms = alg.terms(problem)  # the plan the capture ran under (it may have learned a fact)
        with torch.no_grad():
            out = phi[i : i + chunk]
            jacobians = [
                _weight_jacobian(fs, term) if _through_jacobian(terms, term, k) else None
                for term, fs in zip(terms.factored, side.factored, strict=True)
            ]
            for start in range(0, dim, cols):
                span = slice(start, min(dim, start + cols))
                for term, fs, dr, jac in zip(terms.factored, side.factored, factor_draws, jacobians, strict=True):
                    out[:, :, span] += _factored_columns(fs, term, dr, span, jac)
            for name, j in side.jacobians.items():  # J R with the Gaussian sketch's R (module docstring)
                if name in kept_r:
                    out += j.tensor @ kept_r[name].T
                    continue
                for block in range(math.ceil(dim / BLOCK)):
                    start, stop = block * BLOCK, min(dim, (block + 1) * BLOCK)
                    out[:, :, start:stop] += j.tensor @ _jacobian_columns(problem, seed, name, start, stop).T
    return phi


def _jacobian_columns(problem: NtkProblem, seed: int, name: str, start: int, stop: int) -> torch.Tensor:
    """Columns start:stop of the Gaussian sketch's R for parameter ``name`` (start a multiple of ``BLOCK``):
    (stop − start, p), the tangents of ``features._tangents`` flattened."""
    shape, p = tuple(problem.params[name].shape), problem.params[name].numel()
    blocks = range(start // BLOCK, math.ceil(stop / BLOCK))
    r = torch.cat([gaussian_block(seed, name, b, shape, problem.dtype).reshape(BLOCK, p) for b in blocks])
    return r[: stop - start]
