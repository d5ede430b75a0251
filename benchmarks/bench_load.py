"""A bounded load test on loopback: concurrent kernels, data-set uploads and job submissions against a real server.

A fixed number of requests (``--requests``) is sent by ``--concurrency`` client threads, in a fixed, seeded mix;
meanwhile ``GET /healthz`` is probed every 20 ms from a separate process (after 5 s of probing before the load,
the machine's baseline) and, for comparison, from one more thread of the load-generating process (which shares that
process's GIL with the client threads encoding JSON bodies). The run stops by itself when the last request is
answered and the submitted jobs have finished (or ``--job-timeout`` passed). It prints one table and exits non-zero
when a promise is broken:

- no 5xx at all;
- beyond capacity (``NTK_COMPUTE_CONCURRENCY`` computing + ``NTK_MAX_QUEUE`` waiting) kernels get 429, each with a
  ``Retry-After``;
- ``/healthz`` p99 under 100 ms while the load runs, as the separate process measures it;
- the server's memory high-water mark (``VmHWM`` from /proc) within its budget: the RSS after start-up plus
  ``NTK_MEMORY_BUDGET_BYTES`` per compute slot plus ``NTK_SIDE_CACHE_BYTES``.

    .venv/bin/python benchmarks/bench_load.py                       # 240 requests, 8 clients
    .venv/bin/python benchmarks/bench_load.py --requests 60 --concurrency 4
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from ntk_service import wire  # noqa: E402
from tests.conftest import LiveServer, start_live_server  # noqa: E402
from tests.server.support import tensor_json  # noqa: E402

ARCHITECTURE = {"family": "mlp", "input_dim": 32, "hidden": [128], "output_dim": 10, "activation": "relu"}
MEMORY_BUDGET_BYTES = 128 * 2**20
SIDE_CACHE_BYTES = 64 * 2**20
COMPUTE_CONCURRENCY = 1
MAX_QUEUE = 2
HEALTH_PERIOD_S = 0.02
HEALTH_P99_LIMIT_MS = 100.0
IDLE_BASELINE_S = 5.0
"""Seconds /healthz is probed before the load starts: the baseline of the machine as it is."""
MIX = (("kernel", 0.6), ("upload", 0.2), ("job", 0.2))
"""Share of each kind of request."""


@dataclass(frozen=True)
class Outcome:
    kind: str
    status: int
    seconds: float
    has_retry_after: bool


def _vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _probe_health(url: str, ready: Event, stop: Event, out: Any) -> None:
    """The separate prober process: ``GET /healthz`` every HEALTH_PERIOD_S until ``stop``; sends (when, ms) pairs,
    ``when`` on the system-wide monotonic clock, so the parent can tell the idle baseline from the load."""
    latencies = []
    with httpx.Client(base_url=url, timeout=10) as own:
        own.get("/healthz").raise_for_status()  # connected and warm
        ready.set()
        while not stop.is_set():
            when, start = time.monotonic(), time.perf_counter()
            own.get("/healthz").raise_for_status()
            latencies.append((when, (time.perf_counter() - start) * 1000))
            time.sleep(HEALTH_PERIOD_S)
    out.put(latencies)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=240, help="Requests in all. Default: 240.")
    parser.add_argument("--concurrency", type=int, default=8, help="Client threads. Default: 8.")
    parser.add_argument("--n", type=int, default=32, help="Examples per kernel request (N = M). Default: 32.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the request mix and inputs. Default: 0.")
    parser.add_argument("--job-timeout", type=float, default=300.0, help="Seconds to wait for the jobs. Default: 300.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_live_server(
            Path(tmp) / "data",
            compute_concurrency=str(COMPUTE_CONCURRENCY),
            max_queue=str(MAX_QUEUE),
            memory_budget_bytes=str(MEMORY_BUDGET_BYTES),
            side_cache_bytes=str(SIDE_CACHE_BYTES),
            log_level="error",
        )
        try:
            return run(server, args)
        finally:
            server.stop()


def run(server: LiveServer, args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    kinds = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX], k=args.requests)
    data = np.random.default_rng(args.seed).standard_normal((args.n, 32)).astype(np.float32)
    with server.client("write") as client:
        assert client.post("/v1/models", json={"name": "load-mlp", "architecture": ARCHITECTURE}).status_code == 201
        upload = client.post("/v1/datasets", content=wire.encode_npy(data), headers={"Content-Type": wire.MEDIA_NPY})
        dataset_id = upload.json()["id"]
        client.post("/v1/models/load-mlp/ntk", json={"x1": tensor_json(data[:2])})  # warm the model cache
    baseline_kib = _vm_kib(server.process.pid, "VmRSS")

    outcomes: list[Outcome] = []
    job_ids: list[str] = []
    lock = threading.Lock()
    queue = list(enumerate(kinds))
    stop_probe = threading.Event()
    health_ms: list[float] = []  # the in-process prober's
    spawn = multiprocessing.get_context("spawn")
    ready, stop_process, from_process = spawn.Event(), spawn.Event(), spawn.Queue()
    prober_process = spawn.Process(target=_probe_health, args=(server.url, ready, stop_process, from_process))

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as own:
            while not stop_probe.is_set():
                start = time.perf_counter()
                own.get("/healthz").raise_for_status()
                health_ms.append((time.perf_counter() - start) * 1000)
                time.sleep(HEALTH_PERIOD_S)

    def send(client: httpx.Client, index: int, kind: str) -> httpx.Response:
        if kind == "kernel":
            mode = ("trace", "full")[index % 2]
            body = {"x1": tensor_json(data), "mode": mode} if index % 3 else {"x1": {"dataset": dataset_id}}
            return client.post("/v1/models/load-mlp/ntk", json=body, headers={"Accept": wire.MEDIA_NPY})
        if kind == "upload":
            content = wire.encode_npy(data + index)
            return client.post("/v1/datasets", content=content, headers={"Content-Type": wire.MEDIA_NPY})
        job = {"model": "load-mlp", "x1": {"dataset": dataset_id}, "mode": "trace", "tile_size": 16}
        return client.post("/v1/jobs", json=job)

    def worker() -> None:
        with server.client("write", timeout=300) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    index, kind = queue.pop(0)
                start = time.perf_counter()
                response = send(client, index, kind)
                outcome = Outcome(
                    kind, response.status_code, time.perf_counter() - start, "retry-after" in response.headers
                )
                with lock:
                    outcomes.append(outcome)
                    if kind == "job" and response.status_code == 202:
                        job_ids.append(response.json()["id"])

    prober = threading.Thread(target=probe)
    prober_process.start()
    if not ready.wait(timeout=120):
        raise RuntimeError("the /healthz prober process did not start")
    time.sleep(IDLE_BASELINE_S)  # /healthz with no load from this benchmark: what the machine alone costs
    prober.start()
    load_from = time.monotonic()
    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    load_s = time.perf_counter() - started
    load_to = time.monotonic()
    stop_probe.set()
    stop_process.set()
    prober.join()
    probes: list[tuple[float, float]] = from_process.get(timeout=60)
    process_ms = [ms for when, ms in probes if load_from <= when <= load_to]
    idle_ms = [ms for when, ms in probes if when < load_from]
    prober_process.join(timeout=60)

    with server.client("read") as client:
        deadline = time.monotonic() + args.job_timeout
        statuses: Counter[str] = Counter()
        while time.monotonic() < deadline:
            statuses = Counter(client.get(f"/v1/jobs/{job_id}").json()["status"] for job_id in job_ids)
            if statuses["queued"] + statuses["running"] == 0:
                break
            time.sleep(0.5)
    high_water_kib = _vm_kib(server.process.pid, "VmHWM")
    budget_kib = baseline_kib + (MEMORY_BUDGET_BYTES * COMPUTE_CONCURRENCY + SIDE_CACHE_BYTES) // 1024

    table = Counter((o.kind, o.status) for o in outcomes)
    load_1, load_5, _ = os.getloadavg()
    print(
        f"{args.requests} requests, {args.concurrency} clients, N = {args.n}, in {load_s:.1f} s "
        f"(compute_concurrency {COMPUTE_CONCURRENCY}, max_queue {MAX_QUEUE}); load average {load_1:.1f} (1 min), "
        f"{load_5:.1f} (5 min) on {os.cpu_count()} cores\n"
    )
    print("| request | status | count | median s | max s |")
    print("| --- | --- | --- | --- | --- |")
    for (kind, status), count in sorted(table.items()):
        times = [o.seconds for o in outcomes if (o.kind, o.status) == (kind, status)]
        print(f"| {kind} | {status} | {count} | {statistics.median(times):.3f} | {max(times):.3f} |")
    p50, p99 = _percentile(process_ms, 0.5), _percentile(process_ms, 0.99)
    thread_p50, thread_p99 = _percentile(health_ms, 0.5), _percentile(health_ms, 0.99)
    print("\n| check | measured | limit | ok |\n| --- | --- | --- | --- |")
    server_errors = sum(1 for o in outcomes if o.status >= 500)
    busy = [o for o in outcomes if o.status == 429]
    checks = [
        ("5xx responses", f"{server_errors}", "0", server_errors == 0),
        (
            "429 with Retry-After",
            f"{sum(o.has_retry_after for o in busy)} of {len(busy)}",
            "all",
            all(o.has_retry_after for o in busy),
        ),
        (
            f"/healthz p50 / p99, separate process ({len(process_ms)} probes)",
            f"{p50:.1f} / {p99:.1f} ms",
            f"p99 < {HEALTH_P99_LIMIT_MS:.0f} ms",
            p99 < HEALTH_P99_LIMIT_MS,
        ),
        (
            f"/healthz p50 / p99 before the load, separate process ({len(idle_ms)} probes)",
            f"{_percentile(idle_ms, 0.5):.1f} / {_percentile(idle_ms, 0.99):.1f} ms",
            "(baseline)",
            True,
        ),
        (
            f"/healthz p50 / p99, a thread of the load's process ({len(health_ms)} probes)",
            f"{thread_p50:.1f} / {thread_p99:.1f} ms",
            "(for comparison)",
            True,
        ),
        (
            "memory high-water (VmHWM)",
            f"{high_water_kib / 1024:.0f} MiB",
            f"{budget_kib / 1024:.0f} MiB",
            high_water_kib <= budget_kib,
        ),
        (
            "jobs finished",
            f"{statuses['succeeded']} succeeded of {len(job_ids)}",
            "all",
            statuses["succeeded"] == len(job_ids),
        ),
        (
            "other statuses",
            ", ".join(f"{s}" for s in sorted({o.status for o in outcomes} - {200, 201, 202, 429})) or "none",
            "none",
            not ({o.status for o in outcomes} - {200, 201, 202, 429}),
        ),
    ]
    for name, measured, limit, ok in checks:
        print(f"| {name} | {measured} | {limit} | {'yes' if ok else 'NO'} |")
    return 0 if all(ok for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
