"""The result of a job: one Zarr v3 array, one chunk per tile, under ``<data_dir>/jobs/<job id>/theta.zarr``.

The array has the full kernel shape ((N, M, k, k) FULL, (N, M) TRACE, (N, M, k) OUTPUT_DIAGONAL, (N, k, k)
EXAMPLE_DIAGONAL) and chunks equal to the tile size, so each tile write touches exactly one chunk file (Zarr writes
it atomically: a temporary file, then a rename). Separate processes (Ray workers) may write different chunks at once.
Attributes carry what produced the numbers: model, version, data set hashes, mode, implementation, dtype.

NOTE [symmetric reads]
    A symmetric job (x2 omitted) stores only the tiles on and above the diagonal. Θ(x1_m, x1_n) = Θ(x1_n, x1_m)ᵀ,
    so an entry below the diagonal is read from its mirror tile: FULL swaps both the example and the output axes
    (``theta[n, m, a, b] = theta[m, n, b, a]``), OUTPUT_DIAGONAL and TRACE swap the example axes. Diagonal tiles
    are made exactly symmetric when written (the upper triangle is mirrored onto the lower one; the engine's x2=None
    blocks already are, so this changes no bit there). Every read of the lower half is therefore a copy of a stored
    upper value, and ``read()`` of the whole array is exactly symmetric.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import zarr

from ntk_service.errors import InvalidInput
from ntk_service.jobs.planner import Tile, TilePlan, chunk_shape
from ntk_service.kernels.modes import KernelMode

__all__ = ["RESULT_ARRAY_NAME", "ResultArray", "mirror_theta", "parse_range", "symmetrize_tile"]

RESULT_ARRAY_NAME = "theta.zarr"
"""Directory name of the Zarr array inside the job's directory."""


def mirror_theta(theta: np.ndarray, mode: KernelMode) -> np.ndarray:
    """Θ(x2, x1) from a block Θ(x1, x2): (R, C, ...) -> (C, R, ...), see NOTE [symmetric reads]."""
    if mode is KernelMode.FULL:
        return theta.transpose(1, 0, 3, 2)
    if mode is KernelMode.EXAMPLE_DIAGONAL:
        return theta.transpose(0, 2, 1)
    return np.swapaxes(theta, 0, 1)


def _upper_mask(shape: tuple[int, ...], mode: KernelMode) -> np.ndarray:
    # True where an entry is on or above the diagonal of the kernel seen as a (N·k × N·k) matrix.
    if mode is KernelMode.EXAMPLE_DIAGONAL:
        _, k, _ = shape
        return np.triu(np.ones((k, k), dtype=bool))[None]
    n_idx = np.arange(shape[0])[:, None]
    m_idx = np.arange(shape[1])[None, :]
    if mode is KernelMode.FULL:
        k = shape[2]
        a_le_b = np.triu(np.ones((k, k), dtype=bool))
        full: np.ndarray = (n_idx < m_idx)[:, :, None, None] | ((n_idx == m_idx)[:, :, None, None] & a_le_b[None, None])
        return full
    mask: np.ndarray = n_idx <= m_idx
    return mask[:, :, None] if mode is KernelMode.OUTPUT_DIAGONAL else mask


def symmetrize_tile(theta: np.ndarray, mode: KernelMode) -> np.ndarray:
    """Copy the upper triangle of a diagonal tile onto its lower one (exact copies, no arithmetic)."""
    return np.where(_upper_mask(theta.shape, mode), theta, mirror_theta(theta, mode))


def parse_range(text: str | None, size: int, *, axis: str) -> tuple[int, int]:
    """Parse ``"a:b"`` (either end may be omitted) into ``(a, b)`` with ``0 ≤ a < b ≤ size``.

    Args:
        text: the range, e.g. ``"0:128"``, ``"128:"``, ``":64"``; None means the whole axis.
        size: the axis length.
        axis: ``"rows"`` or ``"cols"``, for the message.

    Raises:
        InvalidInput: not ``a:b`` of integers, or out of ``[0, size]``, or empty.
    """
    if text is None or text.strip() in ("", ":"):
        return 0, size
    start_s, sep, stop_s = text.partition(":")
    try:
        if not sep:
            raise ValueError
        start = int(start_s) if start_s.strip() else 0
        stop = int(stop_s) if stop_s.strip() else size
    except ValueError:
        raise InvalidInput(f"job result: {axis}={text!r} is not a range 'a:b' of integers; e.g. {axis}=0:128") from None
    if not 0 <= start < stop <= size:
        raise InvalidInput(
            f"job result: {axis}={text!r} is outside the result; expected 0 ≤ a < b ≤ {size} (the axis has {size})"
        )
    return start, stop


class ResultArray:
    """The Zarr array of one job's kernel.

    Args:
        path: the array directory (``<data_dir>/jobs/<id>/theta.zarr``).
        plan: the job's TilePlan (tile geometry and symmetry).

        >>> arr = ResultArray.create(path, plan=plan, k=10, dtype="float32", attributes={})  # doctest: +SKIP
        >>> arr.write_tile(plan.tiles[0], theta)     # theta (T, T, 10, 10) for FULL         # doctest: +SKIP
        >>> arr.read(rows=(0, 64), cols=(0, 32)).shape                                       # doctest: +SKIP
        (64, 32, 10, 10)
    """

    def __init__(self, path: Path, plan: TilePlan, array: Any) -> None:
        self.path = Path(path)
        self.plan = plan
        self._array = array

    @classmethod
    def create(cls, path: Path, *, plan: TilePlan, k: int, dtype: str, attributes: dict[str, Any]) -> ResultArray:
        """Create the (empty, zero-filled) array; overwrites a half-created one left by a crash."""
        array = zarr.create_array(
            store=str(path),
            shape=plan.result_shape(k),
            chunks=chunk_shape(plan.mode, plan.tile_size, k),
            dtype=dtype,
            fill_value=0,
            # Kernel values are dense floats that barely compress; storing them raw keeps the disk estimate exact.
            compressors=None,
            attributes=attributes,
            overwrite=True,
        )
        return cls(path, plan, array)

    @classmethod
    def open(cls, path: Path, *, plan: TilePlan) -> ResultArray:
        """Open an existing array for reading and writing tiles (any process with the path may do so)."""
        return cls(path, plan, zarr.open_array(str(path), mode="r+"))

    @property
    def attributes(self) -> dict[str, Any]:
        return dict(self._array.attrs.asdict())

    def update_attributes(self, values: dict[str, Any]) -> None:
        self._array.attrs.update(values)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    def write_tile(self, tile: Tile, theta: np.ndarray) -> None:
        """Write one tile's block (its chunk). Diagonal tiles of symmetric jobs are symmetrized first.

        Args:
            tile: the planned tile.
            theta: its block: (R, C, k, k) FULL, (R, C) TRACE, (R, C, k) OUTPUT_DIAGONAL, (R, k, k)
                EXAMPLE_DIAGONAL, with R = tile.n_rows, C = tile.n_cols.
        """
        mode = self.plan.mode
        if tile.is_diagonal:
            theta = symmetrize_tile(theta, mode)
        r0, r1 = tile.rows
        if mode is KernelMode.EXAMPLE_DIAGONAL:
            self._array[r0:r1] = theta
        else:
            c0, c1 = tile.cols
            self._array[r0:r1, c0:c1] = theta

    def read(self, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> np.ndarray:
        """Read the whole result or a block of it, mirroring the lower half of symmetric jobs.

        Args:
            rows: ``(a, b)`` row range. Default: all N rows.
            cols: ``(c, d)`` column range. Default: all M columns. Not allowed for EXAMPLE_DIAGONAL.

        Returns:
            theta: (b-a, d-c, k, k) FULL, (b-a, d-c) TRACE, (b-a, d-c, k) OUTPUT_DIAGONAL, (b-a, k, k)
            EXAMPLE_DIAGONAL.

        Raises:
            InvalidInput: cols given for EXAMPLE_DIAGONAL.
        """
        plan = self.plan
        r0, r1 = rows if rows is not None else (0, plan.n)
        if plan.mode is KernelMode.EXAMPLE_DIAGONAL:
            if cols is not None:
                raise InvalidInput("job result: mode 'example_diagonal' has no column axis; omit cols")
            return np.asarray(self._array[r0:r1])
        c0, c1 = cols if cols is not None else (0, plan.m)
        out = np.asarray(self._array[r0:r1, c0:c1])
        if not plan.symmetric:
            return out
        t = plan.tile_size
        below = (np.arange(r0, r1) // t)[:, None] > (np.arange(c0, c1) // t)[None, :]
        if not below.any():
            return out
        mirrored = mirror_theta(np.asarray(self._array[c0:c1, r0:r1]), plan.mode)
        below = below.reshape(below.shape + (1,) * (out.ndim - 2))
        return np.where(below, mirrored, out)
