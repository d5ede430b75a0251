"""Tile planning: ragged edges, deterministic ids, the symmetric upper triangle."""

from __future__ import annotations

import numpy as np
import pytest

from ntk_service.errors import InvalidInput
from ntk_service.jobs.planner import chunk_shape, plan_tiles
from ntk_service.kernels import KernelMode


def _coverage(plan_n: int, plan_m: int | None, tile: int) -> np.ndarray:
    plan = plan_tiles(n=plan_n, m=plan_m, tile_size=tile, mode=KernelMode.TRACE)
    counts = np.zeros((plan.n, plan.m), dtype=int)
    for t in plan.tiles:
        counts[t.rows[0] : t.rows[1], t.cols[0] : t.cols[1]] += 1
        if plan.symmetric and not t.is_diagonal:
            counts[t.cols[0] : t.cols[1], t.rows[0] : t.rows[1]] += 1  # its mirror
    return counts


@pytest.mark.parametrize(("n", "m", "tile"), [(10, 7, 4), (1, 1, 5), (9, 9, 3), (13, None, 4), (5, None, 1)])
def test_tiles_cover_every_entry_exactly_once(n: int, m: int | None, tile: int) -> None:
    counts = _coverage(n, m, tile)
    assert counts.shape == (n, n if m is None else m)
    assert (counts == 1).all()


def test_ragged_tiles_need_no_divisibility() -> None:
    plan = plan_tiles(n=10, m=7, tile_size=4, mode=KernelMode.FULL)
    assert [(t.rows, t.cols) for t in plan.tiles] == [  # serpentine: odd rows walk the columns backwards
        ((0, 4), (0, 4)),
        ((0, 4), (4, 7)),
        ((4, 8), (4, 7)),
        ((4, 8), (0, 4)),
        ((8, 10), (0, 4)),
        ((8, 10), (4, 7)),
    ]
    assert [t.id for t in plan.tiles] == [0, 1, 3, 2, 4, 5]
    assert plan.result_shape(k=3) == (10, 7, 3, 3)


def test_symmetric_plan_keeps_only_the_upper_triangle_with_stable_ids() -> None:
    plan = plan_tiles(n=10, m=None, tile_size=4, mode=KernelMode.TRACE)
    assert [(t.i, t.j) for t in plan.tiles] == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (2, 2)]
    assert [t.id for t in plan.tiles] == [0, 1, 2, 5, 4, 8]  # i * 3 + j, as in the full 3 × 3 grid
    assert [t.is_diagonal for t in plan.tiles] == [True, False, False, False, True, True]
    assert plan.n_blocks_total == 9
    again = plan_tiles(n=10, m=None, tile_size=4, mode=KernelMode.TRACE)
    assert again == plan


def test_symmetric_saving_approaches_two() -> None:
    plan = plan_tiles(n=4096, m=None, tile_size=256, mode=KernelMode.TRACE)
    assert len(plan.tiles) == 16 * 17 // 2
    assert plan.n_blocks_total / len(plan.tiles) == pytest.approx(256 / 136)


def test_example_diagonal_tiles_rows_only() -> None:
    plan = plan_tiles(n=10, m=None, tile_size=4, mode=KernelMode.EXAMPLE_DIAGONAL)
    assert [t.rows for t in plan.tiles] == [(0, 4), (4, 8), (8, 10)]
    assert plan.result_shape(k=2) == (10, 2, 2)
    assert plan.stored_bytes(k=2, itemsize=4) == 10 * 2 * 2 * 4
    with pytest.raises(InvalidInput, match="uses no x2"):
        plan_tiles(n=10, m=3, tile_size=4, mode=KernelMode.EXAMPLE_DIAGONAL)


def test_stored_bytes_counts_only_planned_tiles() -> None:
    full = plan_tiles(n=8, m=8, tile_size=4, mode=KernelMode.FULL)
    sym = plan_tiles(n=8, m=None, tile_size=4, mode=KernelMode.FULL)
    assert full.stored_bytes(k=2, itemsize=8) == 8 * 8 * 4 * 8
    assert sym.stored_bytes(k=2, itemsize=8) == 3 * 16 * 4 * 8


def test_chunk_shape_per_mode() -> None:
    assert chunk_shape(KernelMode.FULL, 4, 3) == (4, 4, 3, 3)
    assert chunk_shape(KernelMode.TRACE, 4, 3) == (4, 4)
    assert chunk_shape(KernelMode.OUTPUT_DIAGONAL, 4, 3) == (4, 4, 3)
    assert chunk_shape(KernelMode.EXAMPLE_DIAGONAL, 4, 3) == (4, 3, 3)


@pytest.mark.parametrize(
    ("n", "m", "tile", "match"), [(0, 3, 2, "at least one"), (3, 0, 2, "at least one"), (3, 3, 0, "tile_size")]
)
def test_bad_sizes_are_refused(n: int, m: int, tile: int, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        plan_tiles(n=n, m=m, tile_size=tile, mode=KernelMode.FULL)
