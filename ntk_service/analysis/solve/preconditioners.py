"""Nyström preconditioners for (A + μI) x = b on a kernel A that is only seen through products.

NOTE [nystrom preconditioner]
    m landmark columns C = A[:, S] (each one product with a unit vector, or given) give the Nyström
    approximation Â = C A[S, S]⁺ Cᵀ = F Fᵀ, F (n, m'), or a pivoted Cholesky gives Â = F Fᵀ directly. With the
    thin SVD F = U Σ Vᵀ and Λ = Σ², the preconditioner of Frangella, Tropp and Udell (2023, "Randomized Nyström
    preconditioning") is P⁻¹ = (λ_min(Λ) + μ) U (Λ + μI)⁻¹ Uᵀ + (I − U Uᵀ): it maps the top m' modes of A + μI
    to about λ_min(Λ) + μ and leaves the rest, so CG's condition number drops from (λ_1 + μ)/(λ_n + μ) to about
    (λ_{m'+1} + μ)/(λ_n + μ). NTK spectra fall fast (the top k modes of an MLP are the class-mean directions,
    orders of magnitude above the bulk), so a few dozen landmarks remove most of the conditioning.

    ``DEFAULT_LANDMARKS`` = 100 columns: building costs m products, i.e. about m CG iterations, so m should be
    well below the iterations it saves; at m = 100 the factorization is O(n·m²) flops and n·m floats of memory
    (800 MB at n = 10⁶), and benchmarks/bench_solvers.py prints iterations with and without it. CG builds it by
    default only from n = 50,000 rows (NOTE [cg default] in ``cg.py``: below that, on an MLP's NTK, it did not pay).

    Landmarks are "uniform" (m indices drawn without replacement from a seeded generator: what an operator
    allows, since its diagonal is unknown), "pivoted_cholesky" (greedy on the largest remaining diagonal, as
    GPyTorch's BBMM does; needs the diagonal, known for a dense kernel or passed in), or "gaussian" (Y = A Ω for
    an orthonormalized Gaussian Ω (n, m), the randomized Nyström of Frangella et al.; same m products, no
    landmark indices). On the tests' spectra the three needed iterations within 15 % of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ntk_service.analysis.solve.operators import KernelOperator
from ntk_service.errors import InvalidInput, ShapeMismatch

__all__ = ["DEFAULT_LANDMARKS", "LandmarkMethod", "NystromPreconditioner", "nystrom_preconditioner"]

DEFAULT_LANDMARKS = 100
"""Landmark columns of the default Nyström preconditioner, capped at n (NOTE [nystrom preconditioner])."""

LandmarkMethod = Literal["gaussian", "uniform", "pivoted_cholesky"]
"""How landmark columns are chosen (NOTE [nystrom preconditioner])."""

_OPERATION = "nystrom_preconditioner"


@dataclass(frozen=True)
class NystromPreconditioner:
    """P⁻¹ of NOTE [nystrom preconditioner] for A + μI.

    Attributes:
        basis: U (n, m'), orthonormal columns. eigenvalues: Λ (m',) descending, the Nyström eigenvalues of A.
        shift: μ (the ridge). landmarks: (m,) the column indices used. method: how they were chosen.
        products: operator products spent building it.
    """

    basis: np.ndarray
    eigenvalues: np.ndarray
    shift: float
    landmarks: np.ndarray
    method: str
    products: int

    @property
    def name(self) -> str:
        return f"nystrom({self.method}, m={self.landmarks.size}, rank={self.eigenvalues.size})"

    def apply(self, r: np.ndarray) -> np.ndarray:
        """P⁻¹ R for R (n, r): (n, r)."""
        if self.eigenvalues.size == 0:
            return r.copy()
        u = self.basis
        coeffs = u.T @ r
        floor = float(self.eigenvalues[-1]) + self.shift
        scaled = coeffs * (floor / (self.eigenvalues + self.shift))[:, None]
        out: np.ndarray = r + u @ (scaled - coeffs)
        return out


def _pivoted_cholesky(op: KernelOperator, diagonal: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Greedy pivoted Cholesky: F (n, m') with A ≈ F Fᵀ, the pivots, and the products spent (one per pivot)."""
    n = op.rows
    residual = diagonal.astype(np.float64).copy()
    factor = np.zeros((n, m))
    pivots: list[int] = []
    stop = float(np.max(residual)) * n * np.finfo(np.float64).eps if n else 0.0
    for j in range(m):
        i = int(np.argmax(residual))
        if residual[i] <= stop:
            break
        unit = np.zeros((n, 1))
        unit[i, 0] = 1.0
        column = op.apply(unit)[:, 0]
        column -= factor[:, :j] @ factor[i, :j]
        factor[:, j] = column / np.sqrt(residual[i])
        residual -= factor[:, j] ** 2
        residual[i] = 0.0
        pivots.append(i)
    return factor[:, : len(pivots)], np.asarray(pivots, dtype=np.int64), len(pivots)


def _nystrom_factor(columns: np.ndarray, landmarks: np.ndarray) -> np.ndarray:
    """F (n, m') with C W⁺ Cᵀ = F Fᵀ, W = C[S] symmetrized; modes of W below n·eps·‖W‖ are dropped."""
    w = columns[landmarks]
    w = (w + w.T) / 2
    values, vectors = np.linalg.eigh(w)
    keep = values > max(float(values[-1]), 0.0) * w.shape[0] * np.finfo(np.float64).eps * 10
    if not np.any(keep):
        return np.zeros((columns.shape[0], 0))
    factor: np.ndarray = columns @ (vectors[:, keep] / np.sqrt(values[keep]))
    return factor


def _sketch_factor(omega: np.ndarray, sketch: np.ndarray) -> np.ndarray:
    """F with Y (Ωᵀ Y)⁺ Yᵀ = F Fᵀ for Y = A Ω, shifted by ν = n·eps·‖Y‖ for stability (Frangella et al.,
    Algorithm 2.1; the shift is taken back off the eigenvalues in ``nystrom_preconditioner``'s SVD step)."""
    nu = omega.shape[0] * np.finfo(np.float64).eps * float(np.linalg.norm(sketch))
    shifted = sketch + nu * omega
    core = omega.T @ shifted
    values, vectors = np.linalg.eigh((core + core.T) / 2)
    keep = values > max(float(values[-1]), 0.0) * core.shape[0] * np.finfo(np.float64).eps * 10
    factor: np.ndarray = shifted @ (vectors[:, keep] / np.sqrt(values[keep]))
    return factor


def nystrom_preconditioner(
    op: KernelOperator,
    *,
    ridge: float,
    landmarks: int | None = None,
    method: LandmarkMethod | str = "uniform",
    seed: int = 0,
    diagonal: np.ndarray | None = None,
    columns: np.ndarray | None = None,
    landmark_indices: np.ndarray | None = None,
) -> NystromPreconditioner:
    """A Nyström preconditioner for op + ridge·I (NOTE [nystrom preconditioner]).

    Args:
        op: the square kernel (``kernel_operator``). ridge: μ ≥ 0.
        landmarks: m. Default: min(n, ``DEFAULT_LANDMARKS``).
        method: "uniform", "pivoted_cholesky" or "gaussian". Default: "uniform".
        seed: the generator of uniform landmarks. Default: 0.
        diagonal: (n,) A's diagonal, for "pivoted_cholesky" on an operator (a dense kernel has its own).
        columns, landmark_indices: A[:, S] (n, m) and S (m,), computed elsewhere (e.g. ``compute_ntk(model, x,
            x[S])``, far cheaper than m operator products); then no product is spent.

    Returns:
        NystromPreconditioner.

    Raises:
        InvalidInput: m < 1, an unknown method, "pivoted_cholesky" on an operator without ``diagonal``.
        ShapeMismatch: columns or indices that do not fit the operator.
    """
    n = op.rows
    if op.rows != op.cols:
        raise ShapeMismatch(f"{_OPERATION}: the kernel has shape {op.shape}; a preconditioner needs a square one")
    if columns is not None:
        cols = np.asarray(columns, dtype=np.float64)
        idx = np.asarray(landmark_indices, dtype=np.int64).reshape(-1) if landmark_indices is not None else None
        if idx is None or cols.ndim != 2 or cols.shape != (n, idx.size) or np.any(idx < 0) or np.any(idx >= n):
            raise ShapeMismatch(
                f"{_OPERATION}: columns has shape {cols.shape} with {None if idx is None else idx.size} landmark "
                f"indices; expected A[:, S] of shape ({n}, m) and m indices S in [0, {n})"
            )
        factor, products, chosen = _nystrom_factor(cols, idx), 0, idx
        method = "given"
    else:
        m = min(n, DEFAULT_LANDMARKS) if landmarks is None else int(landmarks)
        if m < 1 or m > n:
            raise InvalidInput(f"{_OPERATION}: landmarks must be in [1, n = {n}], got {landmarks}")
        if method == "uniform":
            chosen = np.sort(np.random.default_rng(seed).choice(n, size=m, replace=False))
            unit = np.zeros((n, m))
            unit[chosen, np.arange(m)] = 1.0
            cols = op.apply(unit)
            factor, products = _nystrom_factor(cols, chosen), m
        elif method == "gaussian":
            omega, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, m)))
            factor, products, chosen = _sketch_factor(omega, op.apply(omega)), m, np.arange(0)
        elif method == "pivoted_cholesky":
            diag = np.diag(op.matrix) if op.matrix is not None and diagonal is None else diagonal
            if diag is None:
                raise InvalidInput(
                    f"{_OPERATION}: method 'pivoted_cholesky' needs the kernel's diagonal, which an operator does not "
                    "know; pass diagonal= (e.g. from compute_ntk(mode='example_diagonal')) or use method='uniform'"
                )
            diag = np.asarray(diag, dtype=np.float64).reshape(-1)
            if diag.shape != (n,):
                raise ShapeMismatch(f"{_OPERATION}: diagonal has shape {diag.shape}; expected ({n},)")
            factor, chosen, products = _pivoted_cholesky(op, diag, m)
        else:
            raise InvalidInput(
                f"{_OPERATION}: unknown method {method!r}; expected 'uniform', 'pivoted_cholesky' or 'gaussian'"
            )
    if factor.shape[1] == 0:
        basis, eigenvalues = np.zeros((n, 0)), np.zeros(0)
    else:
        u, s, _ = np.linalg.svd(factor, full_matrices=False)
        keep = s > s[0] * np.sqrt(n * np.finfo(np.float64).eps)
        basis, eigenvalues = u[:, keep], s[keep] ** 2
    return NystromPreconditioner(
        basis=basis,
        eigenvalues=eigenvalues,
        shift=float(ridge),
        landmarks=np.asarray(chosen),
        method=str(method),
        products=products,
    )
