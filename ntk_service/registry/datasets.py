"""DatasetStore: uploaded input arrays, stored once as .npy and referenced by id and row range in kernel requests.

    >>> store = DatasetStore(Path("/tmp/ntk-data"))
    >>> record = store.create(np.zeros((100, 4), np.float32), name="train")
    >>> record.shape, record.id[:3]  # ((100, 4), 'ds_')
    >>> store.load(record.id, 10, 20).shape  # rows [10, 20): (10, 4)
    >>> named = store.create({"input_ids": ids, "attention_mask": mask})   # several named arrays, one N
    >>> store.load(named.id, 0, 8)["input_ids"].shape  # (8, T)

Layout: rows in ``registry.sqlite3`` (table ``datasets``), a single array in ``datasets/<id>.npy``; the arrays of a
named data set in ``datasets/<id>-<i>.npy``, i its position (the server's name for the file, never the client's), the
names, shapes and dtypes in the row's ``arrays`` column. Written as described in NOTE [crash safety] in files.py: every
file of a data set is published in the one write transaction that inserts its row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ntk_service.errors import DatasetNotFound, EmptyBatch, InvalidInput, NonFiniteInput
from ntk_service.registry.database import DATABASE_FILENAME, Database
from ntk_service.registry.files import FileStore
from ntk_service.registry.records import DatasetRecord

__all__ = [
    "DATASET_DTYPES",
    "MAX_ARRAYS",
    "MAX_ARRAY_NAME_LENGTH",
    "NAMED_DTYPE",
    "DatasetArray",
    "DatasetStore",
    "NamedDatasetRecord",
]

logger = logging.getLogger(__name__)

DATASET_DTYPES = ("float32", "float64", "int64")
"""Float inputs for mlp/cnn/factory models, int64 token ids for transformers."""

MAX_ARRAYS = 64
"""Most named arrays in one data set."""

MAX_ARRAY_NAME_LENGTH = 64
"""Longest array name (a Python identifier: the keyword argument of forward it feeds)."""

NAMED_DTYPE = "mapping"
"""The ``dtype`` of a named data set's record (each array has its own, in ``arrays``)."""

_ID_PATTERN = re.compile(r"^ds_[0-9a-f]{24}$")
_COLUMNS = "id, name, shape, dtype, sha256, size_bytes, created_at, arrays"
_MAX_NAME_LENGTH = 128
_HASH_CHUNK = 1 << 20


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class DatasetArray:
    """One array of a named data set.

    Attributes:
        name: its name, a Python identifier (the forward keyword argument it feeds).
        shape: (N, *example_shape), N the data set's.
        dtype: "float32", "float64" or "int64".
        sha256: hex sha256 of its .npy file. size_bytes: that file's size.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sha256: str
    size_bytes: int

    def to_public(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class NamedDatasetRecord(DatasetRecord):
    """A data set of several named arrays with one N: ``shape`` is (N,), ``dtype`` is "mapping", ``sha256`` hashes
    the names and every array's hash (``_named_sha256``), ``size_bytes`` is all files together.

    Attributes:
        arrays: the arrays in upload order.
    """

    arrays: tuple[DatasetArray, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.arrays)

    def to_public(self) -> dict[str, Any]:
        """The single-array fields, plus ``arrays``: ``[{"name", "shape", "dtype"}, ...]``."""
        return {**super().to_public(), "arrays": [a.to_public() for a in self.arrays]}


def _record_from_row(row: Any) -> DatasetRecord:
    fields = {
        "id": row[0],
        "name": row[1],
        "shape": tuple(json.loads(row[2])),
        "dtype": row[3],
        "sha256": row[4],
        "size_bytes": row[5],
        "created_at": datetime.fromisoformat(row[6]),
    }
    if row[7] is None:
        return DatasetRecord(**fields)
    arrays = tuple(
        DatasetArray(
            name=a["name"], shape=tuple(a["shape"]), dtype=a["dtype"], sha256=a["sha256"], size_bytes=a["size"]
        )
        for a in json.loads(row[7])
    )
    return NamedDatasetRecord(**fields, arrays=arrays)


def _leaf_key(dataset_id: str, position: int) -> str:
    return f"{dataset_id}-{position}"


def _file_keys(record_id: str, arrays_json: str | None) -> set[str]:
    if arrays_json is None:
        return {record_id}
    return {_leaf_key(record_id, i) for i in range(len(json.loads(arrays_json)))}


def _named_sha256(arrays: list[DatasetArray]) -> str:
    """One content hash of a named data set: its names, in order, each with its file's hash (two uploads of the same
    arrays under the same names get the same hash, so a job's side cache and result attributes name the data)."""
    digest = hashlib.sha256(b"ntk-service named dataset v1\n")
    for a in arrays:
        digest.update(f"{a.name}\0{a.sha256}\n".encode())
    return digest.hexdigest()


def _checked_names(arrays: Mapping[Any, Any], op: str) -> list[str]:
    if not arrays:
        raise InvalidInput(f"{op}: got no arrays; upload at least one named array")
    if len(arrays) > MAX_ARRAYS:
        raise InvalidInput(f"{op}: got {len(arrays)} arrays, at most {MAX_ARRAYS} fit in one data set")
    names = list(arrays)
    for name in names:
        ok = isinstance(name, str) and name.isascii() and name.isidentifier() and len(name) <= MAX_ARRAY_NAME_LENGTH
        if not ok:
            raise InvalidInput(
                f"{op}: array name {name!r} is not allowed; name each array by an ASCII identifier of at most "
                f"{MAX_ARRAY_NAME_LENGTH} characters (letters, digits and '_', not starting with a digit), as the "
                "model's forward names its argument"
            )
    return names


def _checked_array(array: object, op: str, what: str | None = None) -> np.ndarray:
    """The array, native byte order and C-contiguous; ``what`` names it in messages (an array of a named set)."""
    at = f"{op}: {what}:" if what else f"{op}:"
    if not isinstance(array, np.ndarray):
        raise InvalidInput(f"{at} expected a numpy array, got {type(array).__name__}")
    if array.dtype.name not in DATASET_DTYPES:
        raise InvalidInput(
            f"{at} dtype {array.dtype} is not supported; expected one of {', '.join(DATASET_DTYPES)} "
            "(convert with array.astype(np.float32), or np.int64 for token ids)"
        )
    if array.ndim == 0:
        raise InvalidInput(f"{at} expected an array of shape (N, *example_shape), got a scalar")
    if array.shape[0] == 0:
        raise EmptyBatch(f"{at} the array has 0 rows (shape {array.shape}); upload at least one example")
    if 0 in array.shape:
        raise InvalidInput(f"{at} shape {array.shape} has an empty dimension; every example must have values")
    if array.dtype.kind == "f" and not bool(np.isfinite(array).all()):
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise NonFiniteInput(f"{at} the array holds {bad} NaN or inf values; upload finite values only")
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))


class DatasetStore:
    """Uploaded data sets; thread-safe.

    Args:
        data_dir (Path): shared with ModelRegistry (same database file); created if missing.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._db = Database(self.data_dir / DATABASE_FILENAME)
        self._files = FileStore(self.data_dir / "datasets", ".npy")
        self._sweep()

    def create(self, array: np.ndarray | Mapping[str, np.ndarray], *, name: str | None = None) -> DatasetRecord:
        """Store an array, or several named arrays with one N, as a new data set.

        Args:
            array (np.ndarray | Mapping[str, np.ndarray]): (N, *example_shape), N >= 1, float32 / float64 (finite)
                or int64; or a mapping name -> such an array, every array with the same N, names ASCII
                identifiers (at most ``MAX_ARRAYS``), e.g. ``{"input_ids": (N, T) int64, "attention_mask": ...}``.
            name (str | None): optional label, at most 128 printable characters. Default: None.

        Returns:
            Its DatasetRecord (id ``ds_`` + 24 hex digits); a NamedDatasetRecord for a mapping.

        Raises:
            InvalidInput: unsupported dtype, a scalar, an empty dimension, a bad label or array name, arrays with
                different N (each named).
            EmptyBatch: N = 0.
            NonFiniteInput: NaN or inf.
        """
        op = "create dataset"
        if name is not None and (
            not isinstance(name, str) or not 1 <= len(name) <= _MAX_NAME_LENGTH or not name.isprintable()
        ):
            raise InvalidInput(f"{op}: name must be 1-{_MAX_NAME_LENGTH} printable characters, got {name!r}")
        if isinstance(array, Mapping):
            return self._create_named(array, name, op)
        data = _checked_array(array, op)
        dataset_id = f"ds_{secrets.token_hex(12)}"
        tmp = self._write_temp(data)
        with self._files.temp_cleanup(tmp):
            record = DatasetRecord(
                id=dataset_id,
                name=name,
                shape=tuple(int(n) for n in data.shape),
                dtype=data.dtype.name,
                sha256=_file_sha256(tmp),
                size_bytes=tmp.stat().st_size,
                created_at=datetime.now(UTC),
            )
            self._publish(record, [(tmp, dataset_id)])
        logger.info("stored dataset %s %s %s", dataset_id, record.shape, record.dtype)
        return record

    def _create_named(self, arrays: Mapping[str, np.ndarray], name: str | None, op: str) -> NamedDatasetRecord:
        names = _checked_names(arrays, op)
        checked = [_checked_array(arrays[n], op, f"array {n!r}") for n in names]
        sizes = {n: int(a.shape[0]) for n, a in zip(names, checked, strict=True)}
        if len(set(sizes.values())) > 1:
            shown = ", ".join(f"{n!r}: {size}" for n, size in sizes.items())
            raise InvalidInput(
                f"{op}: every array must have the same number of rows (N, dim 0), got {shown}; "
                "upload the examples of every input together"
            )
        dataset_id = f"ds_{secrets.token_hex(12)}"
        temps: list[tuple[Path, str]] = []
        try:
            leaves = []
            for i, (n, data) in enumerate(zip(names, checked, strict=True)):
                tmp = self._write_temp(data)
                temps.append((tmp, _leaf_key(dataset_id, i)))
                shape = tuple(int(d) for d in data.shape)
                leaves.append(DatasetArray(n, shape, data.dtype.name, _file_sha256(tmp), tmp.stat().st_size))
            record = NamedDatasetRecord(
                id=dataset_id,
                name=name,
                shape=(sizes[names[0]],),
                dtype=NAMED_DTYPE,
                sha256=_named_sha256(leaves),
                size_bytes=sum(a.size_bytes for a in leaves),
                created_at=datetime.now(UTC),
                arrays=tuple(leaves),
            )
            self._publish(record, temps)
        finally:
            for tmp, _ in temps:  # published temps no longer exist
                tmp.unlink(missing_ok=True)
        logger.info(
            "stored dataset %s: %d arrays (%s) of %d rows", dataset_id, len(names), ", ".join(names), sizes[names[0]]
        )
        return record

    def _write_temp(self, data: np.ndarray) -> Path:
        def write(f: BinaryIO) -> None:
            np.save(f, data, allow_pickle=False)

        return self._files.write_temp(write)

    def _publish(self, record: DatasetRecord, temps: list[tuple[Path, str]]) -> None:
        """Publish every file and insert the row in one write transaction (NOTE [crash safety])."""
        try:
            with self._db.write() as conn:
                for tmp, key in temps:
                    self._files.publish(tmp, key)
                self._insert_row(conn, record)
        except BaseException:
            for _, key in temps:
                self._files.remove(key)
            raise

    def get(self, dataset_id: str) -> DatasetRecord:
        """A data set's record (a NamedDatasetRecord for a data set of named arrays).

        Raises:
            DatasetNotFound: no such id.
        """
        rows = self._db.query(f"SELECT {_COLUMNS} FROM datasets WHERE id = ?", (dataset_id,))
        if not rows:
            hint = "" if _ID_PATTERN.fullmatch(str(dataset_id)) else " (ids look like ds_ + 24 hex digits)"
            raise DatasetNotFound(
                f"dataset {dataset_id!r} not found{hint}; list the stored data sets with GET /v1/datasets"
            )
        return _record_from_row(rows[0])

    def list(self) -> list[DatasetRecord]:
        """All data sets, oldest first."""
        rows = self._db.query(f"SELECT {_COLUMNS} FROM datasets ORDER BY created_at, id")
        return [_record_from_row(r) for r in rows]

    def delete(self, dataset_id: str) -> None:
        """Delete a data set and its files.

        Raises:
            DatasetNotFound: no such id.
        """
        with self._db.write() as conn:
            row = conn.execute("SELECT arrays FROM datasets WHERE id = ?", (dataset_id,)).fetchone()
            if row is None:
                raise DatasetNotFound(f"delete dataset: dataset {dataset_id!r} not found")
            conn.execute("DELETE FROM datasets WHERE id = ?", (dataset_id,))
        for key in _file_keys(dataset_id, row[0]):
            self._files.remove(key)
        logger.info("deleted dataset %s", dataset_id)

    def path(self, dataset_id: str) -> Path:
        """The stored .npy file of a single-array data set (immutable; for streaming responses).

        Raises:
            DatasetNotFound: no such id.
            InvalidInput: a data set of named arrays (several files: read it with ``load``).
        """
        record = self.get(dataset_id)
        if isinstance(record, NamedDatasetRecord):
            raise InvalidInput(
                f"dataset path: {dataset_id!r} holds named arrays {list(record.names)}, not one file; read it with load"
            )
        return self._files.path(record.id)

    def load(
        self, dataset_id: str, start: int | None = None, stop: int | None = None
    ) -> np.ndarray | dict[str, np.ndarray]:
        """Rows ``[start, stop)`` of a data set, read through a memory map (only those rows are read).

        Args:
            dataset_id (str): the id.
            start (int | None): first row, 0 <= start < stop. Default: 0.
            stop (int | None): one past the last row, stop <= N. Default: N.

        Returns:
            A new (stop - start, *example_shape) array of the data set's dtype; for a data set of named arrays a
            dict name -> such an array, in upload order.

        Raises:
            DatasetNotFound: no such id.
            InvalidInput: a range outside [0, N) or an empty range (the message gives the valid range).
        """
        record = self.get(dataset_id)
        n = record.shape[0]
        lo = 0 if start is None else start
        hi = n if stop is None else stop
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi))
        if not ints or not 0 <= lo < hi <= n:
            raise InvalidInput(
                f"load dataset {dataset_id!r}: rows [{start}, {stop}) are not a valid range; the data set has {n} "
                f"rows, so use 0 <= start < stop <= {n}"
            )
        if isinstance(record, NamedDatasetRecord):
            return {a.name: self._rows(_leaf_key(record.id, i), lo, hi) for i, a in enumerate(record.arrays)}
        return self._rows(record.id, lo, hi)

    def first_out_of_range(
        self, dataset_id: str, array: str, size: int, start: int, stop: int, *, chunk_rows: int = 4096
    ) -> tuple[int, int] | None:
        """The first row of ``[start, stop)`` whose integer array ``array`` holds a value outside ``[0, size)``
        (token ids against a vocabulary), read ``chunk_rows`` rows at a time through the memory map.

        Args:
            dataset_id (str): a data set of named arrays. array (str): one of its int64 arrays.
            size (int): the vocabulary size. start, stop (int): the rows to check (a valid range).
            chunk_rows (int): rows read at once, so memory stays bounded. Default: 4096.

        Returns:
            ``(row, value)`` of the first offending row and its first offending value; None when every value fits.

        Raises:
            DatasetNotFound: no such id. InvalidInput: not a named data set, or no such array.
        """
        record = self.get(dataset_id)
        if not isinstance(record, NamedDatasetRecord) or array not in record.names:
            raise InvalidInput(f"dataset ids check: {dataset_id!r} has no named array {array!r}")
        mapped = np.load(
            self._files.path(_leaf_key(record.id, record.names.index(array))), mmap_mode="r", allow_pickle=False
        )
        try:
            for lo in range(start, stop, chunk_rows):
                block = np.asarray(mapped[lo : min(lo + chunk_rows, stop)]).reshape(min(lo + chunk_rows, stop) - lo, -1)
                bad = ((block < 0) | (block >= size)).any(axis=1)
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    row = block[i]
                    return lo + i, int(row[(row < 0) | (row >= size)][0])
            return None
        finally:
            del mapped

    def _rows(self, key: str, lo: int, hi: int) -> np.ndarray:
        mapped = np.load(self._files.path(key), mmap_mode="r", allow_pickle=False)
        try:
            return np.array(mapped[lo:hi])
        finally:
            del mapped

    def close(self) -> None:
        """Close the database connections."""
        self._db.close()

    def _insert_row(self, conn: Any, record: DatasetRecord) -> None:
        arrays = None
        if isinstance(record, NamedDatasetRecord):
            arrays = json.dumps(
                [
                    {"name": a.name, "shape": list(a.shape), "dtype": a.dtype, "sha256": a.sha256, "size": a.size_bytes}
                    for a in record.arrays
                ]
            )
        conn.execute(
            f"INSERT INTO datasets ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                record.id,
                record.name,
                json.dumps(list(record.shape)),
                record.dtype,
                record.sha256,
                record.size_bytes,
                record.created_at.isoformat(),
                arrays,
            ),
        )

    def _sweep(self) -> None:
        with self._db.write() as conn:
            referenced = set()
            for dataset_id, arrays in conn.execute("SELECT id, arrays FROM datasets"):
                referenced |= _file_keys(dataset_id, arrays)
            removed, _ = self._files.sweep(referenced)
        if removed:
            logger.info("removed %d data set files without a record", len(removed))
