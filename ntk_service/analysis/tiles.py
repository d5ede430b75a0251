"""Kernels as a stream of tiles, so sums over entries run in memory bounded by one tile.

A kernel source is one of:

- a dense kernel (numpy / torch), (N, M, k, k) FULL or (N, M) TRACE: one tile;
- a sliceable stored array (a zarr array, a numpy memmap: anything with ``shape`` and ``array[i:j]`` that is not
  an in-memory array): read ``block_rows`` rows at a time;
- an iterable of ``KernelTile(row, col, block)``: blocks of the kernel at example offsets (row, col), which
  together must cover every entry exactly once (a symmetric job's mirrored half included).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ntk_service._tensors import is_torch_tensor
from ntk_service.analysis.layout import infer_mode, to_float64
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode

__all__ = ["DEFAULT_BLOCK_ROWS", "KernelTile", "TileStream", "iter_tiles", "tile_mode"]

DEFAULT_BLOCK_ROWS = 256
"""Rows of a stored kernel read at a time: 256 · N · k² floats (N = 4096, k = 10: 800 MB float64 at most)."""


class KernelTile(NamedTuple):
    """A block of a kernel: ``block`` (R, C, k, k) or (R, C) starting at example row ``row``, column ``col``."""

    row: int
    col: int
    block: Any


@dataclass(frozen=True)
class TileStream:
    """Tiles of one kernel as float64 arrays, with the kernel's mode and (when known) its shape."""

    tiles: Iterable[KernelTile]
    shape: tuple[int, ...] | None

    def __iter__(self) -> Iterator[KernelTile]:
        return iter(self.tiles)


def _is_in_memory(kernel: Any) -> bool:
    return isinstance(kernel, np.ndarray | list) or is_torch_tensor(kernel)


def iter_tiles(kernel: Any, *, name: str, block_rows: int = DEFAULT_BLOCK_ROWS) -> TileStream:
    """The tiles of a kernel source (module docstring), each block converted to float64 when read.

    Raises (with ``detail=``, here or while the tiles are read: the caller's boundary names the operation, NOTE
    [operation names] in errors.py):
        InvalidInput: an object that is none of the three sources. ShapeMismatch: a block of another rank.
    """
    if _is_in_memory(kernel):
        array = to_float64(kernel, name=name)
        infer_mode(array, None, name=name)
        return TileStream([KernelTile(0, 0, array)], tuple(array.shape))
    if hasattr(kernel, "shape") and hasattr(kernel, "__getitem__"):
        shape = tuple(int(s) for s in kernel.shape)
        if len(shape) not in (2, 4):
            raise ShapeMismatch(detail=f"{name} has shape {shape}; expected (N, M, k, k) or (N, M)")

        def rows() -> Iterator[KernelTile]:
            for start in range(0, shape[0], block_rows):
                block = to_float64(kernel[start : start + block_rows], name=name)
                yield KernelTile(start, 0, block)

        return TileStream(rows(), shape)
    if isinstance(kernel, Iterable):

        def checked() -> Iterator[KernelTile]:
            for item in kernel:
                row, col, block = item
                array = to_float64(block, name=f"{name} tile")
                infer_mode(array, None, name=f"{name} tile at ({row}, {col})")
                yield KernelTile(int(row), int(col), array)

        return TileStream(checked(), None)
    raise InvalidInput(
        detail=f"{name} must be a kernel array (N, M, k, k) / (N, M), a sliceable stored array (zarr), "
        f"or an iterable of KernelTile(row, col, block); got {type(kernel).__name__}"
    )


def tile_mode(block: np.ndarray) -> KernelMode:
    """FULL for a 4-D block, TRACE for a 2-D one."""
    return KernelMode.FULL if block.ndim == 4 else KernelMode.TRACE
