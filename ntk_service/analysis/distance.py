"""How far a kernel moved: kernel distance (Fort et al. 2020) and relative change (Lee et al. 2019).

kernel_distance(K1, K2) = 1 − ⟨K1, K2⟩_F / (‖K1‖_F ‖K2‖_F): 0 iff K2 = cK1 with c > 0, at most 2; divided by
Δt it is the kernel velocity. relative_change(K0, K1) = ‖K1 − K0‖_F / ‖K0‖_F. Both are sums over entries and
stream tile by tile (``tiles.py``): the two sources are read in step, and their tiles must line up.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import zip_longest
from typing import Any

import numpy as np

from ntk_service.analysis.tiles import DEFAULT_BLOCK_ROWS, KernelTile, iter_tiles
from ntk_service.errors import InvalidInput, ShapeMismatch, operation_name

__all__ = ["distances_memory_bytes", "kernel_distance", "relative_change"]


def distances_memory_bytes(count: int, size: int) -> int:
    """Bytes of ``count`` dense float64 kernels of side ``size`` kept for their pairwise distances, plus one more
    in flight (the next kernel while it is computed)."""
    return 8 * (count + 1) * size * size


def _paired(k1: Any, k2: Any, *, block_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The tiles of two kernels side by side; errors carry ``detail=`` (the caller's boundary names them)."""
    s1 = iter_tiles(k1, name="k1", block_rows=block_rows)
    s2 = iter_tiles(k2, name="k2", block_rows=block_rows)
    if s1.shape is not None and s2.shape is not None and s1.shape != s2.shape:
        raise ShapeMismatch(
            detail=f"the kernels have shapes {s1.shape} and {s2.shape}; compare kernels of the same inputs "
            "in the same mode"
        )
    for t1, t2 in zip_longest(s1, s2):
        if t1 is None or t2 is None:
            raise ShapeMismatch(detail="one kernel has more tiles than the other; tile both the same way")
        a, b = _tile(t1), _tile(t2)
        if (t1.row, t1.col) != (t2.row, t2.col) or a.shape != b.shape:
            raise ShapeMismatch(
                detail=f"tiles do not line up: {a.shape} at ({t1.row}, {t1.col}) against {b.shape} at "
                f"({t2.row}, {t2.col}); tile both kernels the same way"
            )
        yield a, b


def _tile(tile: KernelTile) -> np.ndarray:
    return np.asarray(tile.block)


def kernel_distance(k1: Any, k2: Any, *, block_rows: int = DEFAULT_BLOCK_ROWS) -> float:
    """1 − ⟨K1, K2⟩_F / (‖K1‖_F ‖K2‖_F), in [0, 2]; 0 iff the kernels are proportional (positive factor).

    Args:
        k1, k2: kernels of the same shape (any mode), numpy / torch, stored arrays read by rows, or iterables of
            ``KernelTile`` tiled the same way.
        block_rows: rows per read of a stored array. Default: 256.

    Raises:
        ShapeMismatch: shapes or tiles that differ. InvalidInput: a zero kernel (the distance is 0/0).

    Cost: one pass over both, O(N·M·k²); memory one tile of each.
    """
    inner = n1 = n2 = 0.0
    with operation_name("kernel_distance"):
        for a, b in _paired(k1, k2, block_rows=block_rows):
            inner += float(np.sum(a * b))
            n1 += float(np.sum(a * a))
            n2 += float(np.sum(b * b))
    if n1 <= 0 or n2 <= 0:
        raise InvalidInput("kernel_distance: a kernel is all zeros, so the distance is undefined (0/0)")
    cosine = inner / np.sqrt(n1 * n2)
    return float(max(0.0, 1.0 - cosine))


def relative_change(k0: Any, k1: Any, *, block_rows: int = DEFAULT_BLOCK_ROWS) -> float:
    """‖K1 − K0‖_F / ‖K0‖_F: how much the kernel moved relative to where it started.

    Args / Raises: as ``kernel_distance`` (K0 must be nonzero).
    """
    diff = base = 0.0
    with operation_name("relative_change"):
        for a, b in _paired(k0, k1, block_rows=block_rows):
            diff += float(np.sum((b - a) ** 2))
            base += float(np.sum(a * a))
    if base <= 0:
        raise InvalidInput("relative_change: k0 is all zeros, so the relative change is undefined")
    return float(np.sqrt(diff / base))
