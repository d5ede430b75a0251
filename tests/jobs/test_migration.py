"""A data directory written by the job code of before the one job store opens with this code, nothing lost.

``data/v1-data-dir.tar.gz`` was written over HTTP by a real server of commit 12f8780 (``data/make_v1_data_dir.py``):
kernel jobs in ``jobs/jobs.sqlite3``, solve and features jobs in ``jobs/solve_jobs.sqlite3``, results on disk, the
kernels, arrays and Φ those jobs returned then in ``expected/``, and a SIGKILL that cut a kernel job and a solve mid-run
with a solve and a features job queued behind. A real server of this code starts on it: every job is listed under its
own route with its status, every result reads back bit for bit, the cut jobs finish equal to fresh runs, old jobs
delete, and the old store is set aside, not deleted.
"""

from __future__ import annotations

import io
import json
import sqlite3
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy

from tests.conftest import LiveServer, start_live_server

FIXTURE = Path(__file__).parent / "data" / "v1-data-dir.tar.gz"
NPY = "application/x-npy"


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, dict[str, Any], Path]]:
    """A server of this code on a copy of the old data directory; the manifest (with the tiles the old code had
    recorded done for the cut kernel job); the old answers' folder."""
    root = tmp_path_factory.mktemp("v1")
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(root, filter="data")  # our own fixture, extracted as data
    manifest = json.loads((root / "manifest.json").read_text())
    with sqlite3.connect(root / "data" / "jobs" / "jobs.sqlite3") as conn:  # as the old code left it
        rows = conn.execute(
            "SELECT tile_id FROM tiles WHERE job_id = ? AND state = 'done'", (manifest["jobs"]["kernel"]["cut"],)
        )
        manifest["cut_done"] = sorted(tile for (tile,) in rows)
    live = start_live_server(root / "data", memory_budget_bytes=str(64 * 2**20))
    yield live, manifest, root / "expected"
    live.stop()


def _ids(client: httpx.Client, route: str) -> dict[str, dict[str, Any]]:
    response = client.get(f"/v1/{route}")
    assert response.status_code == 200, response.text
    return {job["id"]: job for job in response.json()["data"]}


def _npy(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.load(io.BytesIO(response.content), allow_pickle=False)


def _finished(client: httpx.Client, route: str, job_id: str, timeout: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/{route}/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return dict(job)
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def _solution(client: httpx.Client, job_id: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    response = client.get(f"/v1/solve-jobs/{job_id}/result", headers={"Accept": "application/x-safetensors"})
    assert response.status_code == 200, response.text
    arrays = safetensors.numpy.load(response.content)
    size = int.from_bytes(response.content[:8], "little")  # the header: its length, then JSON with __metadata__
    return arrays, json.loads(json.loads(response.content[8 : 8 + size])["__metadata__"]["result"])


def test_every_old_job_is_listed_under_its_route_and_every_result_reads_back_bitwise(
    old: tuple[LiveServer, dict[str, Any], Path],
) -> None:
    live, manifest, expected = old
    kernel, solve, features = (manifest["jobs"][kind] for kind in ("kernel", "solve", "features"))
    with live.client() as client:
        listed = {route: _ids(client, route) for route in ("jobs", "solve-jobs", "feature-jobs")}
        assert set(listed["jobs"]) == set(kernel.values())  # each kind under its own route, none lost, none mixed
        assert set(listed["solve-jobs"]) == set(solve.values())
        assert set(listed["feature-jobs"]) == set(features.values())
        jobs = listed["jobs"]
        assert jobs[kernel["trace"]]["status"] == "succeeded" and jobs[kernel["cancelled"]]["status"] == "cancelled"
        assert jobs[kernel["kept"]]["status"] == "succeeded" and jobs[kernel["kept"]]["result_deleted_at"]
        assert client.get(f"/v1/jobs/{kernel['kept']}/result").status_code == 404
        trace = _npy(client.get(f"/v1/jobs/{kernel['trace']}/result", headers={"Accept": NPY}))
        np.testing.assert_array_equal(trace, np.load(expected / "trace.npy"))

        ridge = listed["solve-jobs"][solve["ridge"]]
        assert ridge["status"] == "succeeded" and ridge["kind"] == "kernel_ridge" and ridge["job"] == "solve"
        assert listed["solve-jobs"][solve["cancelled_solve"]]["status"] == "cancelled"
        arrays, report = _solution(client, solve["ridge"])
        np.testing.assert_array_equal(arrays["alpha"], np.load(expected / "ridge_alpha.npy"))
        np.testing.assert_array_equal(arrays["predictions"], np.load(expected / "ridge_predictions.npy"))
        assert {key: report[key] for key in manifest["ridge_report"]} == manifest["ridge_report"]
        assert ridge["result"] == report and ridge["progress"]["iterations"] == report["iterations"]

        phi = listed["feature-jobs"][features["phi"]]
        assert phi["status"] == "succeeded" and phi["result"] == {"shape": [11, 3, 8], "seed": 5, "dim": 8}
        stored = _npy(client.get(f"/v1/feature-jobs/{features['phi']}/result", headers={"Accept": NPY}))
        np.testing.assert_array_equal(stored, np.load(expected / "phi.npy"))

        gone = client.delete(f"/v1/feature-jobs/{features['phi']}")  # an old job deletes, its bytes come back
        assert gone.status_code == 200 and gone.json()["freed_bytes"] > 0, gone.text
        assert not (live.data_dir / "jobs" / "solve" / features["phi"]).exists()
    jobs_dir = live.data_dir / "jobs"
    assert not (jobs_dir / "solve_jobs.sqlite3").exists() and (jobs_dir / "solve_jobs.sqlite3.imported").is_file()


def _resubmit(client: httpx.Client, route: str, job: dict[str, Any]) -> str:
    """The same job again, from its stored spec."""
    spec = job.get("spec") or {}
    if route == "jobs":
        keys = ("model", "version", "x1", "mode", "implementation", "dtype", "params", "tile_size", "panel_tiles")
        body = {key: job[key] for key in keys}
    elif route == "solve-jobs":
        rows = {
            side: None if spec[f"{side}_dataset"] is None else {
                "dataset": spec[f"{side}_dataset"], "start": spec[f"{side}_start"],
                "stop": spec[f"{side}_start"] + (spec["m"] if side == "test" else spec["n"]),
            }
            for side in ("train", "targets", "test")
        }  # fmt: skip
        keys = ("kind", "model", "version", "mode", "dtype", "params", "ridge", "rtol", "max_iterations")
        body = {
            key: spec[key] for key in (*keys, "preconditioner", "landmarks", "progress_every", "examples_per_chunk")
        }
        body |= rows
    else:
        keys = ("model", "version", "dim", "seed", "params", "dtype", "rows_per_chunk", "sketch")
        body = {key: spec[key] for key in keys}
        body["dataset"] = {"dataset": spec["dataset"], "start": spec["start"], "stop": spec["start"] + spec["n"]}
    response = client.post(f"/v1/{route}", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def test_the_jobs_the_kill_cut_off_finish_equal_to_fresh_runs(old: tuple[LiveServer, dict[str, Any], Path]) -> None:
    live, manifest, _ = old
    kernel, solve, features = (manifest["jobs"][kind] for kind in ("kernel", "solve", "features"))
    with live.client() as client:
        cut = _finished(client, "jobs", kernel["cut"])
        assert cut["status"] == "succeeded" and cut["tiles_done"] == cut["tiles_total"] == 10, cut
        fresh = _finished(client, "jobs", _resubmit(client, "jobs", cut))
        np.testing.assert_array_equal(
            _npy(client.get(f"/v1/jobs/{cut['id']}/result", headers={"Accept": NPY})),
            _npy(client.get(f"/v1/jobs/{fresh['id']}/result", headers={"Accept": NPY})),
        )
        for name in ("running_solve", "queued_solve"):
            resumed = _finished(client, "solve-jobs", solve[name])
            assert resumed["status"] == "succeeded", resumed
            again = _finished(client, "solve-jobs", _resubmit(client, "solve-jobs", resumed))
            (mine, report), (theirs, _) = _solution(client, resumed["id"]), _solution(client, again["id"])
            assert mine.keys() == theirs.keys() == {"alpha", "predictions"} and report["iterations"] > 0
            for key in mine:
                np.testing.assert_array_equal(mine[key], theirs[key])
        queued = _finished(client, "feature-jobs", features["queued_features"])
        assert queued["status"] == "succeeded" and queued["progress"] == {"rows_done": 11, "rows_total": 11}
        again = _finished(client, "feature-jobs", _resubmit(client, "feature-jobs", queued))
        np.testing.assert_array_equal(
            _npy(client.get(f"/v1/feature-jobs/{queued['id']}/result", headers={"Accept": NPY})),
            _npy(client.get(f"/v1/feature-jobs/{again['id']}/result", headers={"Accept": NPY})),
        )
    with sqlite3.connect(live.data_dir / "jobs" / "jobs.sqlite3") as conn:
        attempts = dict(conn.execute("SELECT tile_id, attempts FROM tiles WHERE job_id = ?", (kernel["cut"],)))
    assert manifest["cut_done"] and all(attempts[tile] == 1 for tile in manifest["cut_done"])  # none computed again
