"""The two CG sweeps behind ``conjugate_gradients``: "batched" (a Krylov space per column) and "block" (one shared).

A sweep runs CG from the current X and its residual R until every column meets rtol, the iterations run out or
``should_stop`` gives a reason (the time limit, a caller's callback); ``conjugate_gradients`` (``cg.py``) owns the
setup, the true-residual check and the warm restarts around it (NOTE [cg]). Both update ``x``, ``r`` and
``residual`` in place and take only the columns still moving.

NOTE [block cg]
    O'Leary's block CG (1980) runs the r right-hand sides in one Krylov space: with search directions P (n, s),
    Q = (A + λI) P, α = (PᵀQ)⁻¹ PᵀR, X += P α, R −= Q α, β = −(PᵀQ)⁻¹ QᵀZ (Z = M⁻¹R), P = orth(Z + P β). A
    column's residual is then orthogonal to every column's search directions, so r columns of one kernel (the k
    TRACE targets, the M·k columns of Θ(x, x*) for a GP variance) resolve the kernel's few large outlying modes
    once between them instead of once each. Plain block CG divides by PᵀQ, singular as soon as the block loses
    rank (two equal columns, a column that has converged, residuals that align); the breakdown-free variant of
    Ji and Li (2017) orthonormalizes Z + Pβ rank-revealingly and keeps only the directions that matter (NOTE
    [rank decision]), so s ≤ r shrinks instead of blowing up. A converged column leaves the block (its x is
    final; the stopping rule is per column, as in the batched sweep), and P stays orthonormal, so PᵀQ has the
    spectrum of A + λI restricted to span(P) and a Cholesky that fails means the operator is not positive
    definite ("breakdown"). One iteration costs s products (one per direction): the sweep pays off when the
    shared space lets it stop after fewer iterations × s than the batched sweep's Σ over columns.

NOTE [rank decision]
    Which directions of W = Z + Pβ to keep decides whether block CG converges at all. The columns are scaled to
    unit norm (a column with a small residual is not a dependent one), then a Householder QR and an SVD of its
    triangle give the singular directions to rounding (unlike the Gram matrix's eigenvalues, which lose
    everything below √eps of the largest). A direction is dropped when it is numerically zero (``RANK_TOL``) or
    when its part of every column, times that column's relative residual, is at most ``DEPENDENT_SHARE`` × rtol:
    then it cannot carry any column across rtol. The second rule is the one that matters. Equal right-hand sides
    stay equal only up to the recursion's rounding, which is eps × ‖b‖ in absolute terms and so grows relative to
    a shrinking residual; measured against the unit columns alone, that noise looks like a real direction late
    in the solve, and chasing it costs products. A fixed relative cut instead drops real directions of columns
    whose residuals have aligned; each drop loses their conjugacy and restarts part of the search, which on an
    ill-conditioned kernel multiplies the iterations many times over.
    P = Q U is orthonormal to rounding whatever the kept singular values, so nothing is divided by a small σ.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.linalg

__all__ = ["RANK_TOL", "Sweep", "batched_sweep", "block_sweep", "orthonormal_basis"]

RANK_TOL = 1e-12
"""Directions of the unit-column block whose singular value is below this fraction of the largest are dropped
(NOTE [rank decision]): a few hundred times the rounding of the QR and SVD that measure them."""

DEPENDENT_SHARE = 1e-2
"""A direction is dropped when its part of every column's relative residual is at most this fraction of rtol
(NOTE [rank decision]): it could not move any column across rtol."""

BREAKDOWN = "breakdown: pᵀ(A + λI)p ≤ 0, the kernel (plus ridge) is not positive definite"

Product = Callable[[np.ndarray], np.ndarray]
"""V (n, s) -> (A + λI) V (n, s), counting s products."""

Sweep = Callable[..., tuple[int, str | None]]
"""``batched_sweep`` or ``block_sweep``: returns (iterations run, a stop reason or None when all converged)."""


def orthonormal_basis(w: np.ndarray, shares: np.ndarray | None = None, floor: float = 0.0) -> np.ndarray:
    """An orthonormal basis (n, s) of span(w) for w (n, r), s ≤ r (NOTE [block cg], NOTE [rank decision]).

    Args:
        w: (n, r) the block. shares: (r,) each column's size in the problem's units (its relative residual);
            with it, a direction whose part in every column, times that column's share, is at most ``floor`` is
            dropped. Default: None (only directions below ``RANK_TOL`` × the largest are dropped).

    Returns:
        (n, s) float64 with orthonormal columns to rounding; (n, 0) for a zero block.
    """
    norms = np.linalg.norm(w, axis=0)
    nonzero = norms > 0
    if not np.any(nonzero):
        return np.zeros((w.shape[0], 0))
    basis, triangle = np.linalg.qr(w[:, nonzero] / norms[nonzero])
    left, sigma, right = np.linalg.svd(triangle)  # unit column j = Σ_i (basis @ left)_i σ_i right_ij
    keep = sigma > RANK_TOL * sigma[0]
    if shares is not None:
        part = sigma[:, None] * np.abs(right) * shares[nonzero][None, :]  # direction i's size in column j
        keep &= part.max(axis=1) > floor
    return np.asarray(basis @ left[:, keep])


def _precondition(pre: object, r: np.ndarray) -> np.ndarray:
    return r.copy() if pre is None else np.asarray(pre.apply(r))  # type: ignore[attr-defined]


def batched_sweep(
    x: np.ndarray,
    r: np.ndarray,
    residual: np.ndarray,
    active: np.ndarray,
    *,
    bnorm: np.ndarray,
    rtol: float,
    product: Product,
    pre: object,
    max_iterations: int,
    should_stop: Callable[[int], str | None],
) -> tuple[int, str | None]:
    """Per-column CG on the ``active`` columns of X (n, r): each column's own scalars, one product per moving
    column per iteration (NOTE [cg])."""
    z = _precondition(pre, r[:, active])
    p = z.copy()
    rz = np.sum(r[:, active] * z, axis=0)
    iterations = 0
    while active.size and iterations < max_iterations:
        reason = should_stop(iterations)
        if reason is not None:
            return iterations, reason
        ap = product(p)
        pap = np.sum(p * ap, axis=0)
        if np.any(pap <= 0):
            return iterations, BREAKDOWN
        alpha = rz / pap
        x[:, active] += alpha * p
        r[:, active] -= alpha * ap
        iterations += 1
        residual[active] = np.linalg.norm(r[:, active], axis=0) / bnorm[active]
        keep = residual[active] > rtol
        active, p, rz = active[keep], p[:, keep], rz[keep]
        if not active.size:
            break
        z = _precondition(pre, r[:, active])
        rz_new = np.sum(r[:, active] * z, axis=0)
        p = z + (rz_new / rz) * p
        rz = rz_new
    return iterations, None if not active.size else "max_iterations"


def block_sweep(
    x: np.ndarray,
    r: np.ndarray,
    residual: np.ndarray,
    active: np.ndarray,
    *,
    bnorm: np.ndarray,
    rtol: float,
    product: Product,
    pre: object,
    max_iterations: int,
    should_stop: Callable[[int], str | None],
) -> tuple[int, str | None]:
    """Breakdown-free block CG on the ``active`` columns of X (n, r): one Krylov space for all, s ≤ r products
    per iteration (NOTE [block cg])."""
    floor = DEPENDENT_SHARE * rtol
    p = orthonormal_basis(_precondition(pre, r[:, active]), residual[active], floor)
    iterations = 0
    while active.size and iterations < max_iterations:
        reason = should_stop(iterations)
        if reason is not None:
            return iterations, reason
        if p.shape[1] == 0:  # M⁻¹R = 0 with R ≠ 0: a singular preconditioner
            return iterations, "breakdown: the preconditioner maps the residual to zero"
        q = product(p)  # (n, s)
        ptq = p.T @ q
        try:
            factor = scipy.linalg.cho_factor((ptq + ptq.T) / 2, lower=True)
        except np.linalg.LinAlgError:
            return iterations, BREAKDOWN
        alpha = scipy.linalg.cho_solve(factor, p.T @ r[:, active])  # (s, a)
        x[:, active] += p @ alpha
        r[:, active] -= q @ alpha
        iterations += 1
        residual[active] = np.linalg.norm(r[:, active], axis=0) / bnorm[active]
        active = active[residual[active] > rtol]
        if not active.size:
            break
        z = _precondition(pre, r[:, active])
        beta = scipy.linalg.cho_solve(factor, q.T @ z)  # (s, a)
        p = orthonormal_basis(z - p @ beta, residual[active], floor)
    return iterations, None if not active.size else "max_iterations"
