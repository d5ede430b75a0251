"""The attribution kinds in one lifecycle (JobManager, local executor, a real registry and data sets): a job stopped
at any unit goes on at the next start from what it recorded (the Gram matrix's partial sum, the running top-k) to
the bits of an uninterrupted run, computing no recorded unit again; and the scoring's memory plan at the issue's
scale. The HTTP tests (the service against the library, SIGKILL, 4xx) are tests/server/routes/test_attribution_jobs.py.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from ntk_service.errors import MemoryEstimateExceeded
from ntk_service.jobs import JobManager, JobRecord, JobStatus
from ntk_service.jobs.kinds.attribution import (
    AttributionRequest,
    plan_scoring,
    read_answers,
    read_scores,
    scoring_memory,
)
from ntk_service.jobs.kinds.attribution_features import AttributionFeaturesRequest
from ntk_service.jobs.kinds.rows import DataRows
from tests.conftest import REPO_ROOT
from tests.jobs.conftest import JobsEnv, wait_finished


class _Gate:
    """A run_compute that counts its calls; the call after ``free`` waits until ``go`` (then the test stops the
    manager: that unit finishes and is recorded, no further one starts)."""

    def __init__(self, free: int | None = None) -> None:
        self.free, self.calls = free, 0
        self.blocked, self.go = threading.Event(), threading.Event()

    def __call__(self, fn: Callable[[], Any]) -> Any:
        self.calls += 1
        if self.free is not None and self.calls > self.free:
            self.blocked.set()
            self.go.wait(30)
        return fn()


def _unrecord(manager: JobManager, job_id: str, tile: int) -> None:
    """Put a recorded tile back to pending: what a kill between a unit's saved state and its record leaves."""
    with sqlite3.connect(manager.store.path) as conn:
        conn.execute("UPDATE tiles SET state = 'pending' WHERE job_id = ? AND tile_id = ?", (job_id, tile))


def _stop_at_the_gate(manager: JobManager, gate: _Gate) -> None:
    assert gate.blocked.wait(60)
    stopper = threading.Thread(target=manager.stop)
    stopper.start()
    gate.go.set()
    stopper.join(60)
    assert not stopper.is_alive()


@pytest.fixture
def labels(jobs_env: JobsEnv) -> dict[str, str]:
    """Class indices for x1 (11) and x2 (7) of ``jobs_env`` (the tiny model has 3 outputs)."""
    rng = np.random.default_rng(9)
    create = jobs_env.datasets.create
    return {"x1": create(rng.integers(0, 3, 11)).id, "x2": create(rng.integers(0, 3, 7)).id}


def _features(env: JobsEnv, labels: dict[str, str], **options: Any) -> AttributionFeaturesRequest:
    return AttributionFeaturesRequest(
        model="tiny", train=DataRows(env.x1_id), labels=DataRows(labels["x1"]), dim=32, **options
    )


def _train_store(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    group = zarr.open_group(str(folder / "train.zarr"), mode="r")
    return np.asarray(group["features"][:]), np.asarray(group["loss_weights"][:]), np.load(folder / "gram.npy")  # type: ignore[index]


def test_a_stopped_features_job_goes_on_from_its_partial_gram_to_the_same_bits(
    jobs_env: JobsEnv, labels: dict[str, str], make_manager: Callable[..., JobManager]
) -> None:
    request = _features(jobs_env, labels, rows_per_chunk=2)  # 6 chunks
    gate = _Gate(free=2)  # two chunks pass, the third waits at the gate and is recorded when let through
    first = make_manager(run_compute=gate)
    job = first.create(request)
    _stop_at_the_gate(first, gate)
    stopped = first.get(job.id)
    assert stopped.status is JobStatus.RUNNING and (stopped.tiles_done, stopped.tiles_total) == (3, 6)
    assert (first.folder(stopped) / "gram_state.npz").is_file()
    _unrecord(first, job.id, 2)  # as if killed after chunk 2's partial sum was saved, before it was recorded

    counted = _Gate()
    second = make_manager(run_compute=counted)
    resumed = wait_finished(second, job.id)
    assert resumed.status is JobStatus.SUCCEEDED and counted.calls == 3  # chunks 3-5; chunk 2 is in the saved sum
    assert second.store.tile_attempts(job.id) == {0: 1, 1: 1, 2: 2, 3: 1, 4: 1, 5: 1}  # claimed twice, computed once
    fresh = wait_finished(second, second.create(request).id)
    for mine, theirs in zip(_train_store(second.folder(resumed)), _train_store(second.folder(fresh)), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert resumed.result == fresh.result and resumed.result is not None and resumed.result.rows == 11


def _scores_of(manager: JobManager, record: JobRecord[Any, Any, Any]) -> dict[str, np.ndarray]:
    folder = manager.folder(record)
    answers = read_answers(folder, record.spec)
    return {**answers, "scores": read_scores(folder, (0, record.spec.m), (0, record.spec.n))}


@pytest.mark.parametrize("free", [2, 8])  # stopped in the test features (the 3rd of 4 units), or at the 3rd block
def test_a_stopped_attribution_job_goes_on_from_its_running_top_k_to_the_same_bits(
    jobs_env: JobsEnv, labels: dict[str, str], make_manager: Callable[..., JobManager], free: int
) -> None:
    # run_compute calls: 4 test feature chunks (2 checkpoints × 2), the fit, the solve, 4 blocks of 3 training rows,
    # the total and the self influence; the gate holds the call after ``free`` until the manager stops
    first = make_manager(run_compute=_Gate())
    features = [wait_finished(first, first.create(_features(jobs_env, labels, seed=s)).id).id for s in (0, 1)]
    request = AttributionRequest(
        features=features, test=DataRows(jobs_env.x2_id), test_labels=DataRows(labels["x2"]), top_k=3,
        store_scores=True, self_influence=True, train_rows=3, test_rows_per_chunk=4,
    )  # fmt: skip
    first.stop()
    gate = _Gate(free=free)
    cut = make_manager(run_compute=gate)
    job = cut.create(request)
    _stop_at_the_gate(cut, gate)
    stopped = cut.get(job.id)
    assert stopped.status is JobStatus.RUNNING and 0 < stopped.tiles_done < stopped.tiles_total
    assert stopped.checkpoint is not None and stopped.checkpoint.stage == ("test features" if free < 6 else "scores")
    recorded = stopped.tiles_done
    if free == 8:  # tiles: 0-3 test features, 4-7 blocks: block 2 is in the saved top-k; as if killed before its record
        _unrecord(cut, job.id, 6)

    counted = _Gate()
    second = make_manager(run_compute=counted)
    resumed = wait_finished(second, job.id)
    assert resumed.status is JobStatus.SUCCEEDED, resumed.error
    attempts = second.store.tile_attempts(job.id)
    assert [t for t, n in attempts.items() if n > 1] == ([6] if free == 8 else [])  # no recorded unit ran again
    # what ran: the test features left, or (from the blocks) the fit, the solve, block 3, the total and self influence
    assert counted.calls == (1 + 2 + 4 + 2 if free == 2 else 2 + 1 + 2) and recorded == (3 if free == 2 else 7)
    fresh = wait_finished(second, second.create(request).id)
    mine, theirs = _scores_of(second, resumed), _scores_of(second, fresh)
    assert mine.keys() == theirs.keys() == {
        "proponents", "proponent_scores", "opponents", "opponent_scores", "total_influence", "self_influence",
        "scores",
    }  # fmt: skip
    for name in mine:
        np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)
    # the top 3 are the dense scores' 3 largest and smallest, in order
    scores = mine["scores"]
    np.testing.assert_array_equal(mine["proponent_scores"], -np.sort(-scores, axis=1)[:, :3])
    np.testing.assert_array_equal(mine["opponent_scores"], np.sort(scores, axis=1)[:, :3])
    store = zarr.open_group(str(second.folder(resumed) / "attribution.zarr"), mode="r")
    assert not any(name.startswith("test_features") for name in store)  # removed once every tile was recorded
    assert not (second.folder(resumed) / "top_state.npz").exists()


def test_the_scoring_plan_fits_the_issues_scale_in_4_gb_and_refuses_what_does_not_fit() -> None:
    # 10⁵ training × 10⁴ test examples, D = 2048, 10 checkpoints: the dense float32 scores alone would be 4 GB
    plan = plan_scoring(100_000, 10_000, [2048] * 10, top_k=10, budget_bytes=4 * 10**9)
    assert plan.bytes <= 4 * 10**9 and plan.train_rows == 12_500
    assert plan.bytes == scoring_memory(10_000, [2048] * 10, train_rows=12_500, top_k=10)
    # the held part alone: 10 factors (10 · 2048² float64) and the solved test features (10⁴ · 10 · 2048 float32)
    assert scoring_memory(10_000, [2048] * 10, train_rows=1, top_k=0) >= 10 * 2048**2 * 8 + 4 * 10_000 * 20_480
    with pytest.raises(MemoryEstimateExceeded, match=r"needs about 1\.\d+ GiB .* over the memory budget of") as error:
        plan_scoring(100_000, 10_000, [2048] * 10, top_k=10, budget_bytes=10**9)
    assert error.value.estimate_bytes > 10**9 == error.value.budget_bytes
    with pytest.raises(MemoryEstimateExceeded, match="or fewer train_rows"):
        plan_scoring(100_000, 10_000, [2048] * 10, top_k=10, budget_bytes=4 * 10**9, train_rows=50_000)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-memory counters")
def test_the_scorings_measured_peak_stays_within_its_plan(tmp_path: Path) -> None:
    # N = 16,384 training, M = 2048 test examples, D = 128, 2 checkpoints, blocks of 8192 training rows: a 64 MiB tile,
    # over glibc's 32 MiB threshold, so freed arrays go back to the system as they do at the issue's scale; merged
    # into the top-k whole, the tile took three times itself more (384 MB measured, NOTE [merge memory])
    args = [16_384, 2048, 128, 2, 400 * 2**20]
    run = subprocess.run(
        [sys.executable, "-m", "tests.jobs.scoring_peak", *map(str, args), str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    peak = json.loads(run.stdout)
    assert peak["train_rows"] == 8192
    assert 0.4 * peak["planned"] < peak["measured"] <= peak["planned"], peak  # measured 166-179 MB of 280 planned
