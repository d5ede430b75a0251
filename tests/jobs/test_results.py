"""The Zarr result array: one chunk per tile, attributes, slices, exact mirroring of symmetric jobs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import GzipCodec

from ntk_service.errors import InvalidInput
from ntk_service.jobs.planner import plan_tiles
from ntk_service.jobs.results import (
    FORMAT_VERSION,
    ResultArray,
    _consolidate,
    migrate_legacy,
    mirror_theta,
    parse_range,
)
from ntk_service.kernels import KernelMode

MODES = [KernelMode.FULL, KernelMode.TRACE, KernelMode.OUTPUT_DIAGONAL]


def _symmetric_kernel(mode: KernelMode, n: int, k: int) -> np.ndarray:
    # A random Gram matrix J Jᵀ of the mode's shape: symmetric in the sense of NOTE [symmetric reads].
    j = np.random.default_rng(1).standard_normal((n, k, 5))
    full = np.einsum("naf,mbf->nmab", j, j)
    if mode is KernelMode.FULL:
        return full
    diag = np.einsum("nmaa->nma", full)
    return diag.sum(-1) if mode is KernelMode.TRACE else diag


@pytest.mark.parametrize("mode", MODES)
def test_symmetric_job_stores_upper_tiles_and_reads_the_exact_mirror(tmp_path: Path, mode: KernelMode) -> None:
    n, k = 10, 2
    plan = plan_tiles(n=n, m=None, tile_size=4, mode=mode)
    theta = _symmetric_kernel(mode, n, k)
    array = ResultArray.create(tmp_path / "a.zarr", plan=plan, k=k, dtype="float64", attributes={"model": "m"})
    for tile in plan.tiles:
        array.write_tile(tile, theta[tile.rows[0] : tile.rows[1], tile.cols[0] : tile.cols[1]])
    chunks = sorted(
        p.relative_to(tmp_path / "a.zarr" / "theta" / "c")
        for p in (tmp_path / "a.zarr" / "theta" / "c").rglob("*")
        if p.is_file()
    )
    assert len(chunks) == len(plan.tiles) == 6  # the lower triangle is never written
    reopened = ResultArray.open(tmp_path / "a.zarr", plan=plan)
    whole = reopened.read()
    np.testing.assert_array_equal(whole, theta)
    np.testing.assert_array_equal(whole, mirror_theta(whole, mode))  # exactly symmetric
    np.testing.assert_array_equal(reopened.read(rows=(5, 10), cols=(1, 6)), theta[5:10, 1:6])
    np.testing.assert_array_equal(reopened.read(rows=(9, 10), cols=(0, 1)), theta[9:10, 0:1])
    assert reopened.attributes["model"] == "m" and reopened.attributes["format_version"] == FORMAT_VERSION
    assert reopened.done_tile_ids() == {t.id for t in plan.tiles}


def test_diagonal_tiles_are_made_exactly_symmetric(tmp_path: Path) -> None:
    plan = plan_tiles(n=3, m=None, tile_size=3, mode=KernelMode.FULL)
    block = np.random.default_rng(2).standard_normal((3, 3, 2, 2))  # not symmetric at all
    array = ResultArray.create(tmp_path / "a.zarr", plan=plan, k=2, dtype="float64", attributes={})
    array.write_tile(plan.tiles[0], block)
    stored = array.read()
    np.testing.assert_array_equal(stored, mirror_theta(stored, KernelMode.FULL))
    upper = np.triu(np.ones((6, 6), dtype=bool))
    as_matrix = stored.transpose(0, 2, 1, 3).reshape(6, 6)
    np.testing.assert_array_equal(as_matrix[upper], block.transpose(0, 2, 1, 3).reshape(6, 6)[upper])


def test_rectangular_job_reads_slices(tmp_path: Path) -> None:
    plan = plan_tiles(n=10, m=7, tile_size=4, mode=KernelMode.OUTPUT_DIAGONAL)
    theta = np.random.default_rng(3).standard_normal((10, 7, 3)).astype(np.float32)
    array = ResultArray.create(tmp_path / "a.zarr", plan=plan, k=3, dtype="float32", attributes={})
    for tile in plan.tiles:
        array.write_tile(tile, theta[tile.rows[0] : tile.rows[1], tile.cols[0] : tile.cols[1]])
    np.testing.assert_array_equal(array.read(), theta)
    np.testing.assert_array_equal(array.read(rows=(3, 9), cols=(2, 5)), theta[3:9, 2:5])
    theta = zarr.open_group(str(tmp_path / "a.zarr"))["theta"]
    assert theta.chunks == (4, 4, 3) and theta.metadata.dimension_names == ("x1", "x2", "out")


def test_example_diagonal_has_no_columns(tmp_path: Path) -> None:
    plan = plan_tiles(n=5, m=None, tile_size=2, mode=KernelMode.EXAMPLE_DIAGONAL)
    array = ResultArray.create(tmp_path / "a.zarr", plan=plan, k=2, dtype="float32", attributes={})
    with pytest.raises(InvalidInput, match="no column axis"):
        array.read(cols=(0, 1))


def test_parse_range() -> None:
    assert parse_range(None, 10, axis="rows") == (0, 10)
    assert parse_range("2:5", 10, axis="rows") == (2, 5)
    assert parse_range(":3", 10, axis="rows") == (0, 3)
    assert parse_range("7:", 10, axis="cols") == (7, 10)
    with pytest.raises(InvalidInput, match=r"cols='a:b' is not a range 'a:b' of integers"):
        parse_range("a:b", 10, axis="cols")
    with pytest.raises(InvalidInput, match=r"expected 0 ≤ a < b ≤ 10"):
        parse_range("5:11", 10, axis="rows")
    with pytest.raises(InvalidInput, match="not a range"):
        parse_range("5", 10, axis="rows")


def _legacy_job(job_dir: Path, theta: np.ndarray) -> None:
    """A result as versions before the result group stored it: a bare array <job>/theta.zarr."""
    legacy = zarr.create_array(
        store=str(job_dir / "theta.zarr"),
        shape=theta.shape,
        chunks=(4, 4),
        dtype="float64",
        fill_value=0,
        compressors=None,
        attributes={"model": "m", "implementation_used": ["structured"]},
    )
    legacy[...] = theta


@pytest.mark.parametrize("cut_off", ["after the rename", "before the consolidated metadata"])
def test_a_migration_cut_off_anywhere_is_finished_by_the_next_and_is_idempotent(tmp_path: Path, cut_off: str) -> None:
    plan = plan_tiles(n=10, m=None, tile_size=4, mode=KernelMode.TRACE)
    theta = np.triu(_symmetric_kernel(KernelMode.TRACE, 10, 2))  # stored: the upper tiles (here: more zeros)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    _legacy_job(job_dir, theta)
    done = {t.id for t in plan.tiles}
    group_path = job_dir / "result.zarr"
    if cut_off == "after the rename":
        zarr.open_group(str(group_path), mode="w", attributes={"legacy_attributes": {"model": "m"}})
        (job_dir / "theta.zarr").rename(group_path / "theta")
    else:
        assert migrate_legacy(job_dir, plan=plan, k=2, done_tile_ids=done, attributes={"job_id": "j"})
        metadata = json.loads((group_path / "zarr.json").read_text())
        metadata.pop("consolidated_metadata")
        (group_path / "zarr.json").write_text(json.dumps(metadata))
    assert migrate_legacy(job_dir, plan=plan, k=2, done_tile_ids=done, attributes={"job_id": "j"})
    assert not migrate_legacy(job_dir, plan=plan, k=2, done_tile_ids=done, attributes={"job_id": "j"})
    metadata = json.loads((group_path / "zarr.json").read_text())
    assert metadata["consolidated_metadata"]["metadata"]["theta"]["dimension_names"] == ["x1", "x2"]
    attributes = metadata["attributes"]
    assert attributes["format_version"] == FORMAT_VERSION and attributes["model"] == "m"
    assert attributes["migrated_from"] == "theta.zarr" and "legacy_attributes" not in attributes
    array = ResultArray.open(group_path, writable=False)
    assert array.done_tile_ids() == done
    np.testing.assert_array_equal(array.read()[np.triu_indices(10)], theta[np.triu_indices(10)])


def _chunk_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("mode", "m", "dtype"),
    [
        (KernelMode.FULL, 7, "float64"),
        (KernelMode.TRACE, 7, "float32"),
        (KernelMode.OUTPUT_DIAGONAL, 7, "float32"),
        (KernelMode.EXAMPLE_DIAGONAL, None, "float64"),
    ],
)
def test_raw_chunk_files_are_the_bytes_zarr_itself_writes(
    tmp_path: Path, mode: KernelMode, m: int | None, dtype: str
) -> None:
    # NOTE [raw chunk writes]: the reference is zarr-python writing the same blocks into an array of the same
    # layout; edge tiles (10 = 4 + 4 + 2 rows, 7 = 4 + 3 columns) are padded as Zarr pads them.
    n, k = 10, 2
    plan = plan_tiles(n=n, m=m, tile_size=4, mode=mode)
    shape = plan.result_shape(k)
    theta = np.random.default_rng(4).standard_normal(shape).astype(dtype)
    if mode is KernelMode.EXAMPLE_DIAGONAL:
        theta = theta + mirror_theta(theta, mode)  # exactly symmetric, as its (diagonal) tiles are stored
    array = ResultArray.create(tmp_path / "a.zarr", plan=plan, k=k, dtype=dtype, attributes={})
    reference = zarr.create_array(
        str(tmp_path / "ref.zarr"), shape=shape, chunks=array._array.chunks, dtype=dtype, fill_value=0, compressors=None
    )
    for tile in plan.tiles:
        index = (slice(*tile.rows),) if mode is KernelMode.EXAMPLE_DIAGONAL else (slice(*tile.rows), slice(*tile.cols))
        array.write_tile(tile, theta[index])
        reference[index] = theta[index]
    written = _chunk_bytes(tmp_path / "a.zarr" / "theta" / "c")
    assert written == _chunk_bytes(tmp_path / "ref.zarr" / "c") and len(written) == len(plan.tiles)
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "a.zarr" / "theta"), mode="r")[...], theta)
    ledger = zarr.open_array(str(tmp_path / "a.zarr" / "tiles" / "done"), mode="r")[...]
    np.testing.assert_array_equal(ledger, np.ones(len(plan.tiles), dtype=np.uint8))
    assert not list((tmp_path / "a.zarr").rglob("*.partial"))


def test_a_rewritten_chunk_keeps_its_full_size_and_holds_the_new_bytes(tmp_path: Path) -> None:
    plan = plan_tiles(n=4, m=4, tile_size=4, mode=KernelMode.TRACE)
    array = ResultArray.create(tmp_path / "a.zarr", plan=plan, k=1, dtype="float32", attributes={})
    rng = np.random.default_rng(5)
    first, second = rng.standard_normal((2, 4, 4)).astype(np.float32)
    array.write_tile(plan.tiles[0], first)
    chunk = tmp_path / "a.zarr" / "theta" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes() + b"longer than a chunk")  # a rewrite must not leave old bytes beyond it
    array.write_tile(plan.tiles[0], second)
    assert chunk.stat().st_size == 4 * 4 * 4 + len(b"longer than a chunk")
    chunk.write_bytes(chunk.read_bytes()[:64])
    np.testing.assert_array_equal(ResultArray.open(tmp_path / "a.zarr").read(), second)


def test_an_array_with_a_compressor_is_written_through_zarr(tmp_path: Path) -> None:
    # A layout ResultArray does not write itself (here: gzip-compressed chunks) goes through Zarr, and reads back.
    plan = plan_tiles(n=8, m=8, tile_size=4, mode=KernelMode.TRACE)
    ResultArray.create(tmp_path / "a.zarr", plan=plan, k=1, dtype="float64", attributes={})
    group = zarr.open_group(str(tmp_path / "a.zarr"), mode="r+")
    group.create_array(
        "theta", shape=(8, 8), chunks=(4, 4), dtype="float64", fill_value=0, compressors=GzipCodec(), overwrite=True
    )
    _consolidate(tmp_path / "a.zarr")  # what ResultArray.open reads the layout from
    theta = np.random.default_rng(6).standard_normal((8, 8))
    array = ResultArray.open(tmp_path / "a.zarr", plan=plan)
    for tile in plan.tiles:
        array.write_tile(tile, theta[slice(*tile.rows), slice(*tile.cols)])
    assert (tmp_path / "a.zarr" / "theta" / "c" / "0" / "0").read_bytes()[:2] == b"\x1f\x8b"  # gzip's magic
    np.testing.assert_array_equal(ResultArray.open(tmp_path / "a.zarr").read(), theta)
    assert array.done_tile_ids() == {t.id for t in plan.tiles}
