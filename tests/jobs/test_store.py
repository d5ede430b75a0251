"""SQLite job store: WAL, one transaction per job creation, attempts counted, guarded status changes."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from ntk_service.errors import JobNotFound
from ntk_service.jobs.records import JobRecord, JobSpec, JobStatus
from ntk_service.jobs.store import JobStore


def _record(job_id: str = "j1", tiles: int = 3) -> JobRecord:
    spec = JobSpec(
        model="m",
        version=1,
        weights_sha256="w",
        x1_dataset="ds_a",
        x2_dataset=None,
        x1_sha256="a",
        x2_sha256=None,
        n=10,
        m=10,
        k=2,
        mode="trace",
        implementation="auto",
        dtype="float32",
        params=None,
        tile_size=4,
        memory_budget_bytes=2**20,
    )
    return JobRecord(
        id=job_id,
        spec=spec,
        status=JobStatus.QUEUED,
        tiles_done=0,
        tiles_total=tiles,
        created_at=time.time(),
        started_at=None,
        finished_at=None,
        error=None,
        implementation_used=None,
        executor="local",
        result_shape=[10, 10],
        estimate_bytes=400,
    )


def test_job_round_trips_and_uses_wal(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.create_job(_record(), tile_ids=[0, 1, 4])
    got = store.get_job("j1")
    assert got.spec == _record().spec
    assert (got.status, got.tiles_done, got.tiles_total, got.result_shape) == (JobStatus.QUEUED, 0, 3, [10, 10])
    assert store.pending_tile_ids("j1") == [0, 1, 4]
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(JobNotFound, match="no job with id 'nope'"):
        store.get_job("nope")


def test_tiles_count_attempts_and_only_done_tiles_are_kept_on_release(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.create_job(_record(), tile_ids=[0, 1, 4])
    assert store.claim_tile("j1", 0) and store.claim_tile("j1", 1)
    store.mark_tile_done("j1", 0, elapsed_s=0.5)
    assert not store.claim_tile("j1", 0)  # done: nothing to compute
    assert store.release_running_tiles("j1") == 1  # tile 1 was being computed when "the process died"
    assert store.claim_tile("j1", 1)
    assert store.tile_attempts("j1") == {0: 1, 1: 2, 4: 0}
    assert store.done_tile_ids("j1") == {0}
    assert store.get_job("j1").tiles_done == 1
    assert store.tile_seconds("j1") == [0.5]


def test_finished_jobs_never_change_status(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.create_job(_record(), tile_ids=[0])
    assert store.set_status("j1", JobStatus.RUNNING)
    assert store.get_job("j1").started_at is not None
    assert store.set_status("j1", JobStatus.CANCELLED)
    assert not store.set_status("j1", JobStatus.SUCCEEDED)
    assert not store.set_status("j1", JobStatus.RUNNING)
    got = store.get_job("j1")
    assert got.status is JobStatus.CANCELLED and got.finished_at is not None


def test_list_filters_by_status_newest_first(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.create_job(_record("a"), tile_ids=[0])
    time.sleep(0.01)
    store.create_job(_record("b"), tile_ids=[0])
    store.set_status("a", JobStatus.FAILED, error="boom")
    assert [r.id for r in store.list_jobs()] == ["b", "a"]
    assert [r.id for r in store.list_jobs(statuses=[JobStatus.QUEUED])] == ["b"]
    assert store.get_job("a").error == "boom"


def test_a_database_of_the_previous_version_gains_the_deletion_column(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    with sqlite3.connect(path) as conn:  # the jobs table as the previous version created it
        conn.execute(
            "CREATE TABLE jobs (id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL, executor TEXT NOT NULL,"
            " tiles_total INTEGER NOT NULL, result_shape TEXT NOT NULL, estimate_bytes INTEGER NOT NULL,"
            " created_at REAL NOT NULL, started_at REAL, finished_at REAL, error TEXT, implementation_used TEXT)"
        )
    store = JobStore(path)
    store.create_job(_record(), tile_ids=[0, 1, 2])
    assert store.get_job("j1").result_deleted_at is None
    assert store.mark_result_deleted("j1") and not store.mark_result_deleted("j1")
    assert store.get_job("j1").result_deleted_at is not None
    assert store.delete_job("j1") and not store.delete_job("j1")
    with pytest.raises(JobNotFound):
        store.get_job("j1")
