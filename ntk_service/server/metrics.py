"""Prometheus metrics, one ``CollectorRegistry`` per app (two apps in one process never share counters).

Request metrics are labelled by the route *template* (``/v1/models/{name}``), never the raw path, so label
cardinality stays bounded; unknown paths share the label ``<unmatched>``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ntk_service.kernels import SideCache

__all__ = ["Metrics", "MetricsMiddleware", "CONTENT_TYPE_LATEST"]

UNMATCHED_ROUTE = "<unmatched>"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Seconds: from a health check (ms) to a large kernel (minutes)."""


class Metrics:
    """The service's collectors, registered on a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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
        """Export the side cache's hits, misses and size (read when scraped)."""
        for name, doc, read in (
            ("ntk_side_cache_hits", "Side-cache lookups that reused a stored side.", lambda: cache.hits),
            ("ntk_side_cache_misses", "Side-cache lookups that had to compute the side.", lambda: cache.misses),
            ("ntk_side_cache_bytes", "Bytes held by the side cache.", lambda: cache.nbytes),
        ):
            Gauge(name, doc, registry=self.registry).set_function(read)

    def watch_job_disk(self, read: Callable[[], tuple[int, int | None, int]]) -> None:
        """Export the job results' disk use: ``read()`` gives (used, configured budget or None, available) bytes."""
        for index, (name, doc) in enumerate(
            (
                ("ntk_job_results_bytes", "Bytes the stored job results take (finished or not)."),
                ("ntk_job_disk_budget_bytes", "The configured disk budget of job results (-1: 90% of free space)."),
                ("ntk_job_disk_available_bytes", "Bytes a new job result may still take."),
            )
        ):
            gauge = Gauge(name, doc, registry=self.registry)
            gauge.set_function(lambda i=index: _or_minus_one(read()[i]))  # type: ignore[misc]

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)


def _or_minus_one(value: int | None) -> float:
    return -1.0 if value is None else float(value)


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
