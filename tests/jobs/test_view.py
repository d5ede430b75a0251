"""open_result's ResultView against kernels written out by hand: every mode that can be symmetric, every slice
shape (above, across, below the diagonal, ragged last tiles, steps, negative and out-of-range bounds, integers,
output axes), laziness, and strided reads that never hold the bounding block."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ntk_service.errors import InvalidInput
from ntk_service.jobs.planner import plan_tiles
from ntk_service.jobs.results import ResultArray
from ntk_service.kernels import KernelMode
from ntk_service.results import ResultView, open_result

N, K, TILE = 11, 3, 4
"""Tiles of 4 over 11 rows: blocks [0,4) [4,8) [8,11), the last one ragged."""


def _symmetric_dense(mode: KernelMode, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A kernel with the symmetry of its mode, exact in floating point: B + (B mirrored)."""
    rng = np.random.default_rng(seed)
    if mode is KernelMode.FULL:
        b = rng.standard_normal((n, n, k, k))
        return b + b.transpose(1, 0, 3, 2)  # theta[n, m, a, b] = theta[m, n, b, a]
    if mode is KernelMode.OUTPUT_DIAGONAL:
        b = rng.standard_normal((n, n, k))
        return b + b.transpose(1, 0, 2)
    if mode is KernelMode.EXAMPLE_DIAGONAL:
        b = rng.standard_normal((n, k, k))
        return b + b.transpose(0, 2, 1)
    b = rng.standard_normal((n, n))
    return b + b.T


def _write(path: Path, dense: np.ndarray, mode: KernelMode, k: int, tile: int) -> Path:
    """Store only what a symmetric job stores: the tiles on and above the diagonal (the lower ones stay zeros)."""
    plan = plan_tiles(n=dense.shape[0], m=None, tile_size=tile, mode=mode)
    array = ResultArray.create(path, plan=plan, k=k, dtype=str(dense.dtype), attributes={})
    for t in plan.tiles:
        r0, r1 = t.rows
        c0, c1 = t.cols
        array.write_tile(t, dense[r0:r1] if mode is KernelMode.EXAMPLE_DIAGONAL else dense[r0:r1, c0:c1])
    return path


PAIR_KEYS = {
    "above": np.s_[0:4, 4:11],
    "across": np.s_[2:9, 1:10],
    "below": np.s_[8:11, 0:3],
    "ragged last tile": np.s_[8:11, 8:11],
    "below, ragged columns": np.s_[9:11, 5:11],
    "steps": np.s_[1::3, ::2],
    "steps over tiles": np.s_[::5, 2::7],
    "negative bounds": np.s_[-3:, -9:-2],
    "out of range (clipped as numpy clips)": np.s_[5:100, 9:40],
    "empty": np.s_[4:4, 0:11],
    "reversed bounds (empty)": np.s_[7:3, :],
    "one row": np.s_[9, :],
    "one entry below": np.s_[10, 3],
    "negative integers": np.s_[-1, -11],
    "rows only": np.s_[6:10],
    "ellipsis": np.s_[..., 2:5],
}


@pytest.mark.parametrize("mode", [KernelMode.FULL, KernelMode.TRACE, KernelMode.OUTPUT_DIAGONAL])
@pytest.mark.parametrize("read_block_bytes", [1, 2**26])
def test_every_slice_equals_the_kernel_written_out_by_hand(
    tmp_path: Path, mode: KernelMode, read_block_bytes: int
) -> None:
    dense = _symmetric_dense(mode, N, K)
    view = open_result(_write(tmp_path / "k.zarr", dense, mode, K, TILE), read_block_bytes=read_block_bytes)
    keys = dict(PAIR_KEYS)
    if mode is KernelMode.FULL:
        keys |= {"output axes": np.s_[2:9, 1:10, 0, 2], "output axes, steps": np.s_[::3, 1::4, 2, :]}
    if mode is KernelMode.OUTPUT_DIAGONAL:
        keys |= {"output axis": np.s_[2:9, 1:10, 1]}
    for name, key in keys.items():
        got = np.asarray(view[key])
        assert got.shape == dense[key].shape, name
        np.testing.assert_array_equal(got, dense[key], err_msg=name)  # exact: mirrored values are copies
    np.testing.assert_array_equal(view[2:10, 1:9][3:, 1::2], dense[2:10, 1:9][3:, 1::2])  # a view of a view


def test_example_diagonal_slices(tmp_path: Path) -> None:
    mode = KernelMode.EXAMPLE_DIAGONAL
    dense = _symmetric_dense(mode, N, K)
    view = open_result(_write(tmp_path / "d.zarr", dense, mode, K, TILE), read_block_bytes=1)
    for key in (np.s_[3:10], np.s_[::4], np.s_[-2:], np.s_[5], np.s_[2:9, 1, 0], np.s_[20:30], np.s_[..., 1]):
        np.testing.assert_array_equal(np.asarray(view[key]), dense[key], err_msg=str(key))


def test_slices_of_the_example_axes_stay_lazy_and_bad_indices_are_clear(tmp_path: Path) -> None:
    dense = _symmetric_dense(KernelMode.TRACE, N, K)
    view = open_result(_write(tmp_path / "k.zarr", dense, KernelMode.TRACE, K, TILE))
    block = view[0:4, 2:9]
    assert isinstance(block, ResultView) and block.shape == (4, 7) and (block.rows, block.cols) == ((0, 4), (2, 9))
    assert isinstance(view[1:3], ResultView) and isinstance(view[:, 5:], ResultView)
    assert isinstance(view[::2, :], np.ndarray) and isinstance(view[3, 4:6], np.ndarray)
    with pytest.raises(InvalidInput, match="positive step"):
        view[::-1]
    with pytest.raises(IndexError, match="index 11 is out of range for rows of size 11"):
        view[11, 0]
    with pytest.raises(IndexError, match="index -12 is out of range for cols"):
        view[0, -12]
    with pytest.raises(IndexError, match="3 indices for a result of 2 dimensions"):
        view[0, 0, 0]
    with pytest.raises(InvalidInput, match="fancy indexing use"):
        view[[0, 1], 0]


def test_a_strided_read_never_holds_the_bounding_block(tmp_path: Path) -> None:
    n = 2048  # TRACE float64: the whole kernel is 32 MiB
    dense = _symmetric_dense(KernelMode.TRACE, n, 1, seed=1)
    view = open_result(_write(tmp_path / "big.zarr", dense, KernelMode.TRACE, 1, 256), read_block_bytes=2**20)
    tracemalloc.start()
    try:
        got = view[::64, 3::64]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, dense[::64, 3::64])
    assert peak < 12 * 2**20, f"a 32 × 32 strided read peaked at {peak / 2**20:.1f} MiB (the kernel is 32 MiB)"
