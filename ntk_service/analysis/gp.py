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

from ntk_service._tensors import is_torch_tensor
from ntk_service.analysis.eigen import DEFAULT_RCOND, SymmetricEigen
from ntk_service.analysis.gp_variance import cross_columns, posterior_blocks, prior_at_test
from ntk_service.analysis.layout import add_to_diagonal, to_float64, to_kernel_matrix, to_targets
from ntk_service.analysis.ridge import RidgeScale, ridge_value
from ntk_service.analysis.solve import CgOptions, SolveResult, conjugate_gradients, is_operator, kernel_operator
from ntk_service.analysis.solve.cg import check_cg_memory
from ntk_service.analysis.solve.operators import check_ridge
from ntk_service.errors import InvalidInput, ShapeMismatch
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
            None without ``k_test_test`` or when it is only the example diagonal (CG).
        ridge: the λ added (after ``ridge_scale``). jitter: the extra diagonal a retried Cholesky needed (0 if
            none). solver: "cholesky", "cholesky+jitter", "eigen pseudo-inverse", "cg" or "cg (not converged:
            ...)". lambda_min: of Θ + λI; NaN after CG (it is not computed).
        solve: the CG solve (weights α = ``solve.solution``, iterations, residual, ``converged``, time); None for
            the direct paths.
        variance: each test example's posterior covariance block: (M, k, k) FULL (its diagonal the variances of
            the k outputs), (M,) TRACE (shared by all outputs); None without ``k_test_test``.
        variance_solve: the CG solve for the variance's M·k (TRACE: M) columns (NOTE [gp variance by cg]); None
            for the direct paths and without ``k_test_test``.
    """

    mean: np.ndarray
    covariance: np.ndarray | None
    ridge: float
    jitter: float
    solver: str
    lambda_min: float
    solve: SolveResult | None = None
    variance: np.ndarray | None = None
    variance_solve: SolveResult | None = None


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
    solver: str = "auto",
    cg: CgOptions | None = None,
    warm_start: Any = None,
) -> GpPosterior:
    """Posterior mean (and covariance) of the NTK-GP / kernel ridge regression.

    Args:
        k_train_train: Θ (N, N, k, k) FULL or (N, N) TRACE.
        y_train: (N, k) targets ((N,) for k = 1).
        k_test_train: Θ* (M, N, k, k) or (M, N).
        k_test_test: Θ** (M, M, k, k) or (M, M), for the covariance and the variance; with CG also only its
            example diagonal (M, k, k) (``compute_ntk(model, x_test, mode="example_diagonal")``; TRACE: that or
            the (M,) diagonal of the trace kernel), for the variance (NOTE [gp variance by cg]). Default: None
            (mean only).
        ridge (float): λ ≥ 0. Default: 0.
        ridge_scale (str): "absolute" (λI) or "relative" (λ · mean diagonal entry of Θ as used). Default: absolute.
        mode: checked against the shapes. Default: inferred.
        rcond: for the pseudo-inverse fallback. Default: n·eps.
        solver (str): "direct" (NOTE [gp solve]), "cg" (preconditioned CG, NOTE [cg] in ``solve/cg.py``) or
            "auto" (CG when k_train_train is an operator, else direct). The kernels may then be
            ``NtkOperator``s or any objects with ``shape`` and ``matvec`` (NOTE [operator layout]). Default: auto.
        cg (CgOptions): rtol, iterations, preconditioner for CG. Default: CgOptions().
        warm_start: (N·k, 1) FULL or (N, k) TRACE, a previous ``solve.solution``, for CG. Default: None.

    Returns:
        GpPosterior: mean (M, k); covariance (M·k, M·k) FULL or (M, M) TRACE, or None; variance (M, k, k) FULL
        or (M,) TRACE, or None; and the solve's path.

    Raises:
        ShapeMismatch: kernels that are not square where they must be, or that do not match each other or y.
        InvalidInput: a negative or NaN ridge, an unknown ridge_scale or solver; with CG: k_test_test as an
            operator (pass its example diagonal), ridge_scale="relative" on an operator (its diagonal is unknown).
        NonFiniteInput: NaN in an input.
        MemoryEstimateExceeded: with CG and k_test_test, the variance's n × M·k vectors over
            ``cg.memory_budget_bytes`` (before any product).

    Cost: O((N·k)³) for the factorization, O(M·k·(N·k)²) for the covariance. CG: (iterations + landmarks + 1)
    products per target column (FULL has one column of N·k; TRACE k columns of N, each product k passes) plus
    one product with k_test_train; the variance adds M·k products with k_test_train's transpose (none for a
    dense one) and a solve of M·k columns (block CG: s ≤ M·k products per iteration).
    """
    if solver not in ("auto", "direct", "cg"):
        raise InvalidInput(f"{_OPERATION}: unknown solver {solver!r}; expected 'auto', 'direct' or 'cg'")
    if solver == "cg" or (solver == "auto" and is_operator(k_train_train)):
        return _gp_by_cg(
            k_train_train, y_train, k_test_train, k_test_test, ridge, ridge_scale, mode, cg or CgOptions(), warm_start
        )
    if is_operator(k_train_train) or is_operator(k_test_train):
        raise InvalidInput(f"{_OPERATION}: solver='direct' needs dense kernels; use solver='cg' for operators")
    y_raw = np.asarray(y_train.detach().cpu() if is_torch_tensor(y_train) else y_train)
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
    return GpPosterior(
        mean=mean,
        covariance=covariance,
        ridge=lam,
        jitter=jitter,
        solver=solver,
        lambda_min=lambda_min,
        variance=None if covariance is None else _blocks(covariance, cross.n, k, full),
    )


def _blocks(covariance: np.ndarray, m: int, k: int, full: bool) -> np.ndarray:
    """The example-diagonal blocks of a covariance: (M, k, k) FULL, (M,) TRACE."""
    if not full:
        return np.diag(covariance).copy()
    return np.stack([covariance[i * k : (i + 1) * k, i * k : (i + 1) * k] for i in range(m)]).reshape(m, k, k)


def _gp_by_cg(
    k_train_train: Any,
    y_train: Any,
    k_test_train: Any,
    k_test_test: Any,
    ridge: float,
    ridge_scale: str,
    mode: KernelMode | str | None,
    options: CgOptions,
    warm_start: Any,
) -> GpPosterior:
    """The posterior mean by CG on (Θ + λI) α = y, then Θ* α (NOTE [cg], NOTE [operator layout]); with
    k_test_test the variance (NOTE [gp variance by cg])."""
    check_ridge(ridge, operation=_OPERATION)
    y = to_float64(y_train, name="y_train", operation=_OPERATION)
    y = y[:, None] if y.ndim == 1 else y
    if y.ndim != 2:
        raise ShapeMismatch(f"{_OPERATION}: y_train has shape {y.shape}; expected (N, k) or (N,)")
    n, k = y.shape
    train = kernel_operator(k_train_train, k=k, name="k_train_train", operation=_OPERATION, rows=n, cols=n, mode=mode)
    cross = kernel_operator(k_test_train, k=k, name="k_test_train", operation=_OPERATION, cols=n, mode=train.mode)
    if ridge_scale == "relative" and train.matrix is None:
        raise InvalidInput(
            f"{_OPERATION}: ridge_scale='relative' needs the kernel's mean diagonal entry, which an operator does not "
            "know; pass an absolute ridge (e.g. ridge = 1e-3 × mean of compute_ntk(mode='example_diagonal'))"
        )
    diagonal = train.matrix if train.matrix is not None else np.zeros((1, 1))
    lam = ridge_value(diagonal, ridge, ridge_scale, operation=_OPERATION)
    full = train.mode is KernelMode.FULL
    rhs = y.reshape(-1, 1) if full else y
    prior = None
    if k_test_test is not None:  # checked, and the memory estimated, before any product
        prior = prior_at_test(k_test_test, m=cross.n, k=k, mode=train.mode, operation=_OPERATION)
        dense_bytes = 0 if prior.matrix is None else 2 * prior.matrix.size * 8
        check_cg_memory(train.rows, cross.rows, options, operation=_OPERATION, extra_bytes=dense_bytes)
    result = conjugate_gradients(train, rhs, ridge=lam, options=options, x0=warm_start)
    mean = cross.apply(result.solution).reshape(cross.n, k)
    variance = covariance = variance_solve = None
    if prior is not None:
        b = cross_columns(k_test_train, cross, k=k, operation=_OPERATION)
        variance_solve = conjugate_gradients(train, b, ridge=lam, options=options)
        variance = posterior_blocks(prior, b, variance_solve.solution, m=cross.n, k=k, full=full)
        if prior.matrix is not None:
            covariance = prior.matrix - b.T @ variance_solve.solution
            covariance = (covariance + covariance.T) / 2
    solves = [s for s in (result, variance_solve) if s is not None]
    failed = [s for s in solves if not s.converged]
    worst = max((float(s.residual.max()) for s in solves if s.residual.size), default=0.0)
    solver = "cg" if not failed else f"cg (not converged: {failed[0].stop_reason}, residual {worst:.3g})"
    return GpPosterior(
        mean=mean,
        covariance=covariance,
        ridge=lam,
        jitter=0.0,
        solver=solver,
        lambda_min=float("nan"),
        solve=result,
        variance=variance,
        variance_solve=variance_solve,
    )
