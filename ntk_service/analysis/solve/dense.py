"""The dense solver: (Θ + λI) factored by Cholesky, the kernel given or built by the structured engine.

NOTE [gp solve]
    (Θ + λI) is factored by Cholesky; if that fails (λ = 0 on a singular kernel, rounding below zero), the
    diagonal gets a jitter of 1e-10, 1e-9, ..., 1e-6 times its mean entry, stopping at the first that factors.
    If none does (a kernel with a clearly negative eigenvalue), the solve uses the eigen pseudo-inverse over
    modes with λ > tol (NOTE [non-positive modes] in ``eigen.py``). The path and the jitter are reported; the
    result is finite on every finite input.

NOTE [dense from an operator]
    Given an operator, the dense solver builds the kernel first: by the structured engine (``kernel_block`` of
    the ``JacobianOperator`` behind it: one ``compute_ntk`` over all N examples, FULL (N, N, k, k) read as the
    (N·k)² matrix, TRACE (N, N) / k), or, for an operator without a model, by n products with unit vectors, only
    up to ``DENSE_BY_PRODUCTS_MAX_ROWS``. Its memory is the matrix and its factor, ``DENSE_COPIES`` n² float64s,
    checked against the budget before anything is built. Time: the kernel, O(N²) pairs, plus n³ / 3 flops.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import scipy.linalg

from ntk_service.analysis.blas_guard import large_matrix_blas
from ntk_service.analysis.eigen import SymmetricEigen
from ntk_service.analysis.layout import add_to_diagonal
from ntk_service.analysis.solve.operators import KernelOperator
from ntk_service.analysis.solve.problem import (
    ProgressCallback,
    SolveProblem,
    SolverOptions,
    SolverResult,
    SolverState,
    heldout_value,
    peak_rss_bytes,
)
from ntk_service.kernels.modes import KernelMode

__all__ = ["DENSE_BY_PRODUCTS_MAX_ROWS", "DENSE_COPIES", "DenseSolver", "dense_matrix", "factor_solve"]

DENSE_COPIES = 3
"""float64 n × n arrays alive while a dense solve runs from an operator: the engine's kernel, its matrix layout and
the factor (from a dense kernel: its copy and the factor, one less)."""

DENSE_BY_PRODUCTS_MAX_ROWS = 1024
"""The most rows a kernel without a model (a foreign operator) is built for by products: n products."""

_JITTERS = (1e-10, 1e-9, 1e-8, 1e-7, 1e-6)
"""Relative jitters tried after a failed Cholesky (× the mean diagonal entry); past 1e-6 a jitter changes the
answer more than rounding would, so the pseudo-inverse takes over (NOTE [gp solve])."""


def factor_solve(
    matrix: np.ndarray, rcond: float | None, *, with_lambda_min: bool = True
) -> tuple[Any, float, str, float]:
    """A function rhs -> matrix⁻¹ rhs, the jitter, the path name and λmin (NOTE [gp solve]; NaN unless
    ``with_lambda_min``: it costs an eigensolve beside the factorization); ``matrix`` (n, n) float64 symmetric,
    only read: the factor is a copy with the jitter on its diagonal, so a failed factorization can try again."""
    with large_matrix_blas(matrix.shape[0]):  # NOTE [large blas]: a crash otherwise, from n ≈ 16,000
        return _factor_solve(matrix, rcond, with_lambda_min=with_lambda_min)


def _factor_solve(matrix: np.ndarray, rcond: float | None, *, with_lambda_min: bool) -> tuple[Any, float, str, float]:
    rows = matrix.shape[0]
    lambda_min = float("nan")
    if with_lambda_min:
        lambda_min = float(scipy.linalg.eigvalsh(matrix, subset_by_index=[0, 0])[0]) if matrix.size else 0.0
    scale = float(np.mean(np.diag(matrix))) if matrix.size else 1.0
    scale = scale if scale > 0 else 1.0
    for jitter in (0.0, *(j * scale for j in _JITTERS)):
        try:
            factor = scipy.linalg.cho_factor(add_to_diagonal(matrix, jitter), lower=True, overwrite_a=True)
        except np.linalg.LinAlgError:
            continue

        def solve(rhs: np.ndarray, factor: Any = factor) -> np.ndarray:
            with large_matrix_blas(rows):
                return np.asarray(scipy.linalg.cho_solve(factor, rhs))

        return solve, jitter, "cholesky" if jitter == 0 else "cholesky+jitter", lambda_min
    eig = SymmetricEigen.of(matrix, rcond=rcond)

    def pinv_apply(rhs: np.ndarray) -> np.ndarray:
        with large_matrix_blas(rows):
            return np.asarray(eig.pinv_apply(rhs))

    return pinv_apply, 0.0, "eigen pseudo-inverse", lambda_min


def dense_matrix(op: KernelOperator) -> np.ndarray:
    """The kernel as a float64 (rows, rows) matrix, a fresh array (NOTE [dense from an operator])."""
    if op.matrix is not None:
        return np.array(op.matrix)
    if op.source is not None:
        n = op.n
        if op.mode is KernelMode.FULL:
            theta = op.source.kernel_block([(0, n)], None, KernelMode.FULL)
            full: np.ndarray = np.ascontiguousarray(theta.transpose(0, 2, 1, 3).reshape(op.rows, op.rows))
            return full
        matrix: np.ndarray = op.source.kernel_block([(0, n)], None, KernelMode.TRACE)
        matrix /= op.k
        return matrix
    matrix = op.apply(np.eye(op.rows))
    out: np.ndarray = (matrix + matrix.T) / 2
    return out


class DenseSolver:
    """Cholesky on the dense kernel (NOTE [gp solve], NOTE [dense from an operator])."""

    name = "dense"

    def refusal(self, problem: SolveProblem, options: SolverOptions) -> str | None:
        op = problem.kernel
        if op.matrix is None and op.source is None and op.rows > DENSE_BY_PRODUCTS_MAX_ROWS:
            return (
                f"the kernel has no model to build it from, and {op.rows} rows > {DENSE_BY_PRODUCTS_MAX_ROWS} "
                "products with unit vectors is too many"
            )
        return None

    def memory_bytes(self, problem: SolveProblem, options: SolverOptions) -> int:
        copies = DENSE_COPIES - (1 if problem.kernel.matrix is not None else 0)
        return copies * problem.rows**2 * 8 + 4 * problem.rhs.size * 8

    def solve(
        self,
        problem: SolveProblem,
        options: SolverOptions,
        *,
        progress: ProgressCallback | None = None,
        state: SolverState | None = None,
    ) -> SolverResult:
        start = time.perf_counter()
        op, b = problem.kernel, problem.rhs
        matrix = dense_matrix(op)
        built_by_products = op.matrix is None and op.source is None
        matrix[np.diag_indices_from(matrix)] += problem.ridge
        # factor_solve factors a copy (two n² arrays at the peak: the matrix and its factor); the true residual is
        # read off the matrix itself, no product
        solve, jitter, path, _ = factor_solve(matrix, None, with_lambda_min=False)
        x = solve(b)
        r = b - matrix @ x
        del matrix
        bnorm = np.linalg.norm(b, axis=0)
        residual = np.linalg.norm(r, axis=0) / np.where(bnorm > 0, bnorm, 1.0)
        converged = bool(np.all(residual <= problem.rtol))
        passes = float(op.rows if built_by_products else 0)
        reason = "converged" if converged else f"rounding: the dense {path} leaves residual {residual.max():.2g}"
        heldout_curve: tuple[tuple[float, float], ...] = ()
        if problem.heldout is not None:
            heldout_curve = ((passes, heldout_value(problem.heldout, x, op.k, op.n, operation="dense solver")),)
        label = path if jitter == 0 else f"{path} ({jitter:.2g})"
        return SolverResult(
            solution=x,
            residual=residual,
            converged=converged,
            stop_reason=reason,
            solver=self.name,
            rtol=problem.rtol,
            time_s=time.perf_counter() - start,
            steps=1,
            passes=passes * op.passes_per_product if op.passes_per_product else 0.0,
            memory_bytes=self.memory_bytes(problem, options),
            peak_rss_bytes=peak_rss_bytes(),
            residual_curve=((0.0, float(residual.max())),),
            heldout_curve=heldout_curve,
            preconditioner=label,
            state=SolverState(solver=self.name, solution=x, steps=1),
        )
