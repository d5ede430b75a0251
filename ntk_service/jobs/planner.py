"""Tile planning: split a job's kernel Θ(x1, x2) into ragged tiles with deterministic ids.

A job's result has N rows (examples of x1) and M columns (examples of x2). The planner cuts both axes into blocks of
``tile_size`` examples; the last block on each axis is simply shorter (no divisibility rule, unlike neural-tangents'
``nt.batch``). Tile ``(i, j)`` covers rows ``[i·T, min((i+1)·T, N))`` and columns ``[j·T, min((j+1)·T, M))``; its
id is ``i · n_col_blocks + j``, so the same job always has the same ids, on every host and after every restart.

- Symmetric jobs (x2 omitted, so x2 = x1): only tiles with ``i ≤ j`` (on or above the diagonal) are planned,
  ``nb·(nb+1)/2`` instead of ``nb²``; reads mirror the rest (``results.py``).
- ``EXAMPLE_DIAGONAL`` (N, k, k) has no column axis: one tile per row block, ``j = i``.

    >>> plan = plan_tiles(n=10, m=None, tile_size=4, mode=KernelMode.TRACE)
    >>> [(t.id, t.rows, t.cols) for t in plan.tiles][:4]
    [(0, (0, 4), (0, 4)), (1, (0, 4), (4, 8)), (2, (0, 4), (8, 10)), (5, (4, 8), (8, 10))]
    >>> len(plan.tiles), plan.n_blocks_total   # 6 of 9 tiles computed
    (6, 9)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ntk_service.errors import InvalidInput
from ntk_service.kernels.modes import KernelMode, result_shape

__all__ = ["DEFAULT_TILE_SIZE", "Tile", "TilePlan", "chunk_shape", "plan_tiles"]

DEFAULT_TILE_SIZE = 256
"""256 examples per side: a FULL tile with k = 10 is 256²·10²·4 B = 26 MB (one Zarr chunk), large enough that the
per-side forward/backward passes amortise and small enough that progress moves every few seconds."""


@dataclass(frozen=True, slots=True)
class Tile:
    """One block of the result: rows ``[rows[0], rows[1])`` of x1 against columns ``[cols[0], cols[1])`` of x2.

    ``i, j`` are the block indices; ``id = i · n_col_blocks + j`` is stable for a given job plan.
    ``is_diagonal`` tiles of symmetric jobs are computed with ``x2=None`` (exactly symmetric blocks).
    """

    id: int
    i: int
    j: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    is_diagonal: bool

    @property
    def n_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def n_cols(self) -> int:
        return self.cols[1] - self.cols[0]


@dataclass(frozen=True, slots=True)
class TilePlan:
    """The tiles a job computes, in computation order: by rows, alternating the column direction (serpentine), so
    the row block and the most recent column blocks stay warm in an LRU side cache.

    Attributes:
        n, m: examples of x1 and x2 (m == n for symmetric jobs).
        tile_size: examples per block side.
        symmetric: x2 omitted; only tiles with i ≤ j are planned.
        mode: the kernel mode (decides the chunk shape).
        tiles: the planned tiles.
        n_blocks_total: tiles a non-symmetric plan of the same shape would hold (for the saving).
    """

    n: int
    m: int
    tile_size: int
    symmetric: bool
    mode: KernelMode
    tiles: tuple[Tile, ...]
    n_blocks_total: int

    def result_shape(self, k: int) -> tuple[int, ...]:
        """Shape of the whole result for ``k`` outputs, e.g. (N, M, k, k) for FULL."""
        return result_shape(self.mode, self.n, self.m, k)

    def tile_elements(self, tile: Tile, k: int) -> int:
        """Number of stored values in ``tile`` for ``k`` outputs."""
        return math.prod(result_shape(self.mode, tile.n_rows, tile.n_cols, k))

    def stored_bytes(self, k: int, itemsize: int) -> int:
        """Bytes the planned tiles take uncompressed: the disk estimate of the job."""
        return sum(self.tile_elements(t, k) for t in self.tiles) * itemsize


def chunk_shape(mode: KernelMode, tile_size: int, k: int) -> tuple[int, ...]:
    """Zarr chunk shape of one tile: (T, T, k, k) FULL, (T, T) TRACE, (T, k, k) EXAMPLE_DIAGONAL, (T, T, k)."""
    return result_shape(mode, tile_size, tile_size, k)


def _bounds(index: int, size: int, tile_size: int) -> tuple[int, int]:
    return index * tile_size, min((index + 1) * tile_size, size)


def _serpentine(cols: range, i: int) -> range:
    # Odd rows walk the columns backwards: the column blocks the previous row used last are the ones an LRU side
    # cache still holds, whereas a plain row-major sweep evicts each column side just before it is needed again.
    return cols if i % 2 == 0 else cols[::-1]


def plan_tiles(*, n: int, m: int | None, tile_size: int, mode: KernelMode) -> TilePlan:
    """Plan the tiles of a job.

    Args:
        n (int): examples in x1 (N).
        m (int | None): examples in x2 (M); None means x2 = x1 (symmetric: only tiles on/above the diagonal).
        tile_size (int): examples per block side (T ≥ 1).
        mode (KernelMode): EXAMPLE_DIAGONAL plans one tile per row block and requires ``m is None``.

    Returns:
        TilePlan with ``ceil(N/T)·ceil(M/T)`` tiles, or ``nb·(nb+1)/2`` when symmetric, ``nb`` for
        EXAMPLE_DIAGONAL (nb = ceil(N/T)).

    Raises:
        InvalidInput: N or M < 1, tile_size < 1, or x2 given with EXAMPLE_DIAGONAL.
    """
    if n < 1 or (m is not None and m < 1):
        raise InvalidInput(f"plan_tiles: data sets need at least one example; got N={n}, M={m}")
    if tile_size < 1:
        raise InvalidInput(f"plan_tiles: tile_size must be ≥ 1, got {tile_size}; omit it for the default")
    nb = -(-n // tile_size)
    if not mode.spec.pairs:
        if m is not None:
            raise InvalidInput(f"plan_tiles: mode {mode.value!r} computes Θ(x1_n, x1_n) and uses no x2; omit x2")
        tiles = tuple(
            Tile(id=i, i=i, j=i, rows=_bounds(i, n, tile_size), cols=_bounds(i, n, tile_size), is_diagonal=True)
            for i in range(nb)
        )
        return TilePlan(n=n, m=n, tile_size=tile_size, symmetric=True, mode=mode, tiles=tiles, n_blocks_total=nb)
    symmetric = m is None
    m_eff = n if m is None else m
    mb = -(-m_eff // tile_size)
    tiles = tuple(
        Tile(
            id=i * mb + j,
            i=i,
            j=j,
            rows=_bounds(i, n, tile_size),
            cols=_bounds(j, m_eff, tile_size),
            is_diagonal=symmetric and i == j,
        )
        for i in range(nb)
        for j in _serpentine(range(i if symmetric else 0, mb), i)
    )
    return TilePlan(
        n=n, m=m_eff, tile_size=tile_size, symmetric=symmetric, mode=mode, tiles=tiles, n_blocks_total=nb * mb
    )
