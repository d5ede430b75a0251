"""The embedded executor: panels run in this process, one computation slot at a time per worker.

Each panel runs through ``run_compute``, a function the server supplies that takes the same compute slot
(``ComputeLimiter``) interactive kernel requests take. A job therefore never holds more than one slot per worker
and gives the slot back at every panel boundary (a few seconds of work, ``jobs/panels.py``), so an interactive
request waits at most one panel, and torch's thread pool (sized for ``compute_concurrency`` computations) is never
oversubscribed. Without a server (tests, scripts) panels run directly in the calling thread.

Workers share the registry's cached module: ``compute_ntk`` never computes on the caller's module object itself
(see NOTE [private module] in ``kernels/functional.py``), so concurrent panels and interactive kernels are safe.

Panels are taken in order (by bands, serpentine over the runs), so a band's side is built once and stays in the
job's SideCache while the band's panels run, and the runs' sides are reused from the cache when it is large enough.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import torch
from torch import nn

from ntk_service.jobs.executors.base import (
    Executor,
    JobWork,
    PanelCallbacks,
    PanelOutcome,
    default_side_cache_bytes,
    run_panel,
)
from ntk_service.jobs.panels import Panel
from ntk_service.jobs.results import ResultArray
from ntk_service.kernels import SideCache, parse_device
from ntk_service.kernels.problem.batch import Batch

__all__ = ["LocalExecutor", "RunCompute"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

RunCompute = Callable[[Callable[[], T]], T]
"""Runs a synchronous computation (under the server's compute limiter) and returns its result."""


def _direct(fn: Callable[[], T]) -> T:
    return fn()


class LocalExecutor(Executor):
    """Runs panels in this process.

    Args:
        workers: panels computed at once (threads). Default: 1 (torch already uses every core for one panel).
        run_compute: runs one panel's computation; the server passes one that takes a compute slot.
            Default: call it directly.
        side_cache_bytes: size of the per-job SideCache (``NTK_JOB_SIDE_CACHE_BYTES``). Default: None, a quarter
            of the job's memory budget (``default_side_cache_bytes``).
        device: where panels run, "cpu", "cuda" or "cuda:N" (checked here). Default: "cpu".
        allow_tf32: let float32 panels on CUDA use TF32 (NOTE [TF32] in kernels/runtime/device.py). Default: False.

    Raises:
        UnknownDevice: a device this machine does not have.
    """

    name = "local"

    def __init__(
        self,
        *,
        workers: int = 1,
        run_compute: RunCompute[PanelOutcome] | None = None,
        side_cache_bytes: int | None = None,
        device: torch.device | str = "cpu",
        allow_tf32: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"LocalExecutor: workers must be ≥ 1, got {workers}")
        self.workers = workers
        if side_cache_bytes is not None and side_cache_bytes < 0:
            raise ValueError(f"LocalExecutor: side_cache_bytes must be ≥ 0, got {side_cache_bytes}")
        self.run_compute: RunCompute[PanelOutcome] = run_compute or _direct
        self.side_cache_bytes = side_cache_bytes
        self.device = parse_device(device, operation="LocalExecutor")
        self.allow_tf32 = allow_tf32

    def parallelism(self) -> int:
        """The worker threads."""
        return self.workers

    def run(
        self,
        work: JobWork,
        model: nn.Module,
        x1: Batch,
        x2: Batch | None,
        panels: Sequence[Panel],
        callbacks: PanelCallbacks,
    ) -> None:
        array = ResultArray.open(work.result_path, plan=work.plan)
        size = self.side_cache_bytes
        cache = SideCache(max_bytes=default_side_cache_bytes(work.spec.memory_budget_bytes) if size is None else size)
        options = work.spec.engine_options(device=self.device, allow_tf32=self.allow_tf32)  # once per run
        queue = iter(panels)
        lock = threading.Lock()
        failed = threading.Event()

        def next_panel() -> Panel | None:
            with lock:
                return next(queue, None)

        def worker() -> None:
            while not failed.is_set() and not callbacks.should_stop():
                panel = next_panel()
                if panel is None:
                    return
                claiming = time.perf_counter()
                tiles = callbacks.claim(panel)
                if not tiles:
                    continue
                started = time.perf_counter()
                try:
                    outcome = self.run_compute(
                        partial(
                            run_panel,
                            model,
                            x1,
                            x2,
                            work,
                            panel,
                            tiles,
                            array=array,
                            side_cache=cache,
                            options=options,
                        )
                    )
                except BaseException:
                    failed.set()
                    raise
                returned = time.perf_counter()
                callbacks.done(outcome)
                # The bookkeeping around a panel, at DEBUG (run_panel logs its compute and write seconds).
                logger.debug(
                    "jobs: %s panel %d: claim %.3f s, slot wait + panel %.3f s, record %.3f s",
                    work.job_id,
                    panel.id,
                    started - claiming,
                    returned - started,
                    time.perf_counter() - returned,
                )

        if self.workers == 1:
            worker()
            return
        with ThreadPoolExecutor(self.workers, thread_name_prefix=f"ntk-job-{work.job_id[:8]}") as pool:
            futures = [pool.submit(worker) for _ in range(self.workers)]
        for future in futures:
            future.result()  # re-raises the first failure
