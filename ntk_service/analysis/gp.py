"""NTK-GP inference (kernel ridge regression with the NTK): posterior mean and covariance.

μ* = Θ*(Θ + λI)⁻¹ y (zero prior mean: the t = ∞ prediction of the linearized network with f0 = 0), and the
NTK-GP covariance Σ* = Θ** − Θ*(Θ + λI)⁻¹Θ*ᵀ (He et al. 2020). Layout and TRACE reading: NOTE [layout] in
``layout.py`` (a TRACE kernel is trace / k ⊗ I_k, so its covariance is one (M, M) block shared by every output).

Dense kernels are factored (NOTE [gp solve] in ``solve/dense.py``); operators are solved by a solver of the table
(``solve/table.py``: "auto" by NOTE [auto rule], or the one named), and the variance by block CG (NOTE [gp variance
by cg]). The posterior mean from the parameter-space method is J(x*) w: one JVP over the test inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ntk_service._tensors import is_torch_tensor
from ntk_service.analysis.eigen import DEFAULT_RCOND
from ntk_service.analysis.gp_variance import cross_columns, posterior_blocks, prior_at_test
from ntk_service.analysis.layout import to_float64, to_kernel_matrix, to_targets
from ntk_service.analysis.ridge import RidgeScale, ridge_value
from ntk_service.analysis.solve.cg import CgOptions, SolveResult, check_cg_memory, conjugate_gradients
from ntk_service.analysis.solve.dense import factor_solve
from ntk_service.analysis.solve.operators import KernelOperator, check_ridge, is_operator, kernel_operator
from ntk_service.analysis.solve.problem import (
    HeldOut,
    ProgressCallback,
    SolverOptions,
    SolverResult,
    SolverState,
    as_targets,
)
from ntk_service.analysis.solve.table import resolve_solver, solve_kernel
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.base import JacobianOperator

__all__ = ["GpPosterior", "gp_inference"]

_OPERATION = "gp_inference"


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
        solve: the solve of (Θ + λI) α = y on operators (α = ``solve.solution``, iterations, residual,
            ``converged``, passes, time): a ``SolverResult`` (its ``attempts`` say what ``auto`` tried; ``weights``
            w = Jᵀα for the parameter-space method), CG's ``SolveResult`` for a dense kernel by CG; None for the
            direct path.
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
    solve: SolverResult | SolveResult | None = None
    variance: np.ndarray | None = None
    variance_solve: SolveResult | None = None


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
    options: SolverOptions | None = None,
    heldout: HeldOut | None = None,
    progress: ProgressCallback | None = None,
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
        solver (str): a solver of the table (``solve/table.py``): "auto", "dense", "pcg", "block"; "direct" and
            "cg" are the older names of "dense" and "pcg". "auto" factors dense kernels (NOTE [gp solve]) and
            solves operators by NOTE [auto rule]; with ``cg`` given, or a ridge of 0, or ``k_test_test``, by CG as
            before. The kernels may be operators (NOTE [operator layout]). Default: auto.
        cg (CgOptions): rtol, iterations, preconditioner for CG. Default: CgOptions().
        warm_start: (N·k, 1) FULL or (N, k) TRACE, a previous ``solve.solution``, to start from. Default: None.
        options (SolverOptions): how the table's solvers run (rtol, time and pass limits, memory budget, block
            size, ...); its ``solver`` is used when ``solver`` is "auto". Default: None (SolverOptions()).
        heldout (HeldOut): a held-out set whose metric is reported per epoch / iteration. Default: None.
        progress: called with each ``Progress`` of the solve (operators). Default: None.

    Returns:
        GpPosterior: mean (M, k); covariance (M·k, M·k) FULL or (M, M) TRACE, or None; variance (M, k, k) FULL
        or (M,) TRACE, or None; and the solve's path.

    Raises:
        ShapeMismatch: kernels that are not square where they must be, or that do not match each other or y.
        InvalidInput: a negative or NaN ridge, an unknown ridge_scale or solver; with CG: k_test_test as an
            operator (pass its example diagonal), ridge_scale="relative" on an operator without a model (its
            diagonal is unknown; an ``ntk_operator``'s is read off the structured engine).
        NonFiniteInput: NaN in an input.
        MemoryEstimateExceeded: with CG and k_test_test, the variance's n × M·k vectors over
            ``cg.memory_budget_bytes`` (before any product).

    Cost: O((N·k)³) for the factorization, O(M·k·(N·k)²) for the covariance. CG: (iterations + landmarks + 1)
    products per target column (FULL has one column of N·k; TRACE k columns of N, each product k passes) plus
    one product with k_test_train; the variance adds M·k products with k_test_train's transpose (none for a
    dense one) and a solve of M·k columns (block CG: s ≤ M·k products per iteration).
    """
    name = resolve_solver(solver, operation=_OPERATION).name
    if name == "auto" and options is not None:
        name = resolve_solver(options.solver, operation=_OPERATION, field="options.solver").name
    operators = is_operator(k_train_train) or is_operator(k_test_train)
    by_cg = name == "pcg" or (
        name == "auto" and operators and (cg is not None or k_test_test is not None or ridge == 0)
    )
    if by_cg:
        return _gp_by_cg(
            k_train_train, y_train, k_test_train, k_test_test, ridge, ridge_scale, mode, cg or CgOptions(), warm_start
        )
    if operators:
        if k_test_test is not None:
            raise InvalidInput(
                f"{_OPERATION}: the variance (k_test_test) on operators is solved by CG; use solver='auto' or 'pcg'"
            )
        return _gp_by_table(
            name, k_train_train, y_train, k_test_train, ridge, ridge_scale, mode, options, warm_start, heldout, progress
        )
    if name not in ("auto", "dense"):
        raise InvalidInput(
            f"{_OPERATION}: solver {solver!r} needs the kernels as operators (ntk_operator, ...); dense kernels are "
            "solved by 'dense' (the default) or 'pcg'"
        )
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
    solve, jitter, solver, lambda_min = factor_solve(matrix, rcond)
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
    y, train, cross = _operators(k_train_train, y_train, k_test_train, mode)
    n, k = y.shape
    if train.matrix is not None:
        lam = ridge_value(train.matrix, ridge, ridge_scale, operation=_OPERATION)
    else:
        lam = _operator_ridge(train, ridge, ridge_scale)
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


def _gp_by_table(
    name: str,
    k_train_train: Any,
    y_train: Any,
    k_test_train: Any,
    ridge: float,
    ridge_scale: str,
    mode: KernelMode | str | None,
    options: SolverOptions | None,
    warm_start: Any,
    heldout: HeldOut | None,
    progress: ProgressCallback | None,
) -> GpPosterior:
    """The posterior mean on operators by a solver of the table (NOTE [auto rule]): α, then Θ* α, or J(x*) w
    when the parameter-space method kept w."""
    y, train, cross = _operators(k_train_train, y_train, k_test_train, mode)
    n, k = y.shape
    lam = _operator_ridge(train, ridge, ridge_scale)
    options = dataclasses.replace(options or SolverOptions(), solver=name)
    state = None
    if warm_start is not None:
        state = SolverState(
            solver="warm start", solution=to_float64(warm_start, name="warm_start", operation=_OPERATION)
        )
    result = solve_kernel(train, y, ridge=lam, options=options, heldout=heldout, progress=progress, state=state)
    if result.weights is not None and isinstance(cross.source, JacobianOperator) and cross.mode is KernelMode.FULL:
        mean = cross.source.jvp(result.weights)  # J(x*) w: one JVP over the test inputs
    else:
        mean = cross.apply(result.solution).reshape(cross.n, k)
    label = "cg" if result.solver == "pcg" else result.solver
    if not result.converged:
        label += f" (not converged: {result.stop_reason}, residual {float(result.residual.max()):.3g})"
    return GpPosterior(
        mean=mean, covariance=None, ridge=lam, jitter=0.0, solver=label, lambda_min=float("nan"), solve=result
    )


def _operator_ridge(train: KernelOperator, ridge: float, ridge_scale: str) -> float:
    """λ for an operator: absolute, or relative to the mean diagonal read off the structured engine."""
    check_ridge(ridge, operation=_OPERATION)
    if ridge_scale == "absolute":
        return float(ridge)
    if ridge_scale != "relative":
        raise InvalidInput(f"{_OPERATION}: unknown ridge_scale {ridge_scale!r}; expected 'absolute' or 'relative'")
    source = train.source
    if source is None:
        raise InvalidInput(
            f"{_OPERATION}: ridge_scale='relative' needs the kernel's mean diagonal entry, which this operator (no "
            "model behind it) does not know; pass an absolute ridge"
        )
    blocks = source.kernel_block([(0, train.n)], None, KernelMode.EXAMPLE_DIAGONAL)
    return float(ridge) * float(np.mean(np.trace(blocks, axis1=1, axis2=2)) / source.k)


def _operators(
    k_train_train: Any, y_train: Any, k_test_train: Any, mode: KernelMode | str | None
) -> tuple[np.ndarray, KernelOperator, KernelOperator]:
    """y (N, k) float64 and the train and test-train kernels as the solvers' views, checked against each other."""
    y = as_targets(y_train, name="y_train", operation=_OPERATION)
    n, k = y.shape
    train = kernel_operator(k_train_train, k=k, name="k_train_train", operation=_OPERATION, rows=n, cols=n, mode=mode)
    cross = kernel_operator(k_test_train, k=k, name="k_test_train", operation=_OPERATION, cols=n, mode=train.mode)
    return y, train, cross
