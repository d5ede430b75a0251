"""Prometheus metrics, one ``CollectorRegistry`` per app (two apps in one process never share counters).

Request metrics are labelled by the route *template* (``/v1/models/{name}``), never the raw path, so label
cardinality stays bounded; unknown paths share the label ``<unmatched>``.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ntk_service.jobs import JobManager, JobStatus
from ntk_service.kernels import SideCache

__all__ = ["Metrics", "MetricsMiddleware", "CONTENT_TYPE_LATEST"]

UNMATCHED_ROUTE = "<unmatched>"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Seconds: from a health check (ms) to a large kernel (minutes)."""


JOB_STATUSES = tuple(status.value for status in JobStatus)
"""Every status a job can have: each is exported, zeros included, so a dashboard never sees a series vanish."""

_TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class Metrics:
    """The service's collectors, registered on a private registry.

    Args:
        build: labels of ``ntk_build_info`` (``{"version": ..., "torch": ...}``). Default: none exported.
    """

    def __init__(self, build: Mapping[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # process_resident_memory_bytes, process_cpu_seconds_total, open fds, ... (read from /proc when scraped)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        if build:
            Info("ntk_build", "The server's version and the torch it runs on.", registry=self.registry).info(
                dict(build)
            )
        self.requests = Counter(
            "ntk_http_requests",
            "HTTP requests by method, route template and status.",
            ("method", "route", "status"),
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "ntk_http_request_duration_seconds",
            "HTTP request latency by method and route template.",
            ("method", "route"),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.compute_seconds = Histogram(
            "ntk_kernel_compute_seconds",
            "Kernel computation time (engine only, no encoding) by implementation and mode.",
            ("implementation", "mode"),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.computes_in_flight = Gauge(
            "ntk_kernel_computes_in_flight", "Kernel computations running now.", registry=self.registry
        )
        self.computes_waiting = Gauge(
            "ntk_kernel_computes_waiting",
            "Kernel requests waiting for a compute slot.",
            registry=self.registry,
        )
        self.computes_rejected = Counter(
            "ntk_kernel_computes_rejected",
            "Kernel requests refused with 429 (over capacity).",
            registry=self.registry,
        )

    def watch_side_cache(self, cache: SideCache) -> None:
        """Export the side cache's hits and misses (counters) and size (read when scraped)."""
        self.registry.register(_SideCacheCollector(cache))

    def watch_jobs(self, manager: JobManager) -> None:
        """Export jobs by status, tiles done and their compute seconds (read from the job store when scraped)."""
        self.registry.register(_JobsCollector(manager))

    def watch_job_disk(self, read: Callable[[], tuple[int, int | None, int]]) -> None:
        """Export the job results' disk use: ``read()`` gives (used, configured budget or None, available) bytes.

        ``read()`` walks the job store and stats the results folder: it is called once per scrape, from the render
        (which runs in a worker thread, routes/health.py), never on the event loop, and its three numbers come
        from that one reading.
        """
        self.registry.register(_JobDiskCollector(read))

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)


def _or_minus_one(value: int | None) -> float:
    return -1.0 if value is None else float(value)


class _SideCacheCollector(Collector):
    def __init__(self, cache: SideCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Any]:
        cache = self._cache
        yield CounterMetricFamily("ntk_side_cache_hits", "Side-cache lookups that reused a stored side.", cache.hits)
        yield CounterMetricFamily("ntk_side_cache_misses", "Side-cache lookups that computed the side.", cache.misses)
        yield GaugeMetricFamily("ntk_side_cache_bytes", "Bytes held by the side cache.", cache.nbytes)


class _JobDiskCollector(Collector):
    """The three disk gauges of ``Metrics.watch_job_disk`` from one ``read()`` per scrape."""

    _GAUGES = (
        ("ntk_job_results_bytes", "Bytes the stored job results take (finished or not)."),
        ("ntk_job_disk_budget_bytes", "The configured disk budget of job results (-1: 90% of free space)."),
        ("ntk_job_disk_available_bytes", "Bytes a new job result may still take."),
    )

    def __init__(self, read: Callable[[], tuple[int, int | None, int]]) -> None:
        self._read = read

    def describe(self) -> Iterator[Any]:
        # Without describe the registry would call collect (a disk walk) at registration to learn the names.
        for name, doc in self._GAUGES:
            yield GaugeMetricFamily(name, doc)

    def collect(self) -> Iterator[Any]:
        values = self._read()
        for (name, doc), value in zip(self._GAUGES, values, strict=True):
            yield GaugeMetricFamily(name, doc, _or_minus_one(value))


class _JobsCollector(Collector):
    """Reads the job store at scrape time (the render runs off the event loop, see routes/health.py).

    A finished job's tile seconds never change, so they are read once and kept: a scrape reads the tiles of
    unfinished jobs only.
    """

    def __init__(self, manager: JobManager) -> None:
        self._manager = manager
        self._finished_seconds: dict[str, float] = {}

    def collect(self) -> Iterator[Any]:
        records = self._manager.list()
        by_status = Tally(record.status.value for record in records)
        jobs = GaugeMetricFamily("ntk_jobs", "Jobs the server holds, by status.", labels=("status",))
        for status in JOB_STATUSES:
            jobs.add_metric((status,), by_status.get(status, 0))
        yield jobs
        yield GaugeMetricFamily(
            "ntk_job_tiles_done", "Tiles computed and recorded, over all jobs held.", sum(r.tiles_done for r in records)
        )
        yield GaugeMetricFamily(
            "ntk_job_tiles_pending",
            "Tiles of queued or running jobs still to compute.",
            sum(r.tiles_total - r.tiles_done for r in records if r.status.value not in _TERMINAL),
        )
        seconds = 0.0
        for record in records:
            if record.tiles_done == 0:
                continue
            kept = self._finished_seconds.get(record.id)
            if kept is None:
                kept = sum(self._manager.store.tile_seconds(record.id))
                if record.status.value in _TERMINAL:
                    self._finished_seconds[record.id] = kept
            seconds += kept
        yield GaugeMetricFamily(
            "ntk_job_tile_seconds", "Compute seconds of the tiles done, over all jobs held.", seconds
        )


class MetricsMiddleware:
    """Pure ASGI middleware counting every HTTP request by route template and status, timing it."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED_ROUTE
            method = scope.get("method", "")
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.metrics.request_seconds.labels(method, template).observe(time.perf_counter() - start)
