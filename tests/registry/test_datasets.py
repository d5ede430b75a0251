"""DatasetStore on a real SQLite file and real .npy files: round trips, ranges, refusals, persistence."""

from __future__ import annotations

import hashlib
import io
from datetime import UTC
from pathlib import Path

import numpy as np
import pytest

from ntk_service.errors import DatasetNotFound, EmptyBatch, InvalidInput, NonFiniteInput
from ntk_service.registry import DatasetStore, ModelRegistry


def _npy_sha256(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


@pytest.mark.parametrize(
    "array",
    [
        np.random.default_rng(0).standard_normal((7, 3)).astype(np.float32),
        np.random.default_rng(1).standard_normal((4, 2, 3, 3)),
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.array([1.5, -2.0], dtype=np.float32),
    ],
)
def test_round_trip(tmp_path: Path, array: np.ndarray) -> None:
    store = DatasetStore(tmp_path)
    record = store.create(array, name="train")
    assert record.id.startswith("ds_") and len(record.id) == 27
    assert (record.name, record.shape, record.dtype) == ("train", array.shape, array.dtype.name)
    assert record.sha256 == _npy_sha256(array)
    path = store.path(record.id)
    assert record.size_bytes == path.stat().st_size and hashlib.sha256(path.read_bytes()).hexdigest() == record.sha256
    loaded = store.load(record.id)
    assert loaded.dtype == array.dtype and np.array_equal(loaded, array)
    assert record.created_at.tzinfo == UTC
    public = record.to_public()
    assert public["shape"] == list(array.shape) and set(public) == {
        "id",
        "name",
        "shape",
        "dtype",
        "sha256",
        "size_bytes",
        "created_at",
    }


def test_row_ranges(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    array = np.arange(20, dtype=np.float64).reshape(10, 2)
    dataset_id = store.create(array).id
    assert np.array_equal(store.load(dataset_id, 2, 5), array[2:5])
    assert np.array_equal(store.load(dataset_id, start=7), array[7:])
    assert np.array_equal(store.load(dataset_id, stop=1), array[:1])
    out = store.load(dataset_id, 0, 10)
    out[0, 0] = 99.0  # a copy: writing to it changes nothing stored
    assert store.load(dataset_id, 0, 1)[0, 0] == 0.0
    for start, stop in [(5, 5), (6, 2), (-1, 3), (0, 11), (10, None), (True, 3)]:
        with pytest.raises(InvalidInput, match=r"the data set has 10 rows, so use 0 <= start < stop <= 10"):
            store.load(dataset_id, start, stop)


@pytest.mark.parametrize(
    ("array", "error", "fragment"),
    [
        (np.zeros((3, 2), dtype=np.uint8), InvalidInput, "dtype uint8 is not supported; expected one of float32"),
        (np.zeros((3, 2), dtype=np.float16), InvalidInput, "astype(np.float32)"),
        (np.array(1.0), InvalidInput, "got a scalar"),
        (np.zeros((0, 3), dtype=np.float32), EmptyBatch, "0 rows"),
        (np.zeros((2, 0), dtype=np.float32), InvalidInput, "empty dimension"),
        (np.array([[1.0, np.nan], [np.inf, 0.0]]), NonFiniteInput, "2 NaN or inf values"),
        ([[1.0, 2.0]], InvalidInput, "expected a numpy array, got list"),
    ],
)
def test_bad_arrays_are_refused(tmp_path: Path, array: object, error: type[Exception], fragment: str) -> None:
    store = DatasetStore(tmp_path)
    with pytest.raises(error) as info:
        store.create(array)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    assert store.list() == [] and list((tmp_path / "datasets").iterdir()) == []


def test_bad_names_are_refused(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    for name in ["", "x" * 129, "a\nb"]:
        with pytest.raises(InvalidInput, match="name must be 1-128 printable characters"):
            store.create(np.zeros((1, 1), np.float32), name=name)


def test_big_endian_input_is_stored_native(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    array = np.arange(6, dtype=">f4").reshape(3, 2)
    record = store.create(array)
    assert record.dtype == "float32"
    loaded = store.load(record.id)
    assert loaded.dtype == np.dtype("float32") and loaded.dtype.byteorder in "=<" and np.array_equal(loaded, array)


def test_persistence_list_delete(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    first = store.create(np.ones((2, 2), np.float32), name="a")
    second = store.create(np.zeros((3,), np.int64))
    store.close()
    models = ModelRegistry(tmp_path)  # shares the database file
    models.register("m", {"family": "mlp", "input_dim": 2, "hidden": [], "output_dim": 1})
    store = DatasetStore(tmp_path)
    assert store.list() == [first, second] and store.get(first.id) == first
    assert np.array_equal(store.load(second.id), np.zeros(3, np.int64))
    store.delete(first.id)
    assert store.list() == [second] and not (tmp_path / "datasets" / f"{first.id}.npy").exists()
    with pytest.raises(DatasetNotFound, match=f"dataset '{first.id}' not found"):
        store.get(first.id)
    with pytest.raises(DatasetNotFound, match="not found"):
        store.load(first.id, 0, 1)
    with pytest.raises(DatasetNotFound, match=r"ids look like ds_ \+ 24 hex digits"):
        store.get("../registry.sqlite3")
    with pytest.raises(DatasetNotFound):
        store.delete(first.id)
    assert [r.name for r in models.list()] == ["m"]


def test_orphan_files_are_swept_at_startup(tmp_path: Path) -> None:
    store = DatasetStore(tmp_path)
    kept = store.create(np.ones((2, 2), np.float32))
    orphan = tmp_path / "datasets" / "ds_000000000000000000000000.npy"  # a crash between rename and commit
    np.save(orphan, np.zeros(1))
    DatasetStore(tmp_path)
    assert sorted(p.name for p in (tmp_path / "datasets").iterdir()) == [f"{kept.id}.npy"]
