"""Bounded concurrency against a real server: /healthz answers while a kernel computes, and a request over
capacity gets 429 with Retry-After instead of waiting. The server runs open (no keys) on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import numpy as np

from tests.conftest import REPO_ROOT, SLOW_FACTORY, LiveServer
from tests.server.support import tensor_json

DELAY_S = 0.4
"""Sleep per forward call of the slow model; a kernel makes about 8 calls here, so it runs for ~3 s."""


def _gauge(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_health_answers_during_a_kernel_and_overload_gets_429(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(keys=False, compute_concurrency="1", max_queue="0")
    architecture = {
        "family": "factory",
        "factory": SLOW_FACTORY,
        "kwargs": {"in_dim": 4, "out_dim": 2, "delay_s": DELAY_S},
        "input_shape": [4],
    }
    body = {"x1": tensor_json(np.ones((2, 4), np.float32)), "implementation": "jacobian_contraction"}
    results: dict[str, httpx.Response] = {}

    def slow_kernel() -> None:
        with server.client(None) as own:
            results["slow"] = own.post("/v1/models/slow/ntk", json=body)

    with server.client(None) as client:  # open server: no key needed
        assert client.post("/v1/models", json={"name": "slow", "architecture": architecture}).status_code == 201
        worker = threading.Thread(target=slow_kernel)
        worker.start()
        deadline = time.monotonic() + 30
        while _gauge(client, "ntk_kernel_computes_in_flight") < 1:
            assert time.monotonic() < deadline, "the slow kernel never started"
            time.sleep(0.05)

        start = time.perf_counter()
        health = client.get("/healthz")
        health_s = time.perf_counter() - start
        still_computing = worker.is_alive()
        busy = client.post("/v1/models/slow/ntk", json=body)
        rejected = _gauge(client, "ntk_kernel_computes_rejected_total")
        # the model and the sides are checked before queueing: a bad request is refused for what it is, not Busy
        missing = client.post("/v1/models/no-such-model/ntk", json=body)
        misshapen = client.post("/v1/models/slow/ntk", json={"x1": tensor_json(np.ones((2, 3), np.float32))})
        computing = worker.is_alive()
        worker.join(timeout=60)

    assert health.status_code == 200
    assert still_computing, "the kernel finished before /healthz answered: the test proves nothing"
    assert health_s < 1.0, f"/healthz took {health_s:.2f} s while a kernel computed"
    assert busy.status_code == 429
    assert int(busy.headers["retry-after"]) >= 1
    error = busy.json()["error"]
    assert error["type"] == "busy"
    assert error["message"] == (
        "ntk of model 'slow': the server is at capacity (1 computing, 0 waiting); "
        "retry after the Retry-After delay, or send smaller requests"
    )
    assert rejected == 1
    assert computing, "the kernel finished before the bad requests: the test proves nothing"
    assert missing.status_code == 404, missing.text
    assert misshapen.status_code == 422, misshapen.text
    assert misshapen.json()["error"]["type"] == "shape_mismatch"
    assert results["slow"].status_code == 200, results["slow"].text
    assert results["slow"].json()["theta"]["shape"] == [2, 2, 2, 2]
    assert "no API keys configured" in server.log()  # the open server said so at startup


def test_configure_torch_threads_caps_numpys_blas_pool_too() -> None:
    """NOTE [threads]: the threads of one computation are torch's and numpy's BLAS's alike. Process-wide, so it
    is checked in a fresh interpreter (threadpoolctl reads the pools the process has loaded)."""
    script = (
        "import json, numpy, torch, threadpoolctl\n"
        "from ntk_service.server.compute import configure_torch_threads\n"
        "before = [p['num_threads'] for p in threadpoolctl.threadpool_info() if p['user_api'] == 'blas']\n"
        "configure_torch_threads(1)\n"
        "after = [p['num_threads'] for p in threadpoolctl.threadpool_info() if p['user_api'] == 'blas']\n"
        "print(json.dumps({'before': before, 'after': after, 'torch': torch.get_num_threads()}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["after"], "numpy loaded no BLAS threadpoolctl can see: the check proves nothing"
    assert seen["after"] == [1] * len(seen["after"]) and seen["torch"] == 1, seen
