"""Matrix functions f(A + λI) b by Lanczos on a kernel seen through products (linearized training at finite t).

NOTE [lanczos functions]
    j steps of Lanczos from q₁ = b / ‖b‖ give an orthonormal basis Q_j (n, j) and a tridiagonal T_j = Q_jᵀ (A + λI)
    Q_j; with T_j = S diag(θ) Sᵀ, f(A + λI) b ≈ ‖b‖ Q_j S (f(θ) ⊙ S[0, :]) (the Ritz values θ stand in for the
    eigenvalues, so the same per-mode factors as the dense path apply to them). The basis is reorthogonalized fully
    against every earlier vector (twice, "twice is enough"): without it rounding makes Ritz values repeat and the
    estimate wanders. Every ``_CHECK_EVERY`` steps the estimate for all asked-for functions is compared with the
    previous one; the run stops when the largest relative change is ≤ rtol (reported as ``change``), when the
    Krylov space is invariant (β ≈ 0: the answer is then exact), or at ``max_iterations`` with ``converged`` False.
    Memory: n·j floats for Q_j. Smooth functions of a well-separated spectrum (e^{−ηct·λ} at small t) converge in
    a few dozen steps; t → ∞ needs as many steps as CG, which is what the t = ∞ path uses instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ntk_service.analysis.solve.operators import KernelOperator, check_ridge
from ntk_service.errors import InvalidInput, ShapeMismatch

__all__ = ["LanczosResult", "lanczos_functions"]

_CHECK_EVERY = 5
"""Steps between convergence checks (each check is an eigh of T_j and an (n, j) product, no operator product)."""

_OPERATION = "lanczos_functions"


@dataclass(frozen=True)
class LanczosResult:
    """f(A + λI) b for several functions f, by Lanczos.

    Attributes:
        values: (n, F) column i = f_i(A + λI) b. iterations: Lanczos steps (= operator products).
        converged: the last check changed by ≤ rtol, or the Krylov space was invariant. change: that relative change.
        ritz_values: (j,) the final Ritz values (ascending). time_s: wall time.
    """

    values: np.ndarray
    iterations: int
    converged: bool
    change: float
    ritz_values: np.ndarray
    time_s: float


def lanczos_functions(
    op: KernelOperator,
    b: np.ndarray,
    functions: Callable[[np.ndarray], np.ndarray],
    *,
    ridge: float = 0.0,
    rtol: float = 1e-8,
    max_iterations: int | None = None,
) -> LanczosResult:
    """f_i(A + λI) b for the F functions ``functions`` evaluates (NOTE [lanczos functions]).

    Args:
        op: a square symmetric kernel (``kernel_operator``). b: (n,) the start vector.
        functions: Ritz values θ (j,) -> (j, F), f_i(θ) in column i.
        ridge: λ ≥ 0. rtol: the stopping change. max_iterations: Default: min(n, 300).

    Returns:
        LanczosResult: values (n, F) and what the run did.

    Raises:
        ShapeMismatch: b not of length n. InvalidInput: a negative or NaN ridge, rtol ≤ 0.
    """
    lam = check_ridge(ridge, operation=_OPERATION)
    if not (rtol > 0 and np.isfinite(rtol)):
        raise InvalidInput(f"{_OPERATION}: rtol must be a positive number, got {rtol}")
    n = op.rows
    vector = np.asarray(b, dtype=np.float64).reshape(-1)
    if vector.shape != (n,):
        raise ShapeMismatch(f"{_OPERATION}: b has {vector.size} entries; the kernel has shape {op.shape}")
    start = time.perf_counter()
    limit = min(n, 300) if max_iterations is None else max(1, min(n, int(max_iterations)))
    norm = float(np.linalg.norm(vector))
    if norm == 0:
        width = functions(np.ones(1)).shape[1]
        return LanczosResult(np.zeros((n, width)), 0, True, 0.0, np.zeros(0), time.perf_counter() - start)
    basis = np.zeros((n, limit + 1))
    basis[:, 0] = vector / norm
    alphas: list[float] = []
    betas: list[float] = []
    previous: np.ndarray | None = None
    change, converged, estimate = np.inf, False, np.zeros((n, 0))
    ritz = np.zeros(0)
    scale = 0.0
    for j in range(limit):
        w = op.apply(basis[:, j : j + 1])[:, 0] + lam * basis[:, j]
        alpha = float(basis[:, j] @ w)
        alphas.append(alpha)
        for _ in range(2):  # full reorthogonalization, twice (NOTE [lanczos functions])
            w -= basis[:, : j + 1] @ (basis[:, : j + 1].T @ w)
        beta = float(np.linalg.norm(w))
        scale = max(scale, abs(alpha), beta)
        invariant = beta <= scale * n * np.finfo(np.float64).eps
        steps = j + 1
        if invariant or steps % _CHECK_EVERY == 0 or steps == limit:
            tri = np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1)
            ritz, vectors = np.linalg.eigh(tri)
            weights = functions(ritz) * vectors[0, :][:, None]  # (j, F)
            estimate = norm * (basis[:, :steps] @ (vectors @ weights))
            if invariant:
                change, converged = 0.0, True
                break
            if previous is not None:
                scale_est = max(float(np.max(np.linalg.norm(estimate, axis=0))), np.finfo(np.float64).tiny)
                change = float(np.max(np.linalg.norm(estimate - previous, axis=0))) / scale_est
                if change <= rtol:
                    converged = True
                    break
            previous = estimate
        betas.append(beta)
        basis[:, j + 1] = w / beta
    return LanczosResult(
        values=estimate,
        iterations=len(alphas),
        converged=converged,
        change=float(change),
        ritz_values=ritz,
        time_s=time.perf_counter() - start,
    )
