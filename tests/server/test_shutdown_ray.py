"""SIGTERM on a real server whose jobs run on the Ray executor (a local Ray the server started), while Ray tasks
compute tiles: the server exits within its timeout and no Ray process (GCS, raylet, workers, ...) outlives it;
the job is left resumable, not failed.

``test_shutdown.py`` covers the local executor (kernels, streams and the resumed result); this adds only what Ray
changes, at the cost of one Ray start (about 10-30 s on a loaded 2-core machine).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ntk_service.jobs import JobStore
from tests.conftest import REPO_ROOT, LiveServer
from tests.server.support import submit_slow_job

pytest.importorskip("ray", reason="the Ray executor needs the ntk-service[ray] extra")

DELAY_S = 0.5
"""Each forward call of the slow model sleeps this long, so a tile takes a few seconds on Ray."""

SHUTDOWN_TIMEOUT_S = 20
"""NTK_SHUTDOWN_TIMEOUT_S of the server under test (for in-flight requests)."""

RAY_STOP_S = 20
"""What stopping a local Ray may add on a loaded 2-core machine: the in-flight tasks finish their tile, then
ray.shutdown() and the reaping of the agents it leaves (RayExecutor.close)."""


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            found[int(entry.name)] = (parent, command)
    return found


def _descendants(root: int, processes: dict[int, tuple[int, str]]) -> set[int]:
    children: dict[int, set[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, set()).add(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), set()) - found:
            found.add(child)
            todo.append(child)
    return found


@pytest.fixture
def ray_temp_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short private RAY_TMPDIR (Ray's sockets live there: unix socket paths must stay under 108 bytes), so the
    Ray processes of this test are told apart from any other Ray on the machine by their command lines."""
    with tempfile.TemporaryDirectory(prefix="ntkray", dir="/tmp") as path:
        monkeypatch.setenv("RAY_TMPDIR", path)
        monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Ray workers unpickle the slow test model, so they must import `tests` from the repository root.
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        yield Path(path)


@pytest.mark.slow
def test_sigterm_with_ray_tasks_running_leaves_no_ray_process(
    start_server: Callable[..., LiveServer], tmp_path: Path, ray_temp_dir: Path
) -> None:
    data_dir = tmp_path / "data"
    server = start_server(
        data_dir=data_dir, executor="ray", shutdown_timeout_s=str(SHUTDOWN_TIMEOUT_S), log_level="info"
    )
    with server.client("write") as client:
        job = submit_slow_job(client, delay_s=DELAY_S)
        assert job["executor"] == "ray", job
        deadline = time.monotonic() + 120  # Ray starts first
        while (record := client.get(f"/v1/jobs/{job['id']}").json())["status"] != "running":
            assert record["status"] == "queued", record
            assert time.monotonic() < deadline, "the job never started on Ray"
            time.sleep(0.1)

    marker = str(ray_temp_dir)
    deadline = time.monotonic() + 60
    while True:  # wait until Ray runs a worker: then the tasks are in flight, the case that must not leak
        processes = _processes()
        ours = _descendants(server.process.pid, processes)
        ray_processes = {pid for pid, (_, command) in processes.items() if marker in command} | ours
        commands = [processes[pid][1] for pid in ours if pid in processes]
        agents = all(any(agent in c for c in commands) for agent in ("ray::DashboardAgent", "ray::RuntimeEnvAgent"))
        if agents and any("ray::" in c and "Agent" not in c for c in commands):
            break  # the raylet's agents are up too: Ray is fully started, the case a user meets
        assert time.monotonic() < deadline, f"no Ray worker appeared: {[processes[p][1][:80] for p in ours]}"
        time.sleep(0.2)
    assert any(marker in processes[pid][1] for pid in ray_processes), "Ray did not use this test's RAY_TMPDIR"

    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    returncode = server.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
    exited = time.monotonic() - sent
    assert returncode in (0, -signal.SIGTERM), server.log()[-3000:]
    assert "Traceback" not in server.log(), server.log()[-3000:]
    assert exited < SHUTDOWN_TIMEOUT_S + RAY_STOP_S, f"shutdown took {exited:.1f} s"
    print(f"SIGTERM to exit: {exited:.1f} s")

    deadline = time.monotonic() + 15  # ray.shutdown() signals its processes; give them a moment to go
    while True:
        now = _processes()
        left = {pid: now[pid][1][:120] for pid in ray_processes if pid in now}
        left |= {pid: command[:120] for pid, (_, command) in now.items() if marker in command}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"Ray processes outlived the server: {left}\n{server.log()[-4000:]}"

    store = JobStore(data_dir / "jobs" / "jobs.sqlite3")
    stopped = store.get_job(job["id"])
    assert stopped.status.value in ("queued", "running") and stopped.error is None, stopped
    assert store.release_running_tiles(job["id"]) == 0, "a tile was left marked running"
    assert store.pending_tile_ids(job["id"]), "every tile finished before SIGTERM: the test proves nothing"
