"""DatasetStore with data sets of several named arrays, on a real SQLite file and real .npy files: round trips, row
ranges, the ids check, refusals, files named by the store, persistence, the sweep and the schema 2 -> 3 upgrade."""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from ntk_service.errors import DatasetNotFound, EmptyBatch, InvalidInput, NonFiniteInput
from ntk_service.registry import DatasetStore, NamedDatasetRecord
from ntk_service.registry.database import DATABASE_FILENAME, SCHEMA_VERSION


def _npy_sha256(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def _arrays(n: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "input_ids": rng.integers(0, 30, (n, 5)).astype(np.int64),
        "attention_mask": np.ones((n, 5), np.int64),
        "pixel_values": rng.standard_normal((n, 2, 3)).astype(np.float32),
    }


def test_named_round_trip_and_rows(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    arrays = _arrays()
    record = store.create(arrays, name="prompts")
    assert isinstance(record, NamedDatasetRecord)
    assert (record.shape, record.dtype, record.name, record.names) == ((6,), "mapping", "prompts", tuple(arrays))
    assert [(a.name, a.shape, a.dtype) for a in record.arrays] == [
        ("input_ids", (6, 5), "int64"),
        ("attention_mask", (6, 5), "int64"),
        ("pixel_values", (6, 2, 3), "float32"),
    ]
    assert [a.sha256 for a in record.arrays] == [_npy_sha256(a) for a in arrays.values()]
    # The files are named by position, never by the client's names.
    files = sorted(p.name for p in (tmp_path / "datasets").iterdir())
    assert files == [f"{record.id}-{i}.npy" for i in range(3)]
    assert record.size_bytes == sum((tmp_path / "datasets" / f).stat().st_size for f in files)
    whole = store.load(record.id)
    assert isinstance(whole, dict) and list(whole) == list(arrays)
    for name, array in arrays.items():
        assert whole[name].dtype == array.dtype and np.array_equal(whole[name], array)
    rows = store.load(record.id, 2, 5)
    assert isinstance(rows, dict) and all(np.array_equal(rows[k], v[2:5]) for k, v in arrays.items())
    with pytest.raises(InvalidInput, match=r"the data set has 6 rows, so use 0 <= start < stop <= 6"):
        store.load(record.id, 4, 7)
    public = record.to_public()
    assert public["shape"] == [6] and public["dtype"] == "mapping"
    assert public["arrays"][2] == {"name": "pixel_values", "shape": [6, 2, 3], "dtype": "float32"}
    assert json.loads(json.dumps(public)) == public
    with pytest.raises(InvalidInput, match="holds named arrays"):
        store.path(record.id)


def test_content_hash_names_the_arrays_and_their_names(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    arrays = _arrays()
    first, again = store.create(arrays), store.create(dict(arrays))
    assert first.sha256 == again.sha256 and first.id != again.id
    renamed = store.create({("token_ids" if k == "input_ids" else k): v for k, v in arrays.items()})
    changed = store.create({**arrays, "attention_mask": np.zeros((6, 5), np.int64)})
    assert len({first.sha256, renamed.sha256, changed.sha256}) == 3


def test_ids_check_finds_the_first_bad_row_in_chunks(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    ids = np.random.default_rng(1).integers(0, 10, (50, 4)).astype(np.int64)
    ids[37, 2] = 10
    ids[41, 0] = -1
    record = store.create({"input_ids": ids, "mask": np.ones((50, 4), np.int64)})
    for chunk in (1, 7, 4096):
        assert store.first_out_of_range(record.id, "input_ids", 10, 0, 50, chunk_rows=chunk) == (37, 10)
        assert store.first_out_of_range(record.id, "input_ids", 10, 38, 50, chunk_rows=chunk) == (41, -1)
        assert store.first_out_of_range(record.id, "input_ids", 11, 0, 41, chunk_rows=chunk) is None
    with pytest.raises(InvalidInput, match="has no named array 'ids'"):
        store.first_out_of_range(record.id, "ids", 10, 0, 50)


@pytest.mark.parametrize(
    ("arrays", "error", "fragment"),
    [
        ({}, InvalidInput, "got no arrays"),
        ({"../escape": np.zeros((2, 2), np.float32)}, InvalidInput, "array name '../escape' is not allowed"),
        ({"a/b": np.zeros((2, 2), np.float32)}, InvalidInput, "is not allowed"),
        ({"1st": np.zeros((2, 2), np.float32)}, InvalidInput, "is not allowed"),
        ({"naïve": np.zeros((2, 2), np.float32)}, InvalidInput, "ASCII identifier"),
        ({3: np.zeros((2, 2), np.float32)}, InvalidInput, "array name 3 is not allowed"),
        ({f"a{i}": np.zeros((1,), np.float32) for i in range(65)}, InvalidInput, "at most 64 fit"),
        (
            {"input_ids": np.zeros((3, 2), np.int64), "attention_mask": np.zeros((4, 2), np.int64)},
            InvalidInput,
            "same number of rows (N, dim 0), got 'input_ids': 3, 'attention_mask': 4",
        ),
        ({"ids": np.zeros((3, 2), np.uint8)}, InvalidInput, "array 'ids': dtype uint8 is not supported"),
        ({"x": np.zeros((0, 2), np.float32)}, EmptyBatch, "array 'x': the array has 0 rows"),
        ({"x": np.array([[np.nan]])}, NonFiniteInput, "array 'x': the array holds 1 NaN"),
        ({"x": [[1.0]]}, InvalidInput, "array 'x': expected a numpy array, got list"),
    ],
)
def test_bad_named_arrays_are_refused(tmp_path: Path, arrays: dict, error: type[Exception], fragment: str) -> None:
    store = DatasetStore(tmp_path)
    with pytest.raises(error) as info:
        store.create(arrays)
    assert fragment in str(info.value)
    assert store.list() == [] and list((tmp_path / "datasets").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["datasets", DATABASE_FILENAME, *_sqlite_sidecars(tmp_path)]
    )


def _sqlite_sidecars(tmp_path: Path) -> list[str]:
    return [p.name for p in tmp_path.iterdir() if p.name.startswith(DATABASE_FILENAME + "-")]


def test_persistence_delete_and_sweep(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    single = store.create(np.zeros((3, 2), np.float32))
    named = store.create(_arrays(4))
    store.close()
    (tmp_path / "datasets" / "ds_000000000000000000000000-0.npy").write_bytes(b"orphan")
    store = DatasetStore(tmp_path)  # the sweep keeps every file of both records, removes the orphan
    assert store.list() == [single, named] and isinstance(store.get(named.id), NamedDatasetRecord)
    names = sorted(p.name for p in (tmp_path / "datasets").iterdir())
    assert names == sorted([f"{single.id}.npy", *(f"{named.id}-{i}.npy" for i in range(3))])
    store.delete(named.id)
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [f"{single.id}.npy"]
    with pytest.raises(DatasetNotFound):
        store.load(named.id)
    assert np.array_equal(store.load(single.id), np.zeros((3, 2), np.float32))


def test_a_schema_2_data_dir_gains_the_arrays_column(tmp_path: Path) -> None:
    """A data directory of the previous release (schema 2, single arrays only) is upgraded in place; its rows load."""
    store = DatasetStore(tmp_path)
    old = store.create(np.arange(6, dtype=np.float64).reshape(3, 2))
    store.close()
    with sqlite3.connect(tmp_path / DATABASE_FILENAME) as conn:  # back to what schema 2 wrote
        conn.execute("ALTER TABLE datasets DROP COLUMN arrays")
        conn.execute("ALTER TABLE model_versions DROP COLUMN inputs")
        conn.execute("ALTER TABLE models DROP COLUMN paths")  # schema 4
        conn.execute("UPDATE schema_version SET version = 2")
    store = DatasetStore(tmp_path)
    assert store.get(old.id) == old and np.array_equal(store.load(old.id, 1, 3), np.arange(2, 6).reshape(2, 2))
    assert isinstance(store.create(_arrays(2)), NamedDatasetRecord)
    with sqlite3.connect(tmp_path / DATABASE_FILENAME) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
