"""Jobs of every kind against real uvicorn processes: every unit of a job and the kernel from features take a slot
of the server's compute limiter, while a submission is answered without one; and solve and features jobs cut by a
SIGKILL resume at the next start to the bits of uninterrupted runs (the kernel job's is in tests/jobs/test_routes.py).
"""

from __future__ import annotations

import io
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy

from tests.conftest import start_live_server
from tests.jobs.conftest import SLOW_MODEL, TINY_MLP

NPY = "application/x-npy"
_ONE_SLOT = {"compute_concurrency": "1", "max_queue": "0", "memory_budget_bytes": str(64 * 2**20)}
"""One computation at a time and none waiting: a request that finds the slot taken is a 429 at once."""


class _Servers:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.current = start_live_server(data_dir, **_ONE_SLOT)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Servers]:
    held = _Servers(tmp_path_factory.mktemp("job-routes") / "data")
    yield held
    held.current.stop()


def _until(check: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def _finished(client: httpx.Client, route: str, job_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        job = client.get(f"/v1/{route}/{job_id}").json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    return dict(_until(done, f"{route} {job_id} to finish", timeout=180))


def _in_flight(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("ntk_kernel_computes_in_flight "):
            return float(line.split()[1])
    raise AssertionError("no ntk_kernel_computes_in_flight in /metrics")


def _created(response: httpx.Response) -> str:
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def test_a_jobs_units_and_the_kernel_from_features_take_a_compute_slot_and_submissions_do_not_wait(
    servers: _Servers,
) -> None:
    gate = servers.data_dir.parent / "gate"  # the gated model's forward passes wait while this file is absent
    gated = {**SLOW_MODEL, "kwargs": {"in_dim": 4, "out_dim": 3, "delay_s": 0.0, "gate": str(gate)}}
    gate.touch()  # open while the model is registered and the job's submission probes it
    with servers.current.client() as client:
        for name, spec in (("tiny", TINY_MLP), ("gated", gated)):
            assert client.post("/v1/models", json={"name": name, "architecture": spec, "seed": 0}).status_code == 201
        x = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
        dataset, targets = (
            client.post("/v1/datasets", content=_npy_bytes(a), headers={"Content-Type": NPY}).json()["id"]
            for a in (x, np.ones((6, 3)))
        )
        phi = _created(
            client.post("/v1/feature-jobs", json={"model": "tiny", "dataset": {"dataset": dataset}, "dim": 8})
        )
        assert _finished(client, "feature-jobs", phi)["status"] == "succeeded"

        body = {"model": "gated", "dataset": {"dataset": dataset}, "dim": 8, "rows_per_chunk": 1}
        held = _created(client.post("/v1/feature-jobs", json=body))
        gate.unlink()  # from here the job's chunks wait inside their slot
        try:
            submitted = _while_a_unit_holds_the_slot(client, held, phi, dataset, targets)
        finally:
            gate.touch()  # whatever happened, the held job may finish: the next test needs the slot
        assert _finished(client, "feature-jobs", held)["status"] == "succeeded"
        for route, job_id in submitted.items():
            assert _finished(client, route, job_id)["status"] == "succeeded"
        kernel = client.post("/v1/feature-jobs/kernel", json={"x1": {"job": phi}, "mode": "trace"})
        assert kernel.status_code == 200 and kernel.json()["theta"]["shape"] == [6, 6], kernel.text


def _while_a_unit_holds_the_slot(
    client: httpx.Client, held: str, phi: str, dataset: str, targets: str
) -> dict[str, str]:
    """The kernel from features and an interactive kernel are refused (429), and a job of each kind is submitted
    (202), while a chunk of the job ``held`` waits inside the one compute slot; returns the submitted ids."""
    _until(lambda: _in_flight(client) == 1, "a chunk of the job to hold the one compute slot")
    assert client.get(f"/v1/feature-jobs/{held}").json()["status"] == "running"
    for path, payload in (
        ("/v1/feature-jobs/kernel", {"x1": {"job": phi}}),  # computed outside the limiter before issue 40
        ("/v1/models/tiny/ntk", {"x1": {"shape": [1, 4], "dtype": "float32", "data": [0.0] * 4}}),
    ):
        refused = client.post(path, json=payload)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "busy", (path, refused.text)
        assert "Retry-After" in refused.headers
    solve = {
        "kind": "kernel_ridge",
        "model": "tiny",
        "train": {"dataset": dataset},
        "targets": {"dataset": targets},
    }
    submitted = {  # a submission is answered at once, the slot held or not (NOTE [planning off the limiter])
        route: _created(client.post(f"/v1/{route}", json=payload))
        for route, payload in (
            ("feature-jobs", {"model": "tiny", "dataset": {"dataset": dataset}, "dim": 8}),
            ("solve-jobs", solve | {"ridge": 1.0}),
            ("jobs", {"model": "tiny", "x1": {"dataset": dataset}, "mode": "trace"}),
        )
    }
    return submitted


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _solution(client: httpx.Client, job_id: str) -> dict[str, np.ndarray]:
    response = client.get(f"/v1/solve-jobs/{job_id}/result", headers={"Accept": "application/x-safetensors"})
    assert response.status_code == 200, response.text
    return dict(safetensors.numpy.load(response.content))


def test_solve_and_features_jobs_cut_by_sigkill_resume_to_the_bits_of_uninterrupted_runs(servers: _Servers) -> None:
    rng = np.random.default_rng(2)
    slow = {**SLOW_MODEL, "kwargs": {"in_dim": 4, "out_dim": 3, "delay_s": 0.005}}
    with servers.current.client() as client:
        assert client.post("/v1/models", json={"name": "slow", "architecture": slow, "seed": 0}).status_code == 201
        ids = {
            name: client.post("/v1/datasets", content=_npy_bytes(a), headers={"Content-Type": NPY}).json()["id"]
            for name, a in (("x", rng.standard_normal((5, 4)).astype(np.float32)), ("y", rng.standard_normal((5, 3))),
                            ("t", rng.standard_normal((3, 4)).astype(np.float32)),
                            ("rows", rng.standard_normal((16, 4)).astype(np.float32)))
        }  # fmt: skip
        solve = {
            "kind": "kernel_ridge", "model": "slow", "train": {"dataset": ids["x"]}, "targets": {"dataset": ids["y"]},
            "test": {"dataset": ids["t"]}, "ridge": 10.0, "rtol": 1e-8, "progress_every": 2, "examples_per_chunk": 1,
        }  # fmt: skip
        # 16 chunks: the features job is still running while the solve passes two segments (one compute slot)
        features = {"model": "slow", "dataset": {"dataset": ids["rows"]}, "dim": 8, "rows_per_chunk": 1,
                    "dtype": "float64"}  # fmt: skip
        solve_id = _created(client.post("/v1/solve-jobs", json=solve))
        features_id = _created(client.post("/v1/feature-jobs", json=features))

        def mid_run() -> bool:
            s, f = (
                client.get(f"/v1/{r}/{i}").json() for r, i in (("solve-jobs", solve_id), ("feature-jobs", features_id))
            )
            return bool(
                (s["progress"] or {}).get("iterations", 0) >= 4 and s["status"] == "running"
                and (f["progress"] or {}).get("rows_done", 0) >= 2 and f["status"] == "running"
            )  # fmt: skip

        _until(mid_run, "both jobs to be past their first units")
    servers.current.process.kill()  # SIGKILL: no shutdown code runs
    servers.current.process.wait(10)
    jobs_dir = servers.data_dir / "jobs"
    assert (jobs_dir / "solve" / solve_id / "state.npz").is_file()  # the last segment's state, left by the kill
    with sqlite3.connect(jobs_dir / "jobs.sqlite3") as conn:
        done = [
            t for (t,) in conn.execute("SELECT tile_id FROM tiles WHERE job_id = ? AND state = 'done'", (features_id,))
        ]
    assert 2 <= len(done) < 16

    servers.current = start_live_server(servers.data_dir)  # the next start, with the default compute slots
    with servers.current.client() as client:
        resumed = _finished(client, "solve-jobs", solve_id)
        assert resumed["status"] == "succeeded" and resumed["result"]["converged"], resumed
        fresh = _finished(client, "solve-jobs", _created(client.post("/v1/solve-jobs", json=solve)))
        assert resumed["result"]["iterations"] == fresh["result"]["iterations"]
        mine, theirs = _solution(client, solve_id), _solution(client, fresh["id"])
        assert mine.keys() == theirs.keys() == {"alpha", "predictions"}
        for key in mine:
            np.testing.assert_array_equal(mine[key], theirs[key])

        assert _finished(client, "feature-jobs", features_id)["status"] == "succeeded"
        again = _finished(client, "feature-jobs", _created(client.post("/v1/feature-jobs", json=features)))
        phi = [
            np.load(io.BytesIO(client.get(f"/v1/feature-jobs/{i}/result", headers={"Accept": NPY}).content))
            for i in (features_id, again["id"])
        ]
        np.testing.assert_array_equal(phi[0], phi[1])
    with sqlite3.connect(jobs_dir / "jobs.sqlite3") as conn:
        attempts = dict(conn.execute("SELECT tile_id, attempts FROM tiles WHERE job_id = ?", (features_id,)))
    assert all(attempts[t] == 1 for t in done)  # no chunk recorded before the kill was computed again
