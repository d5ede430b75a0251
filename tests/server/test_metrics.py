"""server/metrics.py: the job-disk gauges come from one reading per scrape, taken where the render runs."""

from __future__ import annotations

import threading

from ntk_service.server.metrics import Metrics


def _samples(text: str) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def test_job_disk_gauges_read_once_per_scrape_in_the_rendering_thread() -> None:
    metrics = Metrics()
    calls: list[str] = []

    def read() -> tuple[int, int | None, int]:
        calls.append(threading.current_thread().name)
        return 1000 + len(calls), None, 7  # each reading differs: mixed readings would show

    metrics.watch_job_disk(read)
    assert calls == []  # registering reads nothing
    rendered: list[bytes] = []
    worker = threading.Thread(target=lambda: rendered.append(metrics.render()), name="render-worker")
    worker.start()
    worker.join(timeout=30)
    samples = _samples(rendered[0].decode())
    assert calls == ["render-worker"]
    assert samples["ntk_job_results_bytes"] == 1001
    assert samples["ntk_job_disk_budget_bytes"] == -1.0  # None: 90 % of free space
    assert samples["ntk_job_disk_available_bytes"] == 7
    assert _samples(metrics.render().decode())["ntk_job_results_bytes"] == 1002 and len(calls) == 2
