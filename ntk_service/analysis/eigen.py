"""The symmetric eigendecomposition every dense analysis shares, and its policy for non-positive modes.

NOTE [non-positive modes]
    An empirical kernel is PSD in exact arithmetic, but float rounding (or a kernel from elsewhere) gives
    eigenvalues ≤ 0. A mode with λ ≤ tol = rcond · max|λ| (rcond = ``DEFAULT_RCOND`` unless given) is *frozen*:
    gradient descent does not move the outputs along it at any t, the pseudo-inverse drops it at t = ∞, and the
    GP solve treats it as noise. This is exactly right for a null mode of Θ = J Jᵀ (Θ* = J* Jᵀ annihilates it, so
    it cannot change a prediction either), and it is what neural-tangents' finite-t path does with max(λ, 0) —
    except that an exactly zero eigenvalue there gives 0/0 = NaN, and here it gives nothing to the sum. Results
    report λmin (signed) and how many modes were frozen, so nothing is hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ntk_service.analysis.blas_guard import large_matrix_blas

__all__ = ["DEFAULT_RCOND", "SymmetricEigen", "eigen_tolerance"]

_EPS = float(np.finfo(np.float64).eps)


def eigen_tolerance(eigenvalues: np.ndarray, rcond: float | None = None) -> float:
    """tol = rcond · max|λ|; rcond defaults to n · eps (numpy's ``matrix_rank`` / ``pinv`` convention)."""
    if eigenvalues.size == 0:
        return 0.0
    factor = eigenvalues.size * _EPS if rcond is None else rcond
    return float(factor * np.max(np.abs(eigenvalues)))


DEFAULT_RCOND = None
"""None means n · eps, numpy's own default for ranks and pseudo-inverses: a mode this small relative to λmax
is indistinguishable from rounding in a float64 matrix of size n."""


@dataclass(frozen=True)
class SymmetricEigen:
    """Θ = V diag(λ) Vᵀ of a symmetric (n, n) float64 matrix, ascending λ (``numpy.linalg.eigh``).

    Attributes:
        eigenvalues: (n,) ascending, signed. eigenvectors: (n, n), column i for λ_i.
        tol: modes with λ ≤ tol are frozen (NOTE [non-positive modes]).
    """

    eigenvalues: np.ndarray
    eigenvectors: np.ndarray
    tol: float

    @classmethod
    def of(cls, matrix: np.ndarray, *, rcond: float | None = DEFAULT_RCOND) -> SymmetricEigen:
        """Decompose a symmetric ``matrix`` (only its lower triangle is read, as LAPACK does).

        Cost O(n³) time; memory ~3·n² floats beside the input (LAPACK's copy, the eigenvectors, its workspace).
        """
        with large_matrix_blas(matrix.shape[0]):  # NOTE [large blas]
            eigenvalues, eigenvectors = np.linalg.eigh(matrix)
        return cls(eigenvalues, eigenvectors, eigen_tolerance(eigenvalues, rcond))

    @property
    def active(self) -> np.ndarray:
        """(n,) bool: the modes with λ > tol, the ones that move."""
        return np.asarray(self.eigenvalues > self.tol)

    @property
    def frozen_modes(self) -> int:
        """How many modes have λ ≤ tol."""
        return int(self.eigenvalues.size - np.count_nonzero(self.active))

    @property
    def lambda_min(self) -> float:
        return float(self.eigenvalues[0]) if self.eigenvalues.size else 0.0

    @property
    def lambda_max(self) -> float:
        return float(self.eigenvalues[-1]) if self.eigenvalues.size else 0.0

    def pinv_apply(self, rhs: np.ndarray) -> np.ndarray:
        """Θ⁺ rhs over the active modes only: (n, c) -> (n, c)."""
        inv = np.where(self.active, 1.0 / np.where(self.active, self.eigenvalues, 1.0), 0.0)
        result: np.ndarray = self.eigenvectors @ (inv[:, None] * (self.eigenvectors.T @ rhs))
        return result
