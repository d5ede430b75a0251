"""Bounded concurrency for CPU-bound kernel computations.

A computation runs in a worker thread (``anyio.to_thread.run_sync``) so the event loop keeps answering
``/healthz`` and other requests; at most ``concurrency`` run at once (an ``anyio.CapacityLimiter``) and at
most ``max_queue`` more may wait. Beyond that the request is refused at once with ``Busy`` (429 +
``Retry-After``) instead of queueing without bound: a client that retries later is better served than one
whose request times out.

NOTE [threads]: torch's intra-op pool is process-wide; ``configure_torch_threads`` sizes it so that
threads × concurrent computations ≈ cores (measured: two 2-thread computations on 2 cores run slower than one
after the other). numpy's BLAS (OpenBLAS, the analyses' eigh / solves) keeps a pool of its own, one thread per
core by default, whose idle workers busy-wait for the next call: beside torch's threads they took cores a
computation needed. The same call caps that pool at the same share through threadpoolctl (the one portable
handle on it: OpenBLAS reads its environment variables only at load, before settings exist).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
import torch
from threadpoolctl import threadpool_limits

from ntk_service.errors import Busy
from ntk_service.server.metrics import Metrics

__all__ = ["ComputeLimiter", "configure_torch_threads"]

BUSY_WAIT_MAX_S = 0.1
"""The longest a job's unit sleeps before asking again for a slot while the queue is full: interactive requests
go first, and a unit asks again often enough not to leave a freed slot idle (asking is one call on the loop)."""

T = TypeVar("T")

_INITIAL_SECONDS_ESTIMATE = 1.0
"""Guess of one computation's duration before any has finished (used only for Retry-After)."""

_EWMA_WEIGHT = 0.3
"""Weight of the newest duration in the running average behind Retry-After."""


def configure_torch_threads(threads: int) -> None:
    """Set torch's intra-op thread count and numpy's BLAS threads (both process-wide) to ``threads`` per
    computation (NOTE [threads])."""
    torch.set_num_threads(max(1, threads))
    threadpool_limits(limits=max(1, threads), user_api="blas")  # kept: not used as a context manager


class ComputeLimiter:
    """Runs synchronous computations off the event loop, ``concurrency`` at a time, ``max_queue`` waiting.

    Args:
        concurrency: computations allowed to run at once (≥ 1).
        max_queue: requests allowed to wait for a slot; one more is refused with ``Busy``.
        metrics: gauges ``in_flight``/``waiting`` and the rejection counter are kept here.
    """

    def __init__(self, *, concurrency: int, max_queue: int, metrics: Metrics) -> None:
        self.concurrency = concurrency
        self.max_queue = max_queue
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._metrics = metrics
        self._pending = 0  # running + waiting; only touched on the event loop thread, so no lock
        self._mean_seconds = _INITIAL_SECONDS_ESTIMATE

    @property
    def pending(self) -> int:
        """Computations running or waiting right now."""
        return self._pending

    def retry_after_s(self) -> float:
        """Seconds until a slot is likely free: the queue ahead, drained ``concurrency`` at a time."""
        rounds = (self._pending + 1) / self.concurrency
        return max(1.0, math.ceil(rounds * self._mean_seconds))

    async def run(self, fn: Callable[[], T], *, operation: str | None = None) -> T:
        """Run ``fn()`` in a worker thread once a slot is free; return its result (its exceptions propagate).

        Args:
            operation: names the refusal here; None: the route's boundary does (NOTE [operation names] in
                errors.py).

        Raises:
            Busy: ``concurrency`` computations run and ``max_queue`` wait already (429, with Retry-After).
        """
        if self._pending >= self.concurrency + self.max_queue:
            self._metrics.computes_rejected.inc()
            busy = Busy(
                detail="the server is at capacity "
                f"({self.concurrency} computing, {self.max_queue} waiting); "
                f"retry after the Retry-After delay, or send smaller requests",
                retry_after_s=self.retry_after_s(),
            )
            if operation is not None:
                busy.name_operation(operation)
            raise busy
        self._pending += 1
        self._metrics.computes_waiting.inc()
        waiting = True
        try:
            async with self._limiter:
                self._metrics.computes_waiting.dec()
                waiting = False
                self._metrics.computes_in_flight.inc()
                start = time.perf_counter()
                try:
                    return await anyio.to_thread.run_sync(fn)
                finally:
                    elapsed = time.perf_counter() - start
                    self._mean_seconds += _EWMA_WEIGHT * (elapsed - self._mean_seconds)
                    self._metrics.computes_in_flight.dec()
        finally:
            if waiting:
                self._metrics.computes_waiting.dec()
            self._pending -= 1

    def blocking(self, token: Any, *, operation: str) -> Callable[[Callable[[], Any]], Any]:
        """A RunCompute for job threads (not the event loop's): each call takes a slot, waiting for one instead of
        being refused while interactive requests fill the queue (they go first; the unit waits its turn).

        Args:
            token: the event loop's ``anyio.lowlevel.current_token()``, taken in the lifespan.
            operation: names the unit in the limiter's messages, e.g. "job".
        """

        def run(fn: Callable[[], Any]) -> Any:
            while True:
                try:
                    return anyio.from_thread.run(partial(self.run, fn, operation=operation), token=token)
                except Busy as exc:
                    time.sleep(min(exc.retry_after_s, BUSY_WAIT_MAX_S))

        return run
