"""A lazy, symmetry-aware view of a stored kernel: ``open_result(path)[a:b, c:d]``, to numpy, dask or xarray.

    >>> result = open_result("kernel/result.zarr")         # doctest: +SKIP
    >>> result.shape, result.dims                          # doctest: +SKIP
    ((20000, 20000), ('x1', 'x2'))
    >>> block = result[1000:2000, 0:500]                   # nothing read yet
    >>> np.asarray(block).shape                            # reads only the chunks of this block (and its mirror)
    (1000, 500)
    >>> result.to_xarray().isel(x1=rows, x2=cols).values   # dask-backed: reads the tiles it needs
    >>> result.to_dask().sum(axis=1).compute()             # one task per tile, mirrored below the diagonal

Below the diagonal tiles of a symmetric result every value is an exact copy of its stored mirror (NOTE [symmetric
reads] in ``results.py``), whichever way it is read here; plain Zarr or ``xarray.open_zarr`` see zeros there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ntk_service._indexing import expand_key, row_groups
from ntk_service.errors import InvalidInput, OptionalDependencyMissing
from ntk_service.jobs.results import LEGACY_ARRAY_NAME, RESULT_GROUP_NAME, ResultArray, dimension_names
from ntk_service.kernels.modes import KernelMode

__all__ = ["READ_BLOCK_BYTES", "ResultView", "open_result"]

READ_BLOCK_BYTES = 64 * 2**20
"""A strided or indexed read (``result[::10, ::10]``) reads at most this much of the kernel at a time (at least one
row), then keeps only the wanted entries: its memory is the answer plus one such block, not the bounding block."""


def _bounds(key: Any, size: int, axis: str) -> tuple[int, int, int | None, int]:
    """``(start, stop, index, step)`` of a slice or an int over an axis of ``size``; index is the int, else None."""
    if isinstance(key, slice):
        start, stop, step = key.indices(size)
        if step < 1:
            raise InvalidInput(f"ResultView: {axis} slices need a positive step, got {key}")
        return start, max(start, stop), None, step
    if isinstance(key, int | np.integer):
        index = int(key) + (size if key < 0 else 0)
        if not 0 <= index < size:
            raise IndexError(f"ResultView: index {key} is out of range for {axis} of size {size}")
        return index, index + 1, index, 1
    raise InvalidInput(
        f"ResultView: index {axis} with slices or integers (e.g. result[0:100, 50:60]), got {type(key).__name__}; "
        "for fancy indexing use result.to_xarray().isel(...) or result.to_dask()"
    )


class _BlockReader:
    """What dask's ``from_array`` needs: ``shape``, ``dtype``, ``ndim`` and ``[slices] -> np.ndarray``."""

    def __init__(self, view: ResultView) -> None:
        self.view = view
        self.shape = view.shape
        self.dtype = view.dtype
        self.ndim = view.ndim

    def __getitem__(self, key: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(self.view[key])


class ResultView:
    """A block ``rows × cols`` of a stored kernel (at first the whole of it), read only when converted.

    Attributes:
        shape: the mode's shape (``ModeSpec.shape``) for R rows and C columns, e.g. (R, C, k, k) FULL.
        dtype, ndim: as numpy's.
        dims: the dimension names, e.g. ("x1", "x2", "out1", "out2").
        mode: the KernelMode. symmetric: x2 was omitted (only the upper tiles are stored).
        attrs: the result's metadata (model, weights hash, data-set rows, versions, format version, ...).
        rows, cols: the block's row and column range in the whole result.
        read_block_bytes: the most a strided or indexed read reads at a time (see ``READ_BLOCK_BYTES``).
    """

    def __init__(
        self,
        store: ResultArray,
        rows: tuple[int, int],
        cols: tuple[int, int] | None,
        *,
        read_block_bytes: int = READ_BLOCK_BYTES,
    ) -> None:
        self._store = store
        self.read_block_bytes = read_block_bytes
        self.rows = rows
        self.cols = cols
        self.mode: KernelMode = store.plan.mode
        self.symmetric = store.plan.symmetric
        self.dims = dimension_names(self.mode)
        self.dtype = store.dtype
        tail = store.shape[1:] if cols is None else store.shape[2:]
        self.shape: tuple[int, ...] = (rows[1] - rows[0], *(() if cols is None else (cols[1] - cols[0],)), *tail)
        self.ndim = len(self.shape)

    @property
    def attrs(self) -> dict[str, Any]:
        return self._store.attributes

    @property
    def path(self) -> Path:
        return self._store.path

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"ResultView({str(self.path)!r}, shape={self.shape}, dims={self.dims}, dtype={self.dtype})"

    def __getitem__(self, key: Any) -> Any:
        """Slices (step 1) of the example axes give a lazy ResultView; integers, steps or output-axis indices read
        the block now and return numpy, row group by row group (at most ``READ_BLOCK_BYTES`` read at a time beyond
        the answer), so ``result[::100, ::100]`` never reads the whole kernel into memory at once.

        Out-of-range slice bounds are clipped as numpy clips them (``result[10:20]`` of 11 rows has 1 row);
        an out-of-range integer raises IndexError; a negative step raises InvalidInput."""
        parts = expand_key(key, self.ndim, owner="ResultView")
        n_example_axes = 1 if self.cols is None else 2
        example, rest = parts[:n_example_axes], parts[n_example_axes:]
        r0, r1, r_index, r_step = _bounds(example[0] if example else slice(None), self.shape[0], "rows")
        cols = self.cols
        c_local: list[Any] = []
        lazy = r_index is None and r_step == 1 and not rest
        if self.cols is not None:
            c0, c1, c_index, c_step = _bounds(example[1] if len(example) > 1 else slice(None), self.shape[1], "cols")
            cols = (self.cols[0] + c0, self.cols[0] + c1)
            c_local.append(slice(None, None, c_step) if c_index is None else 0)
            lazy = lazy and c_index is None and c_step == 1
        if lazy:
            return self._sub((self.rows[0] + r0, self.rows[0] + r1), cols)
        if r_index is not None:
            block = self._sub((self.rows[0] + r_index, self.rows[0] + r_index + 1), cols)
            return block.to_numpy()[(0, *c_local, *rest)]
        wanted = range(self.rows[0] + r0, self.rows[0] + r1, r_step)
        tail = (() if cols is None else (cols[1] - cols[0],)) + self._store.shape[1 if cols is None else 2 :]
        row_bytes = max(1, math.prod(tail) * self.dtype.itemsize)
        pick = (slice(None, None, r_step), *c_local, *rest)
        spans = row_groups(wanted, row_bytes, self.read_block_bytes)
        pieces = [self._sub(span, cols).to_numpy()[pick] for span in spans]
        if not pieces:
            return self._sub((wanted.start, wanted.start), cols).to_numpy()[pick]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)

    def _sub(self, rows: tuple[int, int], cols: tuple[int, int] | None) -> ResultView:
        return ResultView(self._store, rows, cols, read_block_bytes=self.read_block_bytes)

    def to_numpy(self) -> np.ndarray:
        """Read the block: (R, C, ...) numpy, mirrored below the diagonal."""
        if self.shape[0] == 0 or (self.cols is not None and self.shape[1] == 0):
            return np.zeros(self.shape, dtype=self.dtype)
        return self._store.read(rows=self.rows, cols=self.cols)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = self.to_numpy()
        return out if dtype is None else out.astype(dtype)

    def _chunks(self) -> tuple[tuple[int, ...], ...]:
        # Tile-aligned dask chunks: each task reads whole tiles (or their mirrors), never parts of two.
        t = self._store.plan.tile_size

        def axis(start: int, stop: int) -> tuple[int, ...]:
            edges = [start, *range((start // t + 1) * t, stop, t), stop]
            return tuple(b - a for a, b in zip(edges, edges[1:], strict=False) if b > a) or (0,)

        example = [axis(*self.rows)] + ([] if self.cols is None else [axis(*self.cols)])
        return tuple(example) + tuple((s,) for s in self.shape[len(example) :])

    def to_dask(self) -> Any:
        """A dask array of the block, one chunk per tile (nothing is read until computed).

        Raises:
            OptionalDependencyMissing: dask is not installed (``pip install 'dask[array]'``).
        """
        try:
            import dask.array as da  # optional: only this conversion needs it
        except ImportError as exc:  # pragma: no cover - dask ships with the dev extra
            raise OptionalDependencyMissing(
                "ResultView.to_dask: needs dask; install it with pip install 'dask[array]'"
            ) from exc
        meta = np.empty((0,) * self.ndim, dtype=self.dtype)
        reader = _BlockReader(self)
        return da.from_array(reader, chunks=self._chunks(), asarray=True, lock=False, meta=meta)  # type: ignore[no-untyped-call]

    def to_xarray(self) -> Any:
        """An ``xarray.DataArray`` named ``theta`` with the result's dims and attrs, backed by ``to_dask()``.

        Raises:
            OptionalDependencyMissing: xarray or dask is not installed.
        """
        try:
            import xarray as xr  # optional: only this conversion needs it
        except ImportError as exc:  # pragma: no cover - xarray ships with the dev extra
            raise OptionalDependencyMissing("ResultView.to_xarray: needs xarray; pip install xarray dask") from exc
        attrs = {k: v for k, v in self.attrs.items() if k != "spec"}
        return xr.DataArray(self.to_dask(), dims=self.dims, name="theta", attrs=attrs)


def open_result(
    path: str | Path, *, allow_incomplete: bool = False, read_block_bytes: int = READ_BLOCK_BYTES
) -> ResultView:
    """Open a stored kernel (a job's or ``compute_ntk_tiled``'s) as a lazy, symmetry-aware view.

    Args:
        path: the ``result.zarr`` group, or the folder holding it (a job's directory).
        allow_incomplete: open a result whose tiles are not all written yet (missing tiles read as 0).
            Default: False.
        read_block_bytes: the most a strided or indexed read (``result[::10, ::10]``) reads at a time, at least
            one row. Default: ``READ_BLOCK_BYTES`` (64 MiB).

    Returns:
        ResultView of the whole kernel, in the mode's shape (``ModeSpec.shape``), e.g. (N, M, k, k) FULL.

    Raises:
        InvalidInput: no result at ``path``, a result of an unknown format version, a bare array of an older
            version (start the server once: it migrates them), or an incomplete result.
    """
    path = Path(path)
    if (path / RESULT_GROUP_NAME).is_dir():
        path = path / RESULT_GROUP_NAME
    if path.name == LEGACY_ARRAY_NAME or (path / LEGACY_ARRAY_NAME).is_dir():
        raise InvalidInput(
            f"open_result: {str(path)!r} is a result of an older ntk-service (a bare array); start the server on its "
            "data directory once (it migrates results in place to the result group format) and open result.zarr"
        )
    store = ResultArray.open(path, writable=False)
    done_ids = store.done_tile_ids()
    done, total = len(done_ids), len(store.plan.tiles)
    if done < total:
        store.read_only_done(done_ids)  # a tile not done may have a chunk cut off mid-write: read it as 0
    if done < total and not allow_incomplete:
        raise InvalidInput(
            f"open_result: the result at {str(path)!r} is incomplete ({done}/{total} tiles written); resume it "
            "(compute_ntk_tiled with the same out, or wait for the job), or pass allow_incomplete=True to read the "
            "missing tiles as 0"
        )
    plan = store.plan
    cols = (0, plan.m) if plan.mode.spec.pairs else None
    if read_block_bytes < 1:
        raise InvalidInput(f"open_result: read_block_bytes must be ≥ 1, got {read_block_bytes}")
    return ResultView(store, (0, plan.n), cols, read_block_bytes=read_block_bytes)
