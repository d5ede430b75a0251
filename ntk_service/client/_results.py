"""Job results from the client: streamed ``.npy`` downloads to a file, a lazy array read slice by slice, and the
result's Zarr group itself, for xarray.

    >>> theta = client.download_result(job, "theta.npy")   # streamed to disk; a read-only np.memmap   # doctest: +SKIP
    >>> remote = client.result_array(job)                   # nothing downloaded yet                 # doctest: +SKIP
    >>> remote[1000:2000, :500].shape                        # one GET ?rows=1000:2000&cols=0:500      # doctest: +SKIP
    (1000, 500)
    >>> da = remote.to_xarray("kernel.zarr.zip")             # the group, zipped; dims, attrs, mirrored # doctest: +SKIP

Neither holds a whole result in memory twice: downloads go to disk chunk by chunk (the server streams the result
row block by row block), and slices fetch only their block (the server mirrors symmetric results). ``to_xarray``
downloads the same Zarr group the server keeps (``GET /v1/jobs/{id}/zarr``, a stored zip) and opens it in place
with ``zarr.storage.ZipStore``: nothing is extracted. It needs xarray and zarr (``pip install
'ntk-service[xarray]'``; with dask the DataArray stays lazy).
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import numpy as np

from ntk_service import wire
from ntk_service._indexing import expand_key, row_groups
from ntk_service.client import _base
from ntk_service.client._base import _RETRY_STATUSES, _error_from_response
from ntk_service.errors import NtkServiceError, OptionalDependencyMissing, ServiceUnavailable
from ntk_service.vocabulary import MODES

if TYPE_CHECKING:
    from ntk_service.client._jobs import JobsClient

__all__ = [
    "FETCH_BLOCK_BYTES",
    "ZIP_MEDIA",
    "RemoteResult",
    "download_to",
    "download_zarr",
    "fetch_npy",
    "open_zarr_zip",
    "stream_npy",
]

ZIP_MEDIA = "application/zip"
"""The media type of ``GET /v1/jobs/{id}/zarr``."""

FETCH_BLOCK_BYTES = 64 * 2**20
"""A strided or indexed slice of a RemoteResult (``remote[::10, ::10]``) fetches at most this much at a time (at
least one row) and keeps only the wanted entries: its memory is the answer plus one such block, never the bounding
block."""


class _Sink(Protocol):
    def write(self, chunk: bytes, /) -> int: ...


def stream_npy(
    client: JobsClient, path: str, params: Mapping[str, str | None], sink: _Sink, *, accept: str = wire.MEDIA_NPY
) -> int:
    """GET ``path`` as ``accept`` (``.npy`` by default) and copy the body into ``sink`` as it arrives; returns the
    bytes.

    A 429 or 503 before any data is retried as ``Client._request`` retries (``max_retries``, ``Retry-After``).

    Raises:
        NtkServiceError subclass: the server's error (e.g. JobNotFinished, ResultNotFound).
        ServiceUnavailable: the server cannot be reached.
        NtkServiceError: the body ended before its ``Content-Length`` (the download was cut off).
    """
    operation = f"GET {path}"
    query = {k: v for k, v in params.items() if v is not None}
    written = 0
    started = False  # the answer began: a transport error from here on cuts the download off
    attempt = 0
    try:
        while not started:
            with client._http.stream("GET", path, params=query, headers={"Accept": accept}) as response:
                if response.status_code >= 400:
                    response.read()
                    # 429/503 before any data (e.g. the server is starting): retried as every client call is.
                    wait = client._retry_wait(response, attempt) if response.status_code in _RETRY_STATUSES else None
                    if wait is not None and attempt < client.max_retries:
                        attempt += 1
                        _base._sleep(wait)
                        continue
                    raise _error_from_response(response, operation)
                started = True
                expected = int(response.headers.get("content-length", "-1"))
                for chunk in response.iter_bytes():  # as the network delivers it: no re-chunking buffer beside it
                    sink.write(chunk)
                    written += len(chunk)
    except httpx.TimeoutException as exc:
        raise ServiceUnavailable(f"{operation}: no answer from {client.url} in time ({type(exc).__name__})") from exc
    except httpx.TransportError as exc:
        if started:
            raise NtkServiceError(
                f"{operation}: the download was cut off after {written} bytes had been written ({exc}); download it "
                "again"
            ) from exc
        raise ServiceUnavailable(f"{operation}: cannot reach {client.url} ({exc})") from exc
    if 0 <= expected != written:
        raise NtkServiceError(f"{operation}: the download was cut off: {written} of {expected} bytes")
    return written


def _bounds(key: Any, size: int, axis: str) -> tuple[int, int, Any]:
    """``(start, stop, local index)`` of a slice or an int over an axis of ``size``."""
    if isinstance(key, slice):
        start, stop, step = key.indices(size)
        if step < 1:
            raise ValueError(f"RemoteResult: {axis} slices need a positive step, got {key}")
        return start, max(start, stop), slice(None, None, step)
    if isinstance(key, int | np.integer):
        index = int(key) + (size if key < 0 else 0)
        if not 0 <= index < size:
            raise IndexError(f"RemoteResult: index {key} is out of range for {axis} of size {size}")
        return index, index + 1, 0
    raise TypeError(f"RemoteResult: index {axis} with slices or integers, got {type(key).__name__}")


class RemoteResult:
    """A succeeded job's kernel on the server; indexing fetches only the indexed block (``?rows=&cols=``).

    Slice bounds out of range are clipped as numpy clips them; an out-of-range integer raises IndexError, a
    negative step ValueError.

    Attributes:
        job_id: the job. shape, dtype, ndim: the whole result's. mode: the kernel mode.
        fetch_block_bytes: the most a strided or indexed slice fetches at a time (see ``FETCH_BLOCK_BYTES``).
    """

    def __init__(
        self, client: JobsClient, job: Mapping[str, Any], *, fetch_block_bytes: int = FETCH_BLOCK_BYTES
    ) -> None:
        if fetch_block_bytes < 1:
            raise ValueError(f"RemoteResult: fetch_block_bytes must be ≥ 1, got {fetch_block_bytes}")
        self.fetch_block_bytes = fetch_block_bytes
        self._client = client
        self.job_id = str(job["id"])
        self.shape: tuple[int, ...] = tuple(int(v) for v in job["result_shape"])
        self.dtype = np.dtype(str(job["dtype"]))
        self.ndim = len(self.shape)
        self.mode = str(job["mode"])

    def __repr__(self) -> str:
        return f"RemoteResult(job={self.job_id!r}, shape={self.shape}, dtype={self.dtype})"

    def __len__(self) -> int:
        return self.shape[0]

    def _fetch(self, rows: tuple[int, int], cols: tuple[int, int] | None) -> np.ndarray:
        shape = (rows[1] - rows[0], *(() if cols is None else (cols[1] - cols[0],)))
        shape += self.shape[len(shape) :]
        if 0 in shape:
            return np.zeros(shape, dtype=self.dtype)
        out = np.empty(shape, dtype=self.dtype)
        params = {"rows": f"{rows[0]}:{rows[1]}", "cols": None if cols is None else f"{cols[0]}:{cols[1]}"}
        return fetch_npy(self._client, self.job_id, params, out)

    def __getitem__(self, key: Any) -> np.ndarray:
        parts = expand_key(key, self.ndim, owner="RemoteResult")
        example_axes = 2 if MODES[self.mode].pairs else 1
        parts = parts + (slice(None),) * max(0, example_axes - len(parts))
        r0, r1, row_local = _bounds(parts[0], self.shape[0], "rows")
        cols = None
        col_local: tuple[Any, ...] = ()
        if example_axes == 2:
            c0, c1, local = _bounds(parts[1], self.shape[1], "cols")
            cols, col_local = (c0, c1), (local,)
        rest = tuple(parts[example_axes:])
        plain = all(p == slice(None, None, 1) for p in (row_local, *col_local))
        if plain or isinstance(row_local, int):  # the answer is the whole fetched block (or one row of it)
            block: np.ndarray = self._fetch((r0, r1), cols)[(row_local, *col_local, *rest)]
            return block
        # A step: fetch bounded row groups and keep the wanted rows of each, never the whole bounding block.
        step = int(row_local.step)
        wanted = range(r0, r1, step)
        tail = (() if cols is None else (cols[1] - cols[0],)) + self.shape[example_axes:]
        row_bytes = max(1, int(np.prod(tail, dtype=np.int64)) * self.dtype.itemsize)
        pick = (slice(None, None, step), *col_local, *rest)
        pieces = [self._fetch(span, cols)[pick] for span in row_groups(wanted, row_bytes, self.fetch_block_bytes)]
        if not pieces:
            empty: np.ndarray = self._fetch((r0, r0), cols)[pick]
            return empty
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        whole = self[...]
        return whole if dtype is None else whole.astype(dtype)

    def to_xarray(self, path: str | Path) -> Any:
        """Download the result's Zarr group (the same group as on the server's disk, zipped) to ``path`` and open it
        as an ``xarray.DataArray``.

        Args:
            path (str | Path): the zip file to write (``<path>.part`` until complete); kept, since the DataArray
                reads from it (lazily, with dask installed). E.g. ``"kernel.zarr.zip"``.

        Returns:
            xarray.DataArray ``theta``: dims as the mode has them (``("x1", "x2")`` trace, ``("x1", "x2", "out1",
            "out2")`` full, ...), attrs of the result (model, version, weights_sha256, mode, dtype, n, m, k,
            data-set rows, implementation, versions, ...: docs/results.md), and for a symmetric result the tiles
            below the diagonal filled from their mirror, so every value is the kernel's.

        Raises:
            OptionalDependencyMissing: xarray or zarr is not installed. JobNotFinished, JobNotFound,
            ResultNotFound: the server's errors. NtkServiceError: the download was cut off or is not a zip.
        """
        return open_zarr_zip(download_zarr(self._client, self.job_id, Path(path)))


def download_zarr(client: JobsClient, job_id: str, path: Path) -> Path:
    """Stream a succeeded job's result group, zipped (``GET /v1/jobs/{id}/zarr``), to ``path`` (via ``<path>.part``,
    renamed once it is a complete zip file); returns ``path``."""
    part = path.with_name(path.name + ".part")
    try:
        with part.open("wb") as sink:
            stream_npy(client, f"/v1/jobs/{job_id}/zarr", {}, sink, accept=ZIP_MEDIA)
        if not zipfile.is_zipfile(part):  # a zip ends with its directory: a cut-off body has none
            raise NtkServiceError(f"GET /v1/jobs/{job_id}/zarr: the download is not a complete zip file")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path


def open_zarr_zip(path: str | Path) -> Any:
    """A result group in a zip file (``download_zarr``) as an ``xarray.DataArray``, mirrored below the diagonal.

    Opened in place with ``zarr.storage.ZipStore`` (read-only; nothing is extracted). NOTE [symmetric reads] in
    ``ntk_service/jobs/results.py``: a symmetric result stores only the tiles on and above the diagonal, and a tile
    below it is its mirror's transpose (the output axes swapped too for "full").

    Raises:
        OptionalDependencyMissing: xarray or zarr is not installed.
    """
    try:
        import xarray as xr  # optional: only this conversion needs them
        import zarr
    except ImportError as exc:
        raise OptionalDependencyMissing(
            "to_xarray: needs xarray and zarr; pip install 'ntk-service[xarray]' (or xarray zarr dask)"
        ) from exc
    dataset = xr.open_zarr(zarr.storage.ZipStore(Path(path), mode="r"))
    theta = dataset["theta"]
    theta.attrs = {key: value for key, value in dataset.attrs.items() if key != "spec"}
    if not theta.attrs.get("symmetric") or "x2" not in theta.dims:
        return theta
    swap = {"x1": "x2", "x2": "x1"} | ({"out1": "out2", "out2": "out1"} if "out1" in theta.dims else {})
    mirror = theta.rename({a: f"{b}_" for a, b in swap.items()}).rename({f"{b}_": b for b in swap.values()})
    tiles = np.arange(theta.sizes["x1"]) // int(theta.attrs["tile_size"])
    below = xr.DataArray(tiles[:, None] > tiles[None, :], dims=("x1", "x2"))
    full = theta.where(~below, mirror.transpose(*theta.dims))
    full.attrs = theta.attrs
    return full


class _ArraySink:
    """A file-like sink that parses the .npy header, then copies the data straight into an array: ``out`` when given
    (the header must match it), else one allocated from the header (``result()``)."""

    def __init__(self, out: np.ndarray | None) -> None:
        self.out = out
        self.flat = None if out is None else out.reshape(-1).view(np.uint8)
        self.head = b""
        self.offset: int | None = None
        self.filled = 0

    def write(self, chunk: bytes) -> int:
        if self.offset is None:
            self.head += chunk
            if len(self.head) < 10:
                return len(chunk)
            header_len = int.from_bytes(self.head[8:10], "little")
            if len(self.head) < 10 + header_len:
                return len(chunk)
            self.offset = 10 + header_len
            stream = io.BytesIO(self.head[: self.offset])
            np.lib.format.read_magic(stream)
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
            if self.out is None and not fortran_order and not np.dtype(dtype).hasobject:
                self.out = np.empty(shape, dtype=dtype)
                self.flat = self.out.reshape(-1).view(np.uint8)
            if self.out is None or tuple(shape) != self.out.shape or np.dtype(dtype) != self.out.dtype:
                expected = "a C-order numeric array" if self.out is None else f"{self.out.shape} {self.out.dtype}"
                raise NtkServiceError(f"RemoteResult: the server sent {tuple(shape)} {dtype}, expected {expected}")
            chunk, self.head = self.head[self.offset :], b""
        assert self.flat is not None  # set with the header
        end = self.filled + len(chunk)
        if end > self.flat.size:
            raise NtkServiceError(f"RemoteResult: the server sent more than the {self.flat.size} bytes expected")
        self.flat[self.filled : end] = np.frombuffer(chunk, dtype=np.uint8)
        self.filled = end
        return len(chunk)

    def result(self) -> np.ndarray:
        """The array, once every byte arrived. Raises NtkServiceError when some are missing."""
        if self.out is None or self.flat is None or self.filled != self.flat.size:
            expected = "a header" if self.flat is None else f"{self.flat.size} bytes"
            raise NtkServiceError(f"RemoteResult: got {self.filled} bytes of the data, expected {expected}")
        return self.out


def fetch_npy(
    client: JobsClient, job_id: str, params: Mapping[str, str | None], out: np.ndarray | None = None
) -> np.ndarray:
    """A result (or a block) streamed as ``.npy`` straight into ``out`` (or an array allocated from the header):
    the data is held once, never as a response body and an array beside it."""
    sink = _ArraySink(out)
    stream_npy(client, f"/v1/jobs/{job_id}/result", params, sink)
    return sink.result()


def download_to(client: JobsClient, job_id: str, path: Path, params: Mapping[str, str | None]) -> np.ndarray:
    """Stream a result (or a block) to ``path`` (via ``<path>.part``, renamed when complete); a read-only memmap."""
    part = path.with_name(path.name + ".part")
    try:
        with part.open("wb") as sink:
            stream_npy(client, f"/v1/jobs/{job_id}/result", params, sink)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    memmap: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    return memmap
