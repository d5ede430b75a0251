"""JobManager with the local executor: results against the float64 reference and against direct compute_ntk calls
on the same tiles (bitwise), cancellation, resume, disk budget, validation at submission, progress events."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import xarray as xr
import zarr

from ntk_service.errors import (
    Conflict,
    DatasetNotFound,
    DiskEstimateExceeded,
    InvalidInput,
    JobNotFinished,
    JobNotFound,
    ModelNotFound,
    NoMatchingParameters,
    ResultNotFound,
    ShapeMismatch,
    UnknownMode,
)
from ntk_service.jobs import JobManager, JobStatus, LocalExecutor
from ntk_service.jobs import manager as manager_module
from ntk_service.jobs.manager import Deletion, DiskUsage, plan_of
from ntk_service.jobs.panels import plan_panels
from ntk_service.jobs.results import ResultArray, mirror_theta, symmetrize_tile
from ntk_service.kernels import KernelMode, compute_ntk
from ntk_service.results import open_result
from tests.jobs.conftest import JobsEnv, wait_finished
from tests.reference import reference_ntk

CASES = [(mode.value, symmetric) for mode in KernelMode for symmetric in (True, False)[: 2 if mode.spec.pairs else 1]]
"""Every contracted mode, read off the table: x2 = x1 and x2 given for the modes of example pairs."""


@pytest.mark.parametrize(("mode", "symmetric"), CASES)
def test_job_equals_reference_and_each_tile_equals_compute_ntk_bitwise(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager], mode: str, symmetric: bool
) -> None:
    manager = make_manager()
    x2_id = None if symmetric else jobs_env.x2_id
    job = manager.submit(
        model="tiny", x1_dataset=jobs_env.x1_id, x2_dataset=x2_id, mode=mode, dtype="float64", tile_size=4
    )
    record = wait_finished(manager, job.id)
    assert record.status is JobStatus.SUCCEEDED, record.error
    theta = manager.read_result(job.id)
    _, model = jobs_env.registry.load_module("tiny")
    x1 = torch.from_numpy(jobs_env.x1)
    x2 = None if symmetric else torch.from_numpy(jobs_env.x2)
    expected = reference_ntk(model, x1, x2, mode=mode).numpy()
    assert theta.shape == expected.shape == tuple(record.result_shape)
    np.testing.assert_allclose(theta, expected, rtol=1e-10, atol=1e-12)
    kernel_mode = KernelMode(mode)
    if symmetric and kernel_mode.spec.pairs:
        np.testing.assert_array_equal(theta, mirror_theta(theta, kernel_mode))
    plan = plan_of(record.spec)
    panels = plan_panels(plan, panel_tiles=record.spec.panel_tiles)
    assert sorted(t.id for p in panels for t in p.tiles) == sorted(t.id for t in plan.tiles)  # each tile once
    for panel in panels:  # the same panel computations as a direct call: the same bits, in every tile
        (r0, r1), (c0, c1) = panel.rows, panel.cols
        right = None if panel.is_diagonal else (x1 if x2 is None else x2)[c0:c1]
        direct = compute_ntk(
            model, x1[r0:r1], right, mode=mode, dtype="float64", memory_budget_bytes=record.spec.memory_budget_bytes
        ).theta.numpy()
        for tile in panel.tiles:
            (tr0, tr1), (tc0, tc1) = tile.rows, tile.cols
            got = theta[tr0:tr1, tc0:tc1] if kernel_mode.spec.pairs else theta[tr0:tr1]
            block = panel.block_of(tile, direct, kernel_mode)
            if tile.is_diagonal and kernel_mode.spec.pairs:
                block = symmetrize_tile(block, kernel_mode)  # a no-op on x2=None blocks (NOTE [symmetric reads])
            np.testing.assert_array_equal(got, block)
    assert set(manager.store.tile_attempts(job.id).values()) == {1}
    assert record.tiles_done == record.tiles_total == len(plan.tiles)
    assert manager.eta_s(record) == 0.0


def test_result_attributes_and_implementation_used(jobs_env: JobsEnv, make_manager: Callable[..., JobManager]) -> None:
    shared = jobs_env.data_dir / "shared-results"
    manager = make_manager(results_dir=shared)
    job = manager.submit(
        model="tiny",
        x1_dataset=jobs_env.x1_id,
        x2_dataset=jobs_env.x2_id,
        mode="trace",
        implementation="ntk_vector_products",
        tile_size=5,
    )
    record = wait_finished(manager, job.id)
    assert record.implementation_used == "ntk_vector_products"
    _, array = manager.open_result(job.id)
    attrs = array.attributes
    assert attrs["model"] == "tiny" and attrs["version"] == 1
    assert attrs["x1_sha256"] == jobs_env.datasets.get(jobs_env.x1_id).sha256
    assert attrs["x2_sha256"] == jobs_env.datasets.get(jobs_env.x2_id).sha256
    assert (attrs["mode"], attrs["implementation"], attrs["dtype"]) == ("trace", "ntk_vector_products", "float32")
    assert attrs["implementation_used"] == ["ntk_vector_products"]
    assert array.read().dtype == np.float32
    assert array.path == shared.absolute() / job.id / "result.zarr"  # SQLite stays in <data_dir>/jobs
    assert (jobs_env.data_dir / "jobs" / "jobs.sqlite3").exists() and not (shared / "jobs.sqlite3").exists()


class _Gate:
    """A run_compute that lets ``free`` tiles through, then blocks the next one until ``release``."""

    def __init__(self, free: int) -> None:
        self.free, self.calls = free, 0
        self.blocked, self.go = threading.Event(), threading.Event()

    def __call__(self, fn: Callable[[], Any]) -> Any:
        self.calls += 1
        if self.calls > self.free:
            self.blocked.set()
            self.go.wait(30)
        return fn()


def test_cancel_stops_at_the_tile_boundary(jobs_env: JobsEnv, make_manager: Callable[..., JobManager]) -> None:
    gate = _Gate(free=2)
    manager = make_manager(LocalExecutor(run_compute=gate))
    job = manager.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="full", tile_size=2, panel_tiles=1)  # 21 tiles
    assert gate.blocked.wait(30)
    cancelled = manager.cancel(job.id)
    assert cancelled.status is JobStatus.CANCELLED
    gate.go.set()  # the running tile finishes and is kept; no further tile starts
    manager.stop()
    record = manager.get(job.id)
    assert record.status is JobStatus.CANCELLED and record.finished_at is not None
    assert record.tiles_done == 3 < record.tiles_total == 21
    assert sum(manager.store.tile_attempts(job.id).values()) == 3
    with pytest.raises(JobNotFinished, match="is cancelled"):
        manager.read_result(job.id)
    assert manager.cancel(job.id).status is JobStatus.CANCELLED  # idempotent


def test_resume_computes_only_missing_tiles_and_matches_an_uninterrupted_run(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    gate = _Gate(free=4)
    first = make_manager(LocalExecutor(run_compute=gate))
    job = first.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="full", tile_size=3, panel_tiles=1)  # 10 tiles
    assert gate.blocked.wait(30)
    stopper = threading.Thread(target=first.stop)
    stopper.start()
    gate.go.set()
    stopper.join(30)
    interrupted = first.get(job.id)
    assert interrupted.status is JobStatus.RUNNING and interrupted.tiles_done == 5
    second = make_manager()  # a new process would do the same: start() resumes unfinished jobs
    resumed = wait_finished(second, job.id)
    assert resumed.status is JobStatus.SUCCEEDED
    assert set(second.store.tile_attempts(job.id).values()) == {1}  # nothing computed twice
    again = second.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="full", tile_size=3, panel_tiles=1)
    wait_finished(second, again.id)
    np.testing.assert_array_equal(second.read_result(job.id), second.read_result(again.id))


def test_a_stop_that_gives_up_on_a_panel_counts_no_attempt_for_it(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    gate = _Gate(free=4)
    first = make_manager(LocalExecutor(run_compute=gate))
    job = first.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", tile_size=3, panel_tiles=1)  # 10 tiles
    assert gate.blocked.wait(30)
    runner = next(t for t in first._runner.threads if t.name == "ntk-kernel-jobs")  # the kernel jobs' runner thread
    first.stop(timeout=0.2)  # the fifth panel is still blocked: stop gives up on it
    assert runner.is_alive()
    attempts = first.store.tile_attempts(job.id)
    assert first.get(job.id).tiles_done == 4 and sorted(attempts.values()) == [0] * 6 + [1] * 4
    second = make_manager()  # the next start
    assert wait_finished(second, job.id).status is JobStatus.SUCCEEDED
    gate.go.set()  # the given-up panel finishes now: it writes the same bits and records nothing
    runner.join(30)
    assert not runner.is_alive()
    assert set(second.store.tile_attempts(job.id).values()) == {1}  # each tile computed once on record
    _, model = jobs_env.registry.load_module("tiny")
    expected = reference_ntk(model, torch.from_numpy(jobs_env.x1), mode="trace").numpy()
    np.testing.assert_allclose(second.read_result(job.id), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("workers", [1, 2])
def test_every_tile_recorded_done_is_on_disk_when_it_is_recorded(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager], workers: int
) -> None:
    manager = make_manager(LocalExecutor(workers=workers))
    _, model = jobs_env.registry.load_module("tiny")
    expected = reference_ntk(model, torch.from_numpy(jobs_env.x1), mode="trace").numpy()
    record_done = manager.store.mark_tiles_done
    seen: list[int] = []

    def checked(job_id: str, tile_ids: Any, *, elapsed_s: float) -> None:
        # At the instant of recording, a separate reader sees each tile's chunk and ledger entry on disk.
        spec = manager.get(job_id).spec
        on_disk = ResultArray.open(jobs_env.data_dir / "jobs" / job_id / "result.zarr", writable=False)
        assert set(tile_ids) <= on_disk.done_tile_ids()
        for tile in (t for t in plan_of(spec).tiles if t.id in tile_ids):
            (r0, r1), (c0, c1) = tile.rows, tile.cols
            got = on_disk.read(rows=tile.rows, cols=tile.cols)
            np.testing.assert_allclose(got, expected[r0:r1, c0:c1], rtol=1e-10, atol=1e-12)
        seen.extend(tile_ids)
        record_done(job_id, tile_ids, elapsed_s=elapsed_s)

    manager.store.mark_tiles_done = checked  # type: ignore[method-assign]
    job = manager.submit(
        model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", dtype="float64", tile_size=2, panel_tiles=2
    )  # 6 row blocks: 21 tiles in 6 panels
    record = wait_finished(manager, job.id)
    assert record.status is JobStatus.SUCCEEDED, record.error
    assert sorted(seen) == sorted(t.id for t in plan_of(record.spec).tiles)  # every tile checked, once
    assert set(manager.store.tile_attempts(job.id).values()) == {1}


def test_two_workers_give_the_same_bits(jobs_env: JobsEnv, make_manager: Callable[..., JobManager]) -> None:
    one = make_manager()
    options: dict[str, Any] = {"x2_dataset": jobs_env.x2_id, "mode": "full", "tile_size": 2, "panel_tiles": 2}
    a = one.submit(model="tiny", x1_dataset=jobs_env.x1_id, **options)
    wait_finished(one, a.id)
    one.stop()
    two = make_manager(LocalExecutor(workers=2))
    b = two.submit(model="tiny", x1_dataset=jobs_env.x1_id, **options)
    assert wait_finished(two, b.id).status is JobStatus.SUCCEEDED
    np.testing.assert_array_equal(two.read_result(a.id), two.read_result(b.id))


def test_disk_budget_refuses_up_front_with_the_estimate(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    manager = make_manager(disk_budget_bytes=1000)
    with pytest.raises(DiskEstimateExceeded, match=r"needs 2\.71 KiB on disk") as info:
        manager.submit(model="tiny", x1_dataset=jobs_env.x1_id, x2_dataset=jobs_env.x2_id, mode="full")
    assert (info.value.estimate_bytes, info.value.budget_bytes) == (11 * 7 * 9 * 4, 1000)
    assert manager.list() == []


def test_free_space_budget_counts_what_unfinished_jobs_will_write(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk's free space is the one thing a test cannot set, so it is pinned here: 10 000 bytes free.
    monkeypatch.setattr("ntk_service.jobs.disk.shutil.disk_usage", lambda _: SimpleNamespace(free=10_000))
    manager = make_manager(start=False)  # jobs stay queued: none of their tiles is written yet
    options = {"model": "tiny", "x1_dataset": jobs_env.x1_id, "x2_dataset": jobs_env.x2_id, "mode": "full"}
    first = manager.submit(**options)  # 11 * 7 * 9 * 4 = 2772 bytes of 9000 allowed
    assert first.estimate_bytes == 2772
    manager.submit(**options)
    manager.submit(**options)
    with pytest.raises(DiskEstimateExceeded, match="less 8.12 KiB that unfinished jobs will still write"):
        manager.submit(**options)  # 4 * 2772 > 9000


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"mode": "diag"}, UnknownMode, "unknown mode 'diag'"),
        ({"dtype": "float16"}, InvalidInput, "dtype 'float16' is not supported"),
        ({"params": ["nope.*"]}, NoMatchingParameters, "nope"),
        ({"model": "missing"}, ModelNotFound, "missing"),
        ({"x1_dataset": "ds_000000000000000000000000"}, DatasetNotFound, "ds_0000"),
        ({"mode": "example_diagonal", "x2_dataset": "X2"}, InvalidInput, "uses no x2"),
        ({"tile_size": 0}, InvalidInput, "tile_size must be ≥ 1"),
    ],
)
def test_bad_jobs_are_refused_at_submission(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager], options: dict[str, Any], error: type, match: str
) -> None:
    manager = make_manager()
    args: dict[str, Any] = {"model": "tiny", "x1_dataset": jobs_env.x1_id, **options}
    if args.get("x2_dataset") == "X2":
        args["x2_dataset"] = jobs_env.x2_id
    with pytest.raises(error, match=match):
        manager.submit(**args)
    assert manager.list() == []


def test_x2_with_other_example_shape_is_refused(jobs_env: JobsEnv, make_manager: Callable[..., JobManager]) -> None:
    other = jobs_env.datasets.create(np.zeros((3, 5), dtype=np.float32)).id
    with pytest.raises(ShapeMismatch, match=r"examples of shape \(5,\).*has \(4,\)"):
        make_manager().submit(model="tiny", x1_dataset=jobs_env.x1_id, x2_dataset=other)


def test_a_failing_tile_fails_the_job_with_its_message(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    architecture = {
        "family": "transformer",
        "vocab_size": 5,
        "max_len": 3,
        "d_model": 4,
        "n_heads": 1,
        "n_layers": 1,
        "d_ff": 4,
        "output_dim": 2,
    }
    jobs_env.registry.register("tokens", architecture, seed=0)
    tokens = np.random.default_rng(0).integers(0, 5, size=(10, 3))
    tokens[9, 1] = 7  # outside the vocabulary: the first example is fine, so the job is accepted; row 9 fails
    dataset = jobs_env.datasets.create(tokens).id
    manager = make_manager()
    job = manager.submit(model="tokens", x1_dataset=dataset, mode="trace", tile_size=4)
    record = wait_finished(manager, job.id)
    assert record.status is JobStatus.FAILED, record
    assert "index out of range" in (record.error or ""), record.error
    assert record.tiles_done < record.tiles_total
    attempts, done = manager.store.tile_attempts(job.id), manager.store.done_tile_ids(job.id)
    failed = {t for t, n in attempts.items() if n and t not in done}
    assert failed and all(attempts[t] == 1 for t in failed)  # the failure consumed the failing panel's attempt
    assert all(attempts[t] == 1 for t in done)
    with pytest.raises(JobNotFinished, match="is failed") as info:
        manager.read_result(job.id)
    assert "index out of range" in info.value.message


def test_progress_events_advance_until_the_job_ends(jobs_env: JobsEnv, make_manager: Callable[..., JobManager]) -> None:
    manager = make_manager(start=False)
    job = manager.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", tile_size=3)
    seen = manager.version(job.id)
    assert manager.wait_for_change(job.id, seen, timeout=0.05) == seen  # queued, nothing runs yet
    manager.start()
    progress = []
    while not manager.get(job.id).is_finished:
        seen = manager.wait_for_change(job.id, seen, timeout=5)
        progress.append(manager.get(job.id).tiles_done)
    assert progress == sorted(progress) and progress[-1] == 10
    assert manager.get(job.id).status is JobStatus.SUCCEEDED


def test_a_result_of_the_old_format_is_migrated_in_place_and_keeps_working(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    first = make_manager()
    job = first.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="full", dtype="float64", tile_size=4)
    assert wait_finished(first, job.id).status is JobStatus.SUCCEEDED
    expected = first.read_result(job.id)
    first.stop()
    # Rewrite the result as the previous version stored it: a bare array <job>/theta.zarr, upper tiles only.
    job_dir = jobs_env.data_dir / "jobs" / job.id
    group = zarr.open_group(str(job_dir / "result.zarr"), mode="r")
    stored, old_attrs = group["theta"][...], {"model": "tiny", "mode": "full", "implementation_used": ["structured"]}
    legacy = zarr.create_array(
        store=str(job_dir / "theta.zarr"),
        shape=stored.shape,
        chunks=(4, 4, 3, 3),
        dtype="float64",
        fill_value=0,
        compressors=None,
        attributes=old_attrs,
    )
    legacy[...] = stored
    shutil.rmtree(job_dir / "result.zarr")
    with pytest.raises(InvalidInput, match="older ntk-service"):
        open_result(job_dir)
    second = make_manager()  # start() migrates
    assert not (job_dir / "theta.zarr").exists()
    np.testing.assert_array_equal(second.read_result(job.id), expected)
    view = open_result(job_dir)
    np.testing.assert_array_equal(view.to_numpy(), expected)
    assert view.attrs["implementation_used"] == ["structured"] and view.attrs["migrated_from"] == "theta.zarr"
    assert xr.open_zarr(job_dir / "result.zarr")["theta"].dims == ("x1", "x2", "out1", "out2")
    assert second.delete(job.id).freed_bytes > 0 and not job_dir.exists()


def test_delete_refuses_unfinished_jobs_and_results_being_read(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    manager = make_manager(start=False, disk_budget_bytes=10_000)
    job = manager.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", tile_size=4)  # queued
    assert manager.disk_usage() == DiskUsage(
        used_bytes=job.estimate_bytes, budget_bytes=10_000, available_bytes=10_000 - job.estimate_bytes
    )
    with pytest.raises(Conflict, match="is queued; cancel it first"):
        manager.delete(job.id)
    manager.start()
    wait_finished(manager, job.id)
    with manager.reading(job.id), pytest.raises(Conflict, match=r"being read \(1 reader"):
        manager.delete(job.id)
    deletion = manager.delete(job.id, keep_record=True)
    assert deletion.record_kept and deletion.freed_bytes > job.estimate_bytes  # chunks plus metadata
    assert manager.disk_usage().used_bytes == 0 and manager.get(job.id).result_deleted_at is not None
    with pytest.raises(ResultNotFound, match="was deleted"):
        manager.read_result(job.id)
    with pytest.raises(ResultNotFound, match="already deleted"):
        manager.delete(job.id, keep_record=True)
    assert manager.delete(job.id) == Deletion(job_id=job.id, freed_bytes=0, record_kept=False)  # the record goes
    with pytest.raises(JobNotFound):
        manager.get(job.id)


def test_a_deletion_cut_off_by_a_crash_is_finished_at_the_next_start(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    first = make_manager()
    job = first.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", tile_size=4)
    wait_finished(first, job.id)
    first.stop()
    jobs_dir = jobs_env.data_dir / "jobs"
    (jobs_dir / job.id).rename(jobs_dir / f".deleting-{job.id}")  # the rename happened, then the process died
    second = make_manager()
    assert not (jobs_dir / f".deleting-{job.id}").exists()
    assert second.get(job.id).result_deleted_at is not None
    assert second.delete(job.id).freed_bytes == 0  # whatever that deletion meant to keep, the record can go now
    with pytest.raises(JobNotFound):
        second.get(job.id)


def test_two_deletions_at_once_delete_once_and_the_other_is_a_404(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = make_manager()
    job = manager.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", tile_size=4)
    wait_finished(manager, job.id)
    measure = manager_module.tree_bytes

    def slow_measure(path: Path) -> int:  # widens the window between the rename and the record update
        time.sleep(0.3)
        return measure(path)

    monkeypatch.setattr(manager_module, "tree_bytes", slow_measure)
    outcomes: list[object] = []

    def delete() -> None:
        try:
            outcomes.append(manager.delete(job.id, keep_record=True))
        except Exception as exc:  # noqa: BLE001 - the outcome is what is checked
            outcomes.append(exc)

    threads = [threading.Thread(target=delete) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join(10)
    deleted = [o for o in outcomes if isinstance(o, Deletion)]
    refused = [o for o in outcomes if isinstance(o, ResultNotFound)]
    assert len(deleted) == 1 and len(refused) == 1, outcomes
    assert deleted[0].freed_bytes > job.estimate_bytes
    assert not list((jobs_env.data_dir / "jobs").glob(f"*{job.id}*"))


def test_a_result_missing_on_disk_is_a_404_not_an_invalid_input(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    manager = make_manager()
    job = manager.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", tile_size=4)
    wait_finished(manager, job.id)
    shutil.rmtree(jobs_env.data_dir / "jobs" / job.id)  # removed by hand (or renamed by a deletion under way)
    with pytest.raises(ResultNotFound, match="is not on disk"):
        manager.open_result(job.id)
    assert manager.delete(job.id).freed_bytes == 0  # the record can still be deleted
