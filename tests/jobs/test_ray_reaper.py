"""The local-Ray reaper's lookup of a raylet's processes by their environment (jobs/executors/ray.py), on real
processes: it finds a ``ray::`` process that names the raylet in ``RAY_RAYLET_PID`` wherever it was re-parented,
and nothing else. No Ray needed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from ntk_service.jobs.executors.ray import _children_of_raylets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("bash") is None, reason="/proc")


@pytest.fixture
def fake_agents() -> Iterator[tuple[int, int]]:
    """A "ray::FakeAgent" process whose RAY_RAYLET_PID is this test's own pid, and a plain one with the same mark."""
    mark = {**os.environ, "RAY_RAYLET_PID": str(os.getpid())}
    agent = subprocess.Popen(["bash", "-c", 'exec -a "ray::FakeAgent" sleep 60'], env=mark)
    other = subprocess.Popen(["bash", "-c", 'exec -a "not-ray" sleep 60'], env=mark)
    try:
        yield agent.pid, other.pid
    finally:
        for process in (agent, other):
            process.kill()
            process.wait()


def test_a_raylets_processes_are_found_by_their_environment(fake_agents: tuple[int, int]) -> None:
    agent, other = fake_agents
    for _ in range(100):  # bash has exec'd once the command line reads ray::
        found = _children_of_raylets({os.getpid()})
        if agent in found:
            break
        time.sleep(0.01)
    assert agent in found and other not in found
    assert agent not in _children_of_raylets({os.getpid() + 1_000_000}) and _children_of_raylets(set()) == set()
