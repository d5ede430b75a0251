"""DatasetStore: uploaded input arrays, stored once as .npy and referenced by id and row range in kernel requests.

    >>> store = DatasetStore(Path("/tmp/ntk-data"))
    >>> record = store.create(np.zeros((100, 4), np.float32), name="train")
    >>> record.shape, record.id[:3]  # ((100, 4), 'ds_')
    >>> store.load(record.id, 10, 20).shape  # rows [10, 20): (10, 4)

Layout: rows in ``registry.sqlite3`` (table ``datasets``), arrays in ``datasets/<id>.npy``; written as described in
NOTE [crash safety] in files.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ntk_service.errors import DatasetNotFound, EmptyBatch, InvalidInput, NonFiniteInput
from ntk_service.registry.database import DATABASE_FILENAME, Database
from ntk_service.registry.files import FileStore
from ntk_service.registry.records import DatasetRecord

__all__ = ["DATASET_DTYPES", "DatasetStore"]

logger = logging.getLogger(__name__)

DATASET_DTYPES = ("float32", "float64", "int64")
"""Float inputs for mlp/cnn/factory models, int64 token ids for transformers."""

_ID_PATTERN = re.compile(r"^ds_[0-9a-f]{24}$")
_MAX_NAME_LENGTH = 128
_HASH_CHUNK = 1 << 20


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _record_from_row(row: Any) -> DatasetRecord:
    return DatasetRecord(
        id=row[0],
        name=row[1],
        shape=tuple(json.loads(row[2])),
        dtype=row[3],
        sha256=row[4],
        size_bytes=row[5],
        created_at=datetime.fromisoformat(row[6]),
    )


def _checked_array(array: object, op: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise InvalidInput(f"{op}: expected a numpy array, got {type(array).__name__}")
    if array.dtype.name not in DATASET_DTYPES:
        raise InvalidInput(
            f"{op}: dtype {array.dtype} is not supported; expected one of {', '.join(DATASET_DTYPES)} "
            "(convert with array.astype(np.float32), or np.int64 for token ids)"
        )
    if array.ndim == 0:
        raise InvalidInput(f"{op}: expected an array of shape (N, *example_shape), got a scalar")
    if array.shape[0] == 0:
        raise EmptyBatch(f"{op}: the array has 0 rows (shape {array.shape}); upload at least one example")
    if 0 in array.shape:
        raise InvalidInput(f"{op}: shape {array.shape} has an empty dimension; every example must have values")
    if array.dtype.kind == "f" and not bool(np.isfinite(array).all()):
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise NonFiniteInput(f"{op}: the array holds {bad} NaN or inf values; upload finite values only")
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

    def create(self, array: np.ndarray, *, name: str | None = None) -> DatasetRecord:
        """Store an array as a new data set.

        Args:
            array (np.ndarray): (N, *example_shape), N >= 1, float32 / float64 (finite) or int64.
            name (str | None): optional label, at most 128 printable characters. Default: None.

        Returns:
            Its DatasetRecord (id ``ds_`` + 24 hex digits).

        Raises:
            InvalidInput: unsupported dtype, a scalar, an empty dimension, or a bad name.
            EmptyBatch: N = 0.
            NonFiniteInput: NaN or inf.
        """
        op = "create dataset"
        if name is not None and (
            not isinstance(name, str) or not 1 <= len(name) <= _MAX_NAME_LENGTH or not name.isprintable()
        ):
            raise InvalidInput(f"{op}: name must be 1-{_MAX_NAME_LENGTH} printable characters, got {name!r}")
        data = _checked_array(array, op)
        dataset_id = f"ds_{secrets.token_hex(12)}"

        def write(f: BinaryIO) -> None:
            np.save(f, data, allow_pickle=False)

        tmp = self._files.write_temp(write)
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
            try:
                with self._db.write() as conn:
                    self._files.publish(tmp, dataset_id)
                    self._insert_row(conn, record)
            except BaseException:
                self._files.remove(dataset_id)
                raise
        logger.info("stored dataset %s %s %s", dataset_id, record.shape, record.dtype)
        return record

    def get(self, dataset_id: str) -> DatasetRecord:
        """A data set's record.

        Raises:
            DatasetNotFound: no such id.
        """
        rows = self._db.query(
            "SELECT id, name, shape, dtype, sha256, size_bytes, created_at FROM datasets WHERE id = ?",
            (dataset_id,),
        )
        if not rows:
            hint = "" if _ID_PATTERN.fullmatch(str(dataset_id)) else " (ids look like ds_ + 24 hex digits)"
            raise DatasetNotFound(
                f"dataset {dataset_id!r} not found{hint}; list the stored data sets with GET /v1/datasets"
            )
        return _record_from_row(rows[0])

    def list(self) -> list[DatasetRecord]:
        """All data sets, oldest first."""
        rows = self._db.query(
            "SELECT id, name, shape, dtype, sha256, size_bytes, created_at FROM datasets ORDER BY created_at, id"
        )
        return [_record_from_row(r) for r in rows]

    def delete(self, dataset_id: str) -> None:
        """Delete a data set and its file.

        Raises:
            DatasetNotFound: no such id.
        """
        with self._db.write() as conn:
            if conn.execute("DELETE FROM datasets WHERE id = ?", (dataset_id,)).rowcount == 0:
                raise DatasetNotFound(f"delete dataset: dataset {dataset_id!r} not found")
        self._files.remove(dataset_id)
        logger.info("deleted dataset %s", dataset_id)

    def path(self, dataset_id: str) -> Path:
        """The stored .npy file (immutable; for streaming responses).

        Raises:
            DatasetNotFound: no such id.
        """
        return self._files.path(self.get(dataset_id).id)

    def load(self, dataset_id: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of a data set, read through a memory map (only those rows are read).

        Args:
            dataset_id (str): the id.
            start (int | None): first row, 0 <= start < stop. Default: 0.
            stop (int | None): one past the last row, stop <= N. Default: N.

        Returns:
            A new (stop - start, *example_shape) array of the data set's dtype.

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
        mapped = np.load(self._files.path(record.id), mmap_mode="r", allow_pickle=False)
        try:
            return np.array(mapped[lo:hi])
        finally:
            del mapped

    def close(self) -> None:
        """Close the database connections."""
        self._db.close()

    def _insert_row(self, conn: Any, record: DatasetRecord) -> None:
        conn.execute(
            "INSERT INTO datasets (id, name, shape, dtype, sha256, size_bytes, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                record.id,
                record.name,
                json.dumps(list(record.shape)),
                record.dtype,
                record.sha256,
                record.size_bytes,
                record.created_at.isoformat(),
            ),
        )

    def _sweep(self) -> None:
        with self._db.write() as conn:
            removed, _ = self._files.sweep({r[0] for r in conn.execute("SELECT id FROM datasets")})
        if removed:
            logger.info("removed %d data set files without a record", len(removed))
