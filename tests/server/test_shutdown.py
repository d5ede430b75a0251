"""SIGTERM on a real server process while a kernel computes, a job runs and a client follows the job's events:
the kernel is answered, the event stream ends at once, the process exits within the timeout leaving no child
process behind, and the job's unfinished tiles resume after a restart and complete correctly."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch

from ntk_service import wire
from ntk_service.jobs import JobStore
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server import slow_factory
from tests.server.support import SLOW_JOB_INPUTS, assert_close_to_reference, submit_slow_job, tensor_json

DELAY_S = 0.6
"""Each forward call of the slow model sleeps this long once its gate opens: the kernel and the running tile are
still computing when SIGTERM arrives, and the other nine tiles cannot all start before the server stops them."""

SHUTDOWN_TIMEOUT_S = 20
"""NTK_SHUTDOWN_TIMEOUT_S of the server under test: in-flight requests may take this long."""


def _children(pid: int) -> set[int]:
    """Live processes whose parent is ``pid`` (Linux /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_sigterm_finishes_requests_ends_streams_and_resumes_jobs(
    start_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    server = start_server(data_dir=data_dir, shutdown_timeout_s=str(SHUTDOWN_TIMEOUT_S), compute_concurrency="2")
    gate = tmp_path / "gate"
    x = SLOW_JOB_INPUTS
    body = {"x1": tensor_json(x[:2]), "implementation": "jacobian_contraction", "mode": "trace"}
    with server.client("write") as client:
        job = submit_slow_job(client, delay_s=DELAY_S, gate=gate)  # held until just before SIGTERM
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{job['id']}").json()["status"] != "running":
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.05)

    results: dict[str, object] = {}

    def kernel() -> None:
        with server.client("read") as own:
            results["kernel"] = own.post("/v1/models/slow/ntk", json=body)

    def follow() -> None:
        with server.client("read") as own, own.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
            results["stream_opened"] = time.monotonic()
            try:
                for _ in stream.iter_lines():
                    pass
            except httpx.HTTPError as exc:
                results["stream_error"] = exc
            results["stream_ended"] = time.monotonic()

    threads = [threading.Thread(target=kernel), threading.Thread(target=follow)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # the kernel and the job's first tile wait at the gate, and the stream is open
    children = _children(server.process.pid)
    gate.touch()  # both compute now (each forward call sleeps DELAY_S): SIGTERM arrives while they run
    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    returncode = server.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
    exited = time.monotonic() - sent
    for thread in threads:
        thread.join(timeout=30)

    # uvicorn re-raises the signal once it has shut down, so the exit status is "terminated by SIGTERM".
    assert returncode in (0, -signal.SIGTERM), server.log()[-3000:]
    assert "ERROR" not in server.log() and "Traceback" not in server.log(), server.log()[-3000:]
    assert "stream_error" not in results, results  # the stream ended as a complete response
    response = results["kernel"]
    assert isinstance(response, httpx.Response) and response.status_code == 200, response  # finished, answered
    assert "stream_opened" in results and float(results["stream_ended"]) - sent < 5, results  # ended at once
    assert exited < SHUTDOWN_TIMEOUT_S, f"shutdown took {exited:.1f} s"
    assert not [pid for pid in children if _alive(pid)], "a child process outlived the server"

    # The job was stopped, not failed: the tile that was computing finished and is recorded, the rest are pending.
    store = JobStore(data_dir / "jobs" / "jobs.sqlite3")
    stopped = store.get_job(job["id"])
    assert stopped.status.value in ("queued", "running") and stopped.error is None, stopped
    assert store.release_running_tiles(job["id"]) == 0, "a tile was left marked running"
    assert store.pending_tile_ids(job["id"]), "every tile finished before SIGTERM: the test proves nothing"
    started = {t for t, n in store.tile_attempts(job["id"]).items() if n}
    assert started == store.done_tile_ids(job["id"]), "a tile was claimed but not finished at SIGTERM"

    # After a restart on the same data the job resumes its unfinished tiles and its result is right.
    restarted = start_server(data_dir=data_dir)
    with restarted.client("read") as client:
        deadline = time.monotonic() + 120
        while (record := client.get(f"/v1/jobs/{job['id']}").json())["status"] != "succeeded":
            assert record["status"] in ("queued", "running"), record
            assert time.monotonic() < deadline, f"the job did not finish after the restart: {record}"
            time.sleep(0.2)
        theta = wire.decode_npy(client.get(f"/v1/jobs/{job['id']}/result", headers={"Accept": wire.MEDIA_NPY}).content)
        weights = client.get("/v1/models/slow/versions/1/weights").content
    # A resume after a clean shutdown consumes no attempt: every tile was computed once, across both runs.
    assert set(store.tile_attempts(job["id"]).values()) == {1}
    model = slow_factory.build(in_dim=4, out_dim=2)  # the same module, without the sleep
    model.load_state_dict(safetensors.torch.load(weights), strict=True)
    assert_close_to_reference(theta, reference_ntk(model, torch.from_numpy(x), None, "trace"))
