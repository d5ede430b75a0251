"""NTK-GP inference (kernel ridge regression with the NTK): posterior mean and covariance.

μ* = Θ*(Θ + λI)⁻¹ y (zero prior mean: the t = ∞ prediction of the linearized network with f0 = 0), and the
NTK-GP covariance Σ* = Θ** − Θ*(Θ + λI)⁻¹Θ*ᵀ (He et al. 2020). Layout and TRACE reading: NOTE [layout] in
``layout.py`` (a TRACE kernel is trace / k ⊗ I_k, so its covariance is one (M, M) block shared by every output).

NOTE [gp solve]
    (Θ + λI) is factored by Cholesky; if that fails (λ = 0 on a singular kernel, rounding below zero), the
    diagonal gets a jitter of 1e-10, 1e-9, ..., 1e-6 times its mean entry, stopping at the first that factors.
    If none does (a kernel with a clearly negative eigenvalue), the solve uses the eigen pseudo-inverse over
    modes with λ > tol (NOTE [non-positive modes] in ``eigen.py``). The path and the jitter are reported; the
    result is finite on every finite input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg

from ntk_service.analysis.eigen import DEFAULT_RCOND, SymmetricEigen
from ntk_service.analysis.layout import add_to_diagonal, to_kernel_matrix, to_targets
from ntk_service.analysis.ridge import RidgeScale, ridge_value
from ntk_service.errors import ShapeMismatch
from ntk_service.kernels.modes import KernelMode

__all__ = ["GpPosterior", "gp_inference"]

_OPERATION = "gp_inference"

_JITTERS = (1e-10, 1e-9, 1e-8, 1e-7, 1e-6)
"""Relative jitters tried after a failed Cholesky (× the mean diagonal entry); past 1e-6 a jitter changes the
answer more than rounding would, so the pseudo-inverse takes over (NOTE [gp solve])."""


@dataclass(frozen=True)
class GpPosterior:
    """The posterior of the NTK-GP.

    Attributes:
        mean: (M, k) posterior mean on the test inputs.
        covariance: (M·k, M·k) example-major (row m·k + a) for FULL; (M, M) shared by all outputs for TRACE;
            None without ``k_test_test``.
        ridge: the λ added (after ``ridge_scale``). jitter: the extra diagonal a retried Cholesky needed (0 if
            none). solver: "cholesky", "cholesky+jitter" or "eigen pseudo-inverse". lambda_min: of Θ + λI.
    """

    mean: np.ndarray
    covariance: np.ndarray | None
    ridge: float
    jitter: float
    solver: str
    lambda_min: float


def _solver(matrix: np.ndarray, rcond: float | None) -> tuple[Any, float, str, float]:
    """A function rhs -> matrix⁻¹ rhs, the jitter, the path name and λmin (NOTE [gp solve])."""
    lambda_min = float(scipy.linalg.eigvalsh(matrix, subset_by_index=[0, 0])[0]) if matrix.size else 0.0
    scale = float(np.mean(np.diag(matrix))) if matrix.size else 1.0
    scale = scale if scale > 0 else 1.0
    for jitter in (0.0, *(j * scale for j in _JITTERS)):
        try:
            factor = scipy.linalg.cho_factor(add_to_diagonal(matrix, jitter), lower=True, overwrite_a=True)
        except np.linalg.LinAlgError:
            continue

        def solve(rhs: np.ndarray, factor: Any = factor) -> np.ndarray:
            return np.asarray(scipy.linalg.cho_solve(factor, rhs))

        return solve, jitter, "cholesky" if jitter == 0 else "cholesky+jitter", lambda_min
    eig = SymmetricEigen.of(matrix, rcond=rcond)
    return eig.pinv_apply, 0.0, "eigen pseudo-inverse", lambda_min


def gp_inference(
    k_train_train: Any,
    y_train: Any,
    k_test_train: Any,
    k_test_test: Any = None,
    *,
    ridge: float = 0.0,
    ridge_scale: RidgeScale | str = "absolute",
    mode: KernelMode | str | None = None,
    rcond: float | None = DEFAULT_RCOND,
) -> GpPosterior:
    """Posterior mean (and covariance) of the NTK-GP / kernel ridge regression.

    Args:
        k_train_train: Θ (N, N, k, k) FULL or (N, N) TRACE.
        y_train: (N, k) targets ((N,) for k = 1).
        k_test_train: Θ* (M, N, k, k) or (M, N).
        k_test_test: Θ** (M, M, k, k) or (M, M), for the covariance. Default: None (mean only).
        ridge (float): λ ≥ 0. Default: 0.
        ridge_scale (str): "absolute" (λI) or "relative" (λ · mean diagonal entry of Θ as used). Default: absolute.
        mode: checked against the shapes. Default: inferred.
        rcond: for the pseudo-inverse fallback. Default: n·eps.

    Returns:
        GpPosterior: mean (M, k); covariance (M·k, M·k) FULL or (M, M) TRACE, or None; and the solve's path.

    Raises:
        ShapeMismatch: kernels that are not square where they must be, or that do not match each other or y.
        InvalidInput: a negative ridge, an unknown ridge_scale.
        NonFiniteInput: NaN in an input.

    Cost: O((N·k)³) for the factorization, O(M·k·(N·k)²) for the covariance.
    """
    y_raw = np.asarray(y_train.detach().cpu() if hasattr(y_train, "detach") else y_train)
    k_hint = y_raw.shape[1] if y_raw.ndim == 2 else 1
    train = to_kernel_matrix(
        k_train_train,
        name="k_train_train",
        operation=_OPERATION,
        mode=mode,
        square=True,
        symmetrize=True,
        trace_outputs=k_hint,
    )
    y = to_targets(y_train, n=train.n, k=train.k, name="y_train", operation=_OPERATION)
    k = y.shape[1]
    cross = to_kernel_matrix(k_test_train, name="k_test_train", operation=_OPERATION, mode=train.mode, trace_outputs=k)
    if cross.m != train.n or cross.k != train.k:
        raise ShapeMismatch(
            f"{_OPERATION}: k_test_train has {cross.m} training examples (k = {cross.k}), k_train_train has "
            f"{train.n} (k = {train.k}); pass Θ(x_test, x_train)"
        )
    lam = ridge_value(train.matrix, ridge, ridge_scale, operation=_OPERATION)
    matrix = train.matrix  # our own copy (to_kernel_matrix): the ridge goes on in place
    matrix[np.diag_indices_from(matrix)] += lam
    solve, jitter, solver, lambda_min = _solver(matrix, rcond)
    full = train.mode is KernelMode.FULL
    rhs = y.reshape(-1, 1) if full else y
    mean = (cross.matrix @ solve(rhs)).reshape(cross.n, k)
    covariance = None
    if k_test_test is not None:
        test = to_kernel_matrix(
            k_test_test,
            name="k_test_test",
            operation=_OPERATION,
            mode=train.mode,
            square=True,
            symmetrize=True,
            trace_outputs=k,
        )
        if test.n != cross.n or test.k != train.k:
            raise ShapeMismatch(
                f"{_OPERATION}: k_test_test has {test.n} examples (k = {test.k}), k_test_train has {cross.n} "
                f"(k = {train.k}); pass Θ(x_test, x_test)"
            )
        covariance = test.matrix - cross.matrix @ solve(cross.matrix.T)
        covariance = (covariance + covariance.T) / 2
    return GpPosterior(mean=mean, covariance=covariance, ridge=lam, jitter=jitter, solver=solver, lambda_min=lambda_min)
