"""A Nyström preconditioner whose rank adapts to the kernel: randomly pivoted Cholesky on the structured engine's
kernel columns, grown block by block until the next modes are down at the floor.

NOTE [adaptive nystrom]
    Landmarks by RPCholesky (Chen, Epperly, Tropp, Webber 2023; the block form of Epperly et al. 2024): a block
    of examples (``PIVOT_BLOCK``, doubling each round) is drawn with probability ∝ the residual diagonal of
    Θ_s = Θ_trace / k (exactly what the current factor F, Θ_s ≈ F Fᵀ, misses on each example), their columns
    Θ_trace(x, x[S]) / k come from the structured engine (``kernel_block``: no operator products), and the factor
    grows by the Cholesky of the new columns' residual. Pivots where the residual is large are where the
    approximation is worst, so the head of the spectrum (the class means, the input-linear modes) is taken first
    and few columns are wasted on it.

    The rank adapts to the effective dimension at the shift the preconditioner leaves, μ = ē + λ, ē the mean
    residual diagonal (the floor the remaining spectrum sits on): the number of modes above ``RANK_RATIO`` × μ,
    the modes that would otherwise each add more than ``RANK_RATIO`` to the preconditioned condition number
    (λ_{m+1} + λ) / (λ_min + λ). Rounds go on while at least ``HEAD_SHARE`` of the modes a round adds are above it
    (a round's own pivots always add some modes at the floor, the diagonal part of their columns). An NTK's
    spectrum has a head far above a floor (at N = 8000 on the benchmark MLP, eigenvalue / λ from 1.7·10⁶ down to a
    floor near 280: docs/benchmarks.md), so the rank stops after the head, which grows with N. It also stops at
    ``max_rank`` (the memory budget's: the factor and its basis are N × m float64s each).

    The factor is float64 and grows in place; the basis U is kept in float32 (applied in float64 row blocks, as
    the streamed preconditioner's: NOTE [streamed nystrom]), so the build takes ``BYTES_PER_ENTRY`` bytes per
    entry of N × m and the solve 4.

    For a FULL kernel the basis is over examples and shared by the k outputs (NOTE [shared nystrom] in
    ``preconditioners.py``); for a TRACE kernel it is the kernel's own. The preconditioner is Frangella, Tropp and
    Udell's (NOTE [nystrom preconditioner]).
"""

from __future__ import annotations

import time

import numpy as np

from ntk_service.analysis.solve.operators import KernelOperator
from ntk_service.analysis.solve.preconditioners import NystromPreconditioner
from ntk_service.errors import InvalidInput
from ntk_service.kernels.modes import KernelMode

__all__ = [
    "BYTES_PER_ENTRY",
    "HEAD_SHARE",
    "PIVOT_BLOCK",
    "RANK_RATIO",
    "adaptive_nystrom_preconditioner",
    "max_adaptive_rank",
]

PIVOT_BLOCK = 100
"""Examples pivoted in the first round; each round doubles it (NOTE [adaptive nystrom]): a round's columns are a
``compute_ntk`` TRACE call over all N rows, whose work on the N examples' side is paid again each round (8192 × 100
columns took as long as a product of 8192 examples), so rounds are few: log2(m / 100) + 1."""

RANK_RATIO = 4.0
"""The rank grows until the smallest kept mode is within this factor of the floor plus λ (NOTE [adaptive nystrom])."""

HEAD_SHARE = 0.25
"""The share of a round's new modes that must stand above ``RANK_RATIO`` × the floor for the next round to run."""

DEFAULT_MAX_RANK = 4000
"""The rank cap when the memory budget allows more (the factor's Cholesky updates cost O(N·m²))."""

ROW_CHUNK = 8192
"""Rows of kernel columns computed per ``compute_ntk`` call (the engine's workspace stays one chunk's)."""

BYTES_PER_ENTRY = 16
"""Bytes per entry of N × m while the preconditioner is built: the float64 factor (8), the last round's float64
columns (at most half the rank: 4) and the float32 basis (4); the factor is freed after, the basis stays."""


def max_adaptive_rank(examples: int, budget_bytes: int) -> int:
    """The largest rank whose build fits ``budget_bytes`` (``BYTES_PER_ENTRY`` per N × m entry), capped at
    ``DEFAULT_MAX_RANK`` and at N."""
    return int(max(0, min(DEFAULT_MAX_RANK, examples, budget_bytes // (BYTES_PER_ENTRY * max(examples, 1)))))


def _float32_basis(factor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """U (N, m') float32 and Λ (m',) descending of F Fᵀ, from the m × m Gram matrix (``nystrom_basis``'s rule
    for dropping modes), U written in row blocks: no second float64 N × m array."""
    n, m = factor.shape
    if m == 0:
        return np.zeros((n, 0), dtype=np.float32), np.zeros(0)
    values, vectors = np.linalg.eigh(factor.T @ factor)
    order = np.argsort(values)[::-1]
    values, vectors = values[order], vectors[:, order]
    keep = values > max(float(values[0]), 0.0) * n * np.finfo(np.float64).eps
    project = vectors[:, keep] / np.sqrt(values[keep])
    basis = np.empty((n, int(keep.sum())), dtype=np.float32)
    for i in range(0, n, ROW_CHUNK):
        basis[i : i + ROW_CHUNK] = factor[i : i + ROW_CHUNK] @ project
    return basis, values[keep]


def adaptive_nystrom_preconditioner(
    op: KernelOperator, *, ridge: float, max_rank: int, seed: int = 0
) -> NystromPreconditioner:
    """The RPCholesky Nyström preconditioner of NOTE [adaptive nystrom] for ``op`` + ridge·I.

    Args:
        op: the train kernel with its model (``op.source``), FULL or TRACE. ridge: λ ≥ 0.
        max_rank: the most landmark examples (``max_adaptive_rank`` of the budget). seed: the pivots' generator.

    Returns:
        NystromPreconditioner over examples (basis (N, m')); shared by the k outputs for FULL.

    Raises:
        InvalidInput: an operator without a model behind it, or max_rank < 1.
    """
    source = op.source
    if source is None:
        raise InvalidInput("adaptive_nystrom_preconditioner: needs an operator with a model (ntk_operator, ...)")
    if max_rank < 1:
        raise InvalidInput(f"adaptive_nystrom_preconditioner: max_rank must be ≥ 1, got {max_rank}")
    start = time.perf_counter()
    n, k = op.n, source.k
    scale = float(k)  # Θ_s = Θ_trace / k: the FULL kernel's shared part, and how a TRACE kernel is read
    chunks = [(i, min(i + ROW_CHUNK, n)) for i in range(0, n, ROW_CHUNK)]
    diagonal = np.concatenate(
        [np.trace(source.kernel_block([c], None, KernelMode.EXAMPLE_DIAGONAL), axis1=1, axis2=2) for c in chunks]
    )
    residual = np.maximum(diagonal / scale, 0.0)
    rng = np.random.default_rng(seed)
    factor = np.empty((n, max_rank))  # filled column by column: pages are touched only as the rank grows
    rank = 0
    pivots: list[int] = []
    rounds = 0
    while len(pivots) < max_rank and rank < max_rank:
        total = float(residual.sum())
        if not total > 0:
            break
        want = min(PIVOT_BLOCK * 2**rounds, max_rank - rank, int(np.count_nonzero(residual > 0)))
        chosen = np.unique(rng.choice(n, size=want, replace=True, p=residual / total))
        g = np.concatenate([source.kernel_block([c], chosen, KernelMode.TRACE) for c in chunks])
        g /= scale
        rounds += 1
        g -= factor[:, :rank] @ factor[chosen, :rank].T
        h = (g[chosen] + g[chosen].T) / 2
        values, vectors = np.linalg.eigh(h)
        keep = values > max(float(values[-1]), 0.0) * h.shape[0] * np.finfo(np.float64).eps * 100
        if not np.any(keep):
            break
        added = int(np.count_nonzero(keep))
        new = factor[:, rank : rank + added]
        np.matmul(g, vectors[:, keep] / np.sqrt(values[keep]), out=new)
        del g
        rank += added
        residual = np.maximum(residual - np.sum(new * new, axis=1), 0.0)
        residual[chosen] = 0.0
        pivots.extend(int(i) for i in chosen)
        modes = np.linalg.eigvalsh(new.T @ new)  # the modes this round added to F Fᵀ
        above = int(np.count_nonzero(modes > RANK_RATIO * (float(residual.mean()) + ridge)))
        if above < HEAD_SHARE * modes.size:
            break
    basis, eigenvalues = _float32_basis(factor[:, :rank])
    del factor
    outputs = k if op.mode is KernelMode.FULL and k > 1 else 1
    return NystromPreconditioner(
        basis=basis,
        eigenvalues=eigenvalues,
        shift=float(ridge),
        landmarks=np.asarray(sorted(pivots), dtype=np.int64),
        method="rpcholesky, adaptive",
        products=0,
        outputs=outputs,
        build_seconds=time.perf_counter() - start,
        column_passes=rounds,
    )
