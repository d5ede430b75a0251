"""The result store of a tiled kernel: one Zarr v3 group, ``<job dir>/result.zarr``, that any array tool opens.

Layout (format version ``FORMAT_VERSION``, documented in docs/results.md)::

    result.zarr/              group; attributes: FORMAT_NAME, format_version, what produced the numbers
      theta                   the kernel, one chunk per tile, dimension_names e.g. ("x1", "x2", "out1", "out2")
      tiles/done              uint8 (n_row_blocks · n_col_blocks,), one chunk per tile id: 1 once its chunk is written

``theta`` has the full kernel shape ((N, M, k, k) FULL, (N, M) TRACE, (N, M, k) OUTPUT_DIAGONAL, (N, k, k)
EXAMPLE_DIAGONAL) and chunks equal to the tile size, so each tile write touches exactly one chunk file (see NOTE
[raw chunk writes]). Separate processes (Ray workers) may write different chunks at once. The ledger ``tiles/done``
is written right after a panel's chunks, by whoever wrote them, so a result carries its own completion record:
``compute_ntk_tiled`` resumes from it and ``open_result`` can tell a finished result from a half-written one. (An
all-zero chunk is never stored by Zarr, so completion cannot be read from the chunks themselves.) The server keeps
its own record in SQLite as well (``store.py``). The group's metadata is consolidated, so
``xarray.open_zarr(path)`` opens it without a warning.

Results written before format version 1 were a bare array ``<job dir>/theta.zarr``; ``migrate_legacy`` turns one
into a group in place (a rename and a few small metadata files: no chunk is copied).

NOTE [symmetric reads]
    A symmetric job (x2 omitted) stores only the tiles on and above the diagonal. Θ(x1_m, x1_n) = Θ(x1_n, x1_m)ᵀ,
    so an entry below the diagonal is read from its mirror tile: FULL swaps both the example and the output axes
    (``theta[n, m, a, b] = theta[m, n, b, a]``), OUTPUT_DIAGONAL and TRACE swap the example axes. Diagonal tiles
    are made exactly symmetric when written (the upper triangle is mirrored onto the lower one; the engine's x2=None
    blocks already are, so this changes no bit there). Every read of the lower half is therefore a copy of a stored
    upper value, and ``read()`` of the whole array is exactly symmetric. Plain Zarr readers see zeros below the
    diagonal tiles; ``ntk_service.results.open_result`` mirrors them.

NOTE [raw chunk writes]
    ``write_tiles`` writes a chunk's file itself: the block's bytes, padded to the chunk shape with the fill value,
    in place (no temporary file, no rename), then each tile's 1-byte ledger file the same way. This is the layout
    Zarr itself writes for an uncompressed array (one ``bytes`` codec, little-endian, default ``c/i/j`` keys), so
    any Zarr reader reads it; an array with any other codec or key encoding is written through Zarr. Zarr's own
    write costs about 15x more per chunk (its async codec pipeline, then a temporary file and a rename: see
    docs/jobs.md, "Writes"). Dropping the rename is safe because of what holds around it:
    - A chunk is read as a tile's value only once the ledger says the tile is done, and the ledger byte is written
      after the whole chunk (one byte: never torn). A process killed mid-write leaves a short or mixed chunk whose
      tile is not done; resume recomputes the tile and rewrites the chunk in full.
    - Readers of an unfinished result (``open_result(allow_incomplete=True)``) read only the chunks of done tiles
      (``read_only_done``), so a short chunk is never decoded. A server reads a job's result only once it has
      succeeded (every tile done).
    - A rewrite never truncates: the file is opened without ``O_TRUNC`` and written to its full length, so a chunk
      rewritten after it was recorded (a Ray call re-run after its node was lost, whose first run still writes)
      always has its full size and holds one run's bytes or the other's, which are equal with the same torch
      threads.
    - Like Zarr's writes, none is fsynced: a crash of the process loses nothing recorded, a power cut may.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import zarr
import zarr.errors
from zarr.codecs import BytesCodec
from zarr.core.chunk_grids import RegularChunkGrid
from zarr.core.chunk_key_encodings import DefaultChunkKeyEncoding

from ntk_service.errors import InvalidInput
from ntk_service.jobs.planner import Tile, TilePlan, chunk_shape, plan_tiles
from ntk_service.kernels.modes import KernelMode

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LEGACY_ARRAY_NAME",
    "RESULT_GROUP_NAME",
    "ResultArray",
    "dimension_names",
    "is_half_created",
    "migrate_legacy",
    "result_attributes_at",
    "mirror_theta",
    "parse_range",
    "provenance",
    "symmetrize_tile",
]

RESULT_GROUP_NAME = "result.zarr"
"""Directory name of the result group inside a job's directory."""

LEGACY_ARRAY_NAME = "theta.zarr"
"""The bare array results were before format version 1 (migrated by ``migrate_legacy``)."""

FORMAT_NAME = "ntk-service-result"
"""The group attribute ``format`` that says what the group is."""

FORMAT_VERSION = 1
"""Bumped whenever the layout or the meaning of an attribute changes; readers refuse versions they do not know."""

_THETA = "theta"
_LEDGER = "tiles/done"


def dimension_names(mode: KernelMode) -> tuple[str, ...]:
    """The ``dimension_names`` of ``theta``: ("x1", "x2", "out1", "out2") FULL, ("x1", "x2") TRACE, ... (the mode's
    row of ``vocabulary.MODES``)."""
    return mode.spec.dimension_names


def provenance() -> dict[str, str]:
    """The versions that produced a result (``ntk_service_version``, ``torch_version``), read without importing."""
    out = {}
    for package, key in (("ntk-service", "ntk_service_version"), ("torch", "torch_version")):
        try:
            out[key] = version(package)
        except PackageNotFoundError:
            out[key] = "unknown"
    return out


def mirror_theta(theta: np.ndarray, mode: KernelMode) -> np.ndarray:
    """Θ(x2, x1) from a block Θ(x1, x2): (R, C, ...) -> (C, R, ...), see NOTE [symmetric reads]; the mode's
    ``example_swap`` (per-example blocks are transposed)."""
    return theta.transpose(mode.spec.example_swap)


def _upper_mask(shape: tuple[int, ...], mode: KernelMode) -> np.ndarray:
    # True where an entry is on or above the diagonal of the kernel seen as a (N·k × N·k) matrix: an example pair
    # above the diagonal, or on it with a ≤ b (every entry of a diagonal or summed output).
    pairs = mode.spec.pairs
    examples = 2 if pairs else 1
    if pairs:
        n_idx, m_idx = np.arange(shape[0])[:, None], np.arange(shape[1])[None, :]
        above, on = n_idx < m_idx, n_idx == m_idx
    else:
        above, on = np.zeros(shape[0], dtype=bool), np.ones(shape[0], dtype=bool)
    outputs = shape[examples:]
    a_le_b = np.triu(np.ones(outputs, dtype=bool)) if len(outputs) == 2 else np.ones(outputs, dtype=bool)
    spread = (..., *(None,) * len(outputs))
    mask: np.ndarray = above[spread] | (on[spread] & a_le_b)
    return mask


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


def _consolidate(path: Path) -> None:
    # Zarr warns that consolidated metadata is not (yet) in the v3 spec; xarray and zarr-python both read it, and
    # without it xarray.open_zarr warns on every open.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
        zarr.consolidate_metadata(str(path))


def plan_from_attributes(attributes: dict[str, Any], *, path: Path) -> tuple[TilePlan, int]:
    """The TilePlan and k of a result, from its group attributes.

    Raises:
        InvalidInput: not an ntk-service result, or a format version this version cannot read.
    """
    if attributes.get("format") != FORMAT_NAME:
        raise InvalidInput(
            f"open_result: {str(path)!r} is not an ntk-service result (its attribute 'format' is "
            f"{attributes.get('format')!r}, expected {FORMAT_NAME!r}); pass the result.zarr folder of a job"
        )
    found = attributes.get("format_version")
    if not isinstance(found, int) or found > FORMAT_VERSION:
        raise InvalidInput(
            f"open_result: {str(path)!r} has format version {found!r}; this ntk-service reads up to "
            f"{FORMAT_VERSION}: upgrade ntk-service"
        )
    mode = KernelMode(attributes["mode"])
    symmetric = bool(attributes["symmetric"])
    plan = plan_tiles(
        n=int(attributes["n"]),
        m=None if symmetric else int(attributes["m"]),
        tile_size=int(attributes["tile_size"]),
        mode=mode,
    )
    return plan, int(attributes["k"])


def result_attributes_at(path: Path) -> dict[str, Any] | None:
    """The group attributes of the ntk-service result at ``path``, or None when ``path`` holds no such result
    (read from ``zarr.json`` alone: nothing else is opened)."""
    try:
        metadata = json.loads((path / "zarr.json").read_text())
    except (OSError, ValueError):
        return None
    attributes = metadata.get("attributes") if isinstance(metadata, dict) else None
    if not isinstance(attributes, dict) or attributes.get("format") != FORMAT_NAME:
        return None
    return attributes


def is_half_created(path: Path) -> bool:
    """True for a result group whose creation was cut off (its attributes are written, ``theta`` or the ledger is
    not): no tile of it can have been written, since tiles are written only after ``ResultArray.create`` returns."""
    if result_attributes_at(path) is None:
        return False
    return not ((path / _THETA / "zarr.json").is_file() and (path / _LEDGER / "zarr.json").is_file())


def _ledger_size(plan: TilePlan) -> int:
    return max(t.id for t in plan.tiles) + 1


class ResultArray:
    """The result group of one tiled kernel: write tiles (and their ledger entries), read blocks with mirroring.

    Args:
        path: the group directory (``<data_dir>/jobs/<id>/result.zarr``).
        plan: the TilePlan (tile geometry and symmetry).
        group: the open Zarr group.

    Examples:
        >>> arr = ResultArray.create(path, plan=plan, k=10, dtype="float32", attributes={})  # doctest: +SKIP
        >>> arr.write_tile(plan.tiles[0], theta)     # theta (T, T, 10, 10) for FULL         # doctest: +SKIP
        >>> arr.read(rows=(0, 64), cols=(0, 32)).shape                                       # doctest: +SKIP
        (64, 32, 10, 10)
    """

    def __init__(self, path: Path, plan: TilePlan, group: Any, *, raw_writes: bool = True) -> None:
        self.path = Path(path)
        self.plan = plan
        self._group = group
        self._array = group[_THETA]
        self._ledger = group[_LEDGER]
        self._raw_theta = raw_writes and _is_raw(self._array)
        self._raw_ledger = raw_writes and _is_raw(self._ledger)
        self._made_dirs: set[Path] = set()
        self._only_done: dict[tuple[int, int], int] | None = None
        self._done_ids: frozenset[int] = frozenset()

    @classmethod
    def create(cls, path: Path, *, plan: TilePlan, k: int, dtype: str, attributes: dict[str, Any]) -> ResultArray:
        """Create the (empty, zero-filled) group; overwrites a half-created one left by a crash.

        ``attributes`` (what produced the numbers) are stored with the geometry (``n``, ``m``, ``k``, ``mode``,
        ``symmetric``, ``tile_size``, ``dtype``), the format name and version and ``provenance()``.
        """
        attrs = {
            **attributes,
            **_geometry(plan, k),
            "dtype": dtype,
            **provenance(),
        }
        group = zarr.open_group(str(path), mode="w", attributes=attrs)
        group.create_array(
            _THETA,
            shape=plan.result_shape(k),
            chunks=chunk_shape(plan.mode, plan.tile_size, k),
            dtype=dtype,
            fill_value=0,
            # Kernel values are dense floats that barely compress; storing them raw keeps the disk estimate exact.
            compressors=None,
            dimension_names=dimension_names(plan.mode),
        )
        _create_ledger(group, plan)
        _consolidate(path)
        return cls(path, plan, zarr.open_group(str(path), mode="r+"))

    @classmethod
    def open(
        cls, path: Path, *, plan: TilePlan | None = None, writable: bool = True, raw_writes: bool = True
    ) -> ResultArray:
        """Open an existing group (any process with the path may write tiles to it).

        Args:
            plan: the TilePlan. Default: rebuilt from the group's attributes.
            writable: open for writing tiles. Default: True.
            raw_writes: write chunks and ledger entries as plain files where the layout allows (NOTE [raw chunk
                writes]); False writes every one through Zarr, as results were written before (the A/B in
                benchmarks/bench_jobs.py). Default: True.

        Raises:
            InvalidInput: no result group at ``path``, or one of an unknown format version.
        """
        try:
            group = zarr.open_group(str(path), mode="r+" if writable else "r")
        except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError) as exc:
            raise InvalidInput(
                f"open_result: no ntk-service result at {str(path)!r} ({type(exc).__name__}); pass the result.zarr "
                "folder that compute_ntk_tiled or a job wrote"
            ) from exc
        attributes = dict(group.attrs.asdict())
        if plan is None:
            plan, _ = plan_from_attributes(attributes, path=Path(path))
        if is_half_created(Path(path)):
            raise InvalidInput(
                f"open_result: the result at {str(path)!r} was never fully created (its creation was cut off: theta "
                "or tiles/done is missing) and holds no tile; run compute_ntk_tiled with this out again to start it"
            )
        return cls(path, plan, group, raw_writes=raw_writes)

    @property
    def attributes(self) -> dict[str, Any]:
        return dict(self._group.attrs.asdict())

    def update_attributes(self, values: dict[str, Any]) -> None:
        """Merge ``values`` into the group attributes (and refresh the consolidated metadata)."""
        self._group.attrs.update(values)
        _consolidate(self.path)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        dtype: np.dtype[Any] = np.dtype(self._array.dtype)
        return dtype

    def write_tile(self, tile: Tile, theta: np.ndarray) -> None:
        """Write one tile's block (its chunk), then its ledger entry. Diagonal tiles of symmetric jobs are
        symmetrized first.

        Args:
            tile: the planned tile.
            theta: its block: (R, C, k, k) FULL, (R, C) TRACE, (R, C, k) OUTPUT_DIAGONAL, (R, k, k)
                EXAMPLE_DIAGONAL, with R = tile.n_rows, C = tile.n_cols.
        """
        self.write_tiles([(tile, theta)])

    def write_tiles(self, blocks: Sequence[tuple[Tile, np.ndarray]]) -> None:
        """Write a panel's tiles: every chunk first, then their ledger entries (a crash in between leaves chunks
        that no ledger entry claims: they are computed again, never skipped). Chunks and ledger entries are written
        as plain files where the array's layout allows (NOTE [raw chunk writes]).

        Args:
            blocks: ``(tile, theta)`` pairs, each as for ``write_tile``.
        """
        mode = self.plan.mode
        for tile, theta in blocks:
            block = symmetrize_tile(theta, mode) if tile.is_diagonal else theta
            r0, r1 = tile.rows
            if self._raw_theta:
                self._write_raw_chunk(tile, block)
            elif not mode.spec.pairs:
                self._array[r0:r1] = block
            else:
                c0, c1 = tile.cols
                self._array[r0:r1, c0:c1] = block
        for tile, _ in blocks:
            if self._raw_ledger:
                self._write_file(self.path / _LEDGER / "c" / str(tile.id), b"\x01")
            else:
                self._ledger[tile.id] = 1

    def _write_raw_chunk(self, tile: Tile, block: np.ndarray) -> None:
        # The chunk's bytes as Zarr stores them uncompressed: C order, little-endian, padded to the chunk shape with
        # the fill value (edge tiles); see NOTE [raw chunk writes].
        chunks = tuple(self._array.chunks)
        dtype = np.dtype(self._array.dtype).newbyteorder("<")
        if tuple(block.shape) == chunks:
            data = np.ascontiguousarray(block, dtype=dtype)
        else:
            data = np.full(chunks, self._array.fill_value, dtype=dtype)
            data[tuple(slice(0, n) for n in block.shape)] = block
        index: tuple[int, ...] = (tile.i, tile.j) if self.plan.mode.spec.pairs else (tile.i,)
        index += (0,) * (len(chunks) - len(index))
        self._write_file(self.path / _THETA / "c" / "/".join(map(str, index)), data.data.cast("B"))

    def _write_file(self, path: Path, data: bytes | memoryview) -> None:
        # In place and never truncated (NOTE [raw chunk writes]): the file ends up exactly len(data) long, since
        # every write of a chunk writes its full length.
        if path.parent not in self._made_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def done_tile_ids(self) -> set[int]:
        """Ids of the tiles whose chunk is written, from the ledger."""
        return {int(i) for i in np.flatnonzero(np.asarray(self._ledger[:]))}

    def read_only_done(self, done_tile_ids: set[int]) -> None:
        """From now on read only the chunks of the tiles in ``done_tile_ids`` and read every other tile as 0 (an
        unfinished result: a tile not done may have a chunk cut off mid-write, see NOTE [raw chunk writes])."""
        self._only_done = {(t.i, t.j): t.id for t in self.plan.tiles}
        self._done_ids = frozenset(done_tile_ids)

    def _stored(self, rows: tuple[int, int], cols: tuple[int, int] | None) -> np.ndarray:
        # The stored values of a block (no mirroring); with read_only_done, only the done tiles' chunks are read.
        r0, r1 = rows
        if self._only_done is None:
            return np.asarray(self._array[r0:r1] if cols is None else self._array[r0:r1, cols[0] : cols[1]])
        t = self.plan.tile_size
        c0, c1 = cols if cols is not None else (0, 1)
        head = (r1 - r0,) if cols is None else (r1 - r0, c1 - c0)
        out = np.zeros(head + self.shape[len(head) :], dtype=self.dtype)
        for i in range(r0 // t, -(-r1 // t)):
            a0, a1 = max(r0, i * t), min(r1, (i + 1) * t)
            if cols is None:
                if self._only_done.get((i, i)) in self._done_ids:
                    out[a0 - r0 : a1 - r0] = self._array[a0:a1]
                continue
            for j in range(c0 // t, -(-c1 // t)):
                b0, b1 = max(c0, j * t), min(c1, (j + 1) * t)
                if self._only_done.get((i, j)) in self._done_ids:
                    out[a0 - r0 : a1 - r0, b0 - c0 : b1 - c0] = self._array[a0:a1, b0:b1]
        return out

    def read(self, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> np.ndarray:
        """Read the whole result or a block of it, mirroring the lower half of symmetric jobs.

        Reads the chunks the block intersects and, when the block reaches below the diagonal tiles, those its
        mirror block intersects; nothing else.

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
        if not plan.mode.spec.pairs:
            if cols is not None:
                raise InvalidInput(f"job result: mode {plan.mode.value!r} has no column axis; omit cols")
            return self._stored((r0, r1), None)
        c0, c1 = cols if cols is not None else (0, plan.m)
        if not plan.symmetric:
            return self._stored((r0, r1), (c0, c1))
        t = plan.tile_size
        below = (np.arange(r0, r1) // t)[:, None] > (np.arange(c0, c1) // t)[None, :]
        if below.all():
            return np.ascontiguousarray(mirror_theta(self._stored((c0, c1), (r0, r1)), plan.mode))
        out = self._stored((r0, r1), (c0, c1))
        if not below.any():
            return out
        mirrored = mirror_theta(self._stored((c0, c1), (r0, r1)), plan.mode)
        below = below.reshape(below.shape + (1,) * (out.ndim - 2))
        return np.where(below, mirrored, out)


def _is_raw(array: Any) -> bool:
    # Zarr stores a chunk of this array as its bare little-endian bytes under the default "c/i/j" key: what
    # ResultArray writes itself (NOTE [raw chunk writes]).
    metadata = array.metadata
    if getattr(metadata, "zarr_format", None) != 3 or len(metadata.codecs) != 1:
        return False
    codec = metadata.codecs[0]
    encoding = metadata.chunk_key_encoding
    dtype = np.dtype(array.dtype)
    return (
        isinstance(codec, BytesCodec)
        and (dtype.itemsize == 1 or (codec.endian is not None and codec.endian.value == "little"))
        and isinstance(encoding, DefaultChunkKeyEncoding)
        and encoding.separator == "/"
        and isinstance(metadata.chunk_grid, RegularChunkGrid)
        and dtype.byteorder in ("=", "<", "|")
    )


def _geometry(plan: TilePlan, k: int) -> dict[str, Any]:
    """The format and the geometry a result group's attributes record."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "mode": plan.mode.value,
        "n": plan.n,
        "m": plan.m,
        "k": k,
        "symmetric": plan.symmetric,
        "stored": "upper tiles (mirror the rest)" if plan.symmetric else "all tiles",
        "tile_size": plan.tile_size,
        "tiles_total": len(plan.tiles),
    }


def _create_ledger(group: Any, plan: TilePlan) -> None:
    group.require_group("tiles").create_array(
        "done",
        shape=(_ledger_size(plan),),
        chunks=(1,),  # one file per tile: concurrent writers (Ray workers) never share a chunk
        dtype="uint8",
        fill_value=0,
        compressors=None,
        dimension_names=("tile",),
        overwrite=True,
    )


def migrate_legacy(
    job_dir: Path, *, plan: TilePlan, k: int, done_tile_ids: set[int], attributes: dict[str, Any] | None = None
) -> bool:
    """Turn a result written before format version 1 (a bare array ``theta.zarr``) into the result group, in place.

    Idempotent and safe to interrupt: the array is moved by one rename, then the group's metadata is written; a run
    cut off in between is finished by the next call. No chunk is copied.

    Args:
        job_dir: the job's directory.
        plan: the job's TilePlan. k: outputs per example.
        done_tile_ids: the tiles recorded as done (from SQLite), written to the ledger.
        attributes: attributes to add (what produced the numbers, in today's names); the old ones are kept.

    Returns:
        True when something was migrated; False when there was nothing to do.
    """
    legacy, group_path = job_dir / LEGACY_ARRAY_NAME, job_dir / RESULT_GROUP_NAME
    if legacy.exists():
        old = dict(zarr.open_array(str(legacy), mode="r").attrs.asdict())
        if not (group_path / "zarr.json").exists():
            zarr.open_group(str(group_path), mode="w", attributes={"legacy_attributes": old})
        os.replace(legacy, group_path / _THETA)
    elif not _is_half_migrated(group_path):
        return False
    group = zarr.open_group(str(group_path), mode="r+", use_consolidated=False)
    legacy_attributes: Any = group.attrs.get("legacy_attributes")
    # Cut off after the new attributes were written: they already hold the old ones, keep them as they are.
    old = dict(legacy_attributes) if legacy_attributes is not None else dict(group.attrs.asdict())
    _set_dimension_names(group_path / _THETA / "zarr.json", dimension_names(plan.mode))
    _create_ledger(group, plan)
    ledger: Any = group[_LEDGER]
    for tile_id in sorted(done_tile_ids):
        ledger[tile_id] = 1
    group.attrs.put(
        {
            **(attributes or {}),
            **old,  # what the old version recorded wins (implementation_used, ...)
            **_geometry(plan, k),
            "migrated_from": LEGACY_ARRAY_NAME,
            **provenance(),
        }
    )
    _consolidate(group_path)
    return True


def _is_half_migrated(group_path: Path) -> bool:
    # A migration cut off after the rename (the group still carries only the old attributes), or after the new
    # attributes but before the consolidated metadata, which is written last.
    try:
        metadata = json.loads((group_path / "zarr.json").read_text())
    except FileNotFoundError:
        return False
    attributes = metadata.get("attributes", {})
    if "legacy_attributes" in attributes:
        return True
    return attributes.get("migrated_from") == LEGACY_ARRAY_NAME and not metadata.get("consolidated_metadata")


def _set_dimension_names(metadata_path: Path, names: tuple[str, ...]) -> None:
    # zarr-python has no API to change an existing array's dimension_names; they are one key of its zarr.json.
    metadata = json.loads(metadata_path.read_text())
    metadata["dimension_names"] = list(names)
    tmp = metadata_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(metadata, indent=2))
    os.replace(tmp, metadata_path)
