"""Linearized training on an operator: t = ∞ by CG, finite t by Lanczos, λmax by Lanczos.

NOTE [krylov predictions]
    With A = Θ + λI (TRACE: Θ / k per target column, NOTE [operator layout]) and r0 = f0 − y, the dense path's
    formulas (NOTE [losses and time scales] in ``linearized.py``) are matrix functions of A applied to r0:
    f_train(t) = y + D_t(A) r0 and f_test(t) = f0* − Θ* G_t(A) r0, with D_t, G_t the per-mode factors of
    ``_mode_factors`` (decay e^{−ηcλt} or (1 − ηcλ)^s, and (1 − decay) / λ). Finite t: one Lanczos run per target
    column evaluates every D_t and G_t at its Ritz values (NOTE [lanczos functions]); then one product of Θ* with
    the T columns G_t r0. t = ∞: G = A⁻¹ by preconditioned CG (NOTE [cg]); f_train = f0 − A α (α = A⁻¹ r0), which
    is y where CG converged. Modes at or below tol are frozen on the Ritz values exactly as the dense path freezes
    eigenvalues; the frozen count is not known (no full spectrum) and is reported as 0 with tol NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse.linalg

from ntk_service.analysis.eigen import SymmetricEigen
from ntk_service.analysis.solve.cg import CgOptions, conjugate_gradients
from ntk_service.analysis.solve.lanczos import lanczos_functions
from ntk_service.analysis.solve.operators import KernelOperator

__all__ = ["KrylovPredictions", "krylov_predictions", "operator_lambda_max", "scipy_view"]

Factors = Callable[[SymmetricEigen, float, float, str], tuple[np.ndarray, np.ndarray]]
"""``_mode_factors(eig, rate, t, flow) -> (decay, g)`` of ``linearized.py``, passed in (imports point down)."""


def scipy_view(op: KernelOperator, ridge: float = 0.0) -> scipy.sparse.linalg.LinearOperator:
    """A + λI as a SciPy ``LinearOperator`` on flat float64 vectors (for ``eigsh``)."""

    def matvec(x: np.ndarray) -> np.ndarray:
        v = np.asarray(x, dtype=np.float64).reshape(op.cols, 1)
        out: np.ndarray = (op.apply(v) + ridge * v).reshape(-1)
        return out

    return scipy.sparse.linalg.LinearOperator(shape=op.shape, dtype=np.float64, matvec=matvec, rmatvec=matvec)


def operator_lambda_max(op: KernelOperator, *, ridge: float = 0.0) -> float:
    """λmax(A + λI) by Lanczos (``eigsh``, which="LA"; dense eigvalsh below 3 rows, where ARPACK cannot run)."""
    if op.matrix is not None and op.rows < 3:
        return float(np.linalg.eigvalsh((op.matrix + op.matrix.T) / 2)[-1]) + ridge
    if op.rows < 3:
        dense = op.apply(np.eye(op.rows)) + ridge * np.eye(op.rows)
        return float(np.linalg.eigvalsh((dense + dense.T) / 2)[-1])
    value = scipy.sparse.linalg.eigsh(scipy_view(op, ridge), k=1, which="LA", return_eigenvectors=False)
    return float(value[0])


@dataclass(frozen=True)
class KrylovPredictions:
    """train (T, N, k), test (T, M, k) or None, path, and the solves run."""

    train: np.ndarray
    test: np.ndarray | None
    path: str
    solves: tuple[Any, ...]


def krylov_predictions(
    train_op: KernelOperator,
    cross_op: KernelOperator | None,
    y: np.ndarray,
    f0: np.ndarray,
    f0_star: np.ndarray | None,
    times: np.ndarray,
    *,
    rate: float,
    ridge: float,
    flow: str,
    rcond: float | None,
    options: CgOptions,
    factors: Factors,
) -> KrylovPredictions:
    """The linearized outputs at ``times`` (NOTE [krylov predictions]); y, f0 (N, k), f0_star (M, k)."""
    n, k = y.shape
    full = train_op.mode.value == "full"
    r0 = (f0 - y).reshape(n * k, 1) if full else f0 - y  # columns in the kernel's layout
    y_cols = y.reshape(r0.shape)
    m = 0 if cross_op is None else cross_op.n
    train = np.empty((times.size, n, k))
    test = None if cross_op is None else np.empty((times.size, m, k))
    solves: list[Any] = []
    finite = [i for i, t in enumerate(times) if math.isfinite(float(t))]
    infinite = [i for i, t in enumerate(times) if not math.isfinite(float(t))]
    eps = float(np.finfo(np.float64).eps)

    def functions(theta: np.ndarray) -> np.ndarray:
        tol = (theta.size * eps if rcond is None else rcond) * float(np.max(np.abs(theta)))
        eig = SymmetricEigen(theta, np.empty((0, 0)), tol)
        decays, gs = zip(*(factors(eig, rate, float(times[i]), flow) for i in finite), strict=True)
        return np.stack([*decays, *gs], axis=1)  # (j, 2F)

    if finite:
        g_cols = np.empty((len(finite), r0.shape[0], r0.shape[1]))  # G_t r0 per finite time
        for col in range(r0.shape[1]):
            run = lanczos_functions(
                train_op, r0[:, col], functions, ridge=ridge, rtol=options.rtol, max_iterations=options.max_iterations
            )
            solves.append(run)
            f = len(finite)
            for j, i in enumerate(finite):
                column = y_cols[:, col] + run.values[:, j]
                if full:
                    train[i] = column.reshape(n, k)
                else:
                    train[i, :, col] = column
                g_cols[j, :, col] = run.values[:, f + j]
        if cross_op is not None and test is not None and f0_star is not None:
            for j, i in enumerate(finite):
                test[i] = f0_star - cross_op.apply(g_cols[j]).reshape(m, k)
    if infinite:
        solve = conjugate_gradients(train_op, r0, ridge=ridge, options=options)
        solves.append(solve)
        alpha = solve.solution
        moved = train_op.apply(alpha) + ridge * alpha
        for i in infinite:
            train[i] = (r0 - moved + y_cols).reshape(n, k) if full else (y_cols + r0 - moved)
        if cross_op is not None and test is not None and f0_star is not None:
            at_inf = f0_star - cross_op.apply(alpha).reshape(m, k)
            for i in infinite:
                test[i] = at_inf
    parts = []
    if finite:
        its = sum(s.iterations for s in solves if not hasattr(s, "products"))
        parts.append(f"{flow}: Lanczos on a {train_op.rows}x{train_op.rows} operator ({its} steps)")
    if infinite:
        parts.append(f"t=inf: CG ({solves[-1].iterations} iterations, {solves[-1].preconditioner})")
    path = "; ".join(parts)
    if not all(bool(s.converged) for s in solves):
        path += "; NOT CONVERGED (see solves)"
    return KrylovPredictions(train=train, test=test, path=path, solves=tuple(solves))
