"""The embedded executor: tiles run in this process, one computation slot at a time per worker.

Each tile runs through ``run_compute``, a function the server supplies that takes the same compute slot
(``ComputeLimiter``) interactive kernel requests take. A job therefore never holds more than one slot per worker
and gives the slot back at every tile boundary, so an interactive request waits at most one tile, and torch's
thread pool (sized for ``compute_concurrency`` computations) is never oversubscribed. Without a server (tests,
scripts) tiles run directly in the calling thread.

Workers share the registry's cached module: ``compute_ntk`` never computes on the caller's module object itself
(see NOTE [private module] in ``kernels/functional.py``), so concurrent tiles and interactive kernels are safe.

Tiles are taken in plan order (rows, serpentine over the columns), so one row block's side stays in the job's
SideCache while its tiles run, and the column sides are reused from the cache when it is large enough.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import torch
from torch import nn

from ntk_service.jobs.executors.base import Executor, JobWork, TileCallbacks, TileOutcome, run_tile
from ntk_service.jobs.planner import Tile
from ntk_service.jobs.results import ResultArray
from ntk_service.kernels import SideCache, parse_device
from ntk_service.kernels.inputs import Batch

__all__ = ["DEFAULT_JOB_SIDE_CACHE_BYTES", "LocalExecutor", "RunCompute"]

T = TypeVar("T")

RunCompute = Callable[[Callable[[], T]], T]
"""Runs a synchronous computation (under the server's compute limiter) and returns its result."""

DEFAULT_JOB_SIDE_CACHE_BYTES = 256 * 2**20
"""256 MiB of per-side intermediates per running job: holds the current row block and the recent column blocks."""


def _direct(fn: Callable[[], T]) -> T:
    return fn()


class LocalExecutor(Executor):
    """Runs tiles in this process.

    Args:
        workers: tiles computed at once (threads). Default: 1 (torch already uses every core for one tile).
        run_compute: runs one tile's computation; the server passes one that takes a compute slot.
            Default: call it directly.
        side_cache_bytes: size of the per-job SideCache. Default: ``DEFAULT_JOB_SIDE_CACHE_BYTES``.
        device: where tiles run, "cpu", "cuda" or "cuda:N" (checked here). Default: "cpu".
        allow_tf32: let float32 tiles on CUDA use TF32 (NOTE [TF32] in kernels/device.py). Default: False.

    Raises:
        UnknownDevice: a device this machine does not have.
    """

    name = "local"

    def __init__(
        self,
        *,
        workers: int = 1,
        run_compute: RunCompute[TileOutcome] | None = None,
        side_cache_bytes: int = DEFAULT_JOB_SIDE_CACHE_BYTES,
        device: torch.device | str = "cpu",
        allow_tf32: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"LocalExecutor: workers must be ≥ 1, got {workers}")
        self.workers = workers
        self.run_compute: RunCompute[TileOutcome] = run_compute or _direct
        self.side_cache_bytes = side_cache_bytes
        self.device = parse_device(device, operation="LocalExecutor")
        self.allow_tf32 = allow_tf32

    def run(
        self,
        work: JobWork,
        model: nn.Module,
        x1: Batch,
        x2: Batch | None,
        tiles: Sequence[Tile],
        callbacks: TileCallbacks,
    ) -> None:
        array = ResultArray.open(work.result_path, plan=work.plan)
        cache = SideCache(max_bytes=self.side_cache_bytes)
        queue = iter(tiles)
        lock = threading.Lock()
        failed = threading.Event()

        def next_tile() -> Tile | None:
            with lock:
                return next(queue, None)

        def worker() -> None:
            while not failed.is_set() and not callbacks.should_stop():
                tile = next_tile()
                if tile is None:
                    return
                if not callbacks.claim(tile):
                    continue
                try:
                    outcome = self.run_compute(
                        partial(
                            run_tile,
                            model,
                            x1,
                            x2,
                            work,
                            tile,
                            array=array,
                            side_cache=cache,
                            device=self.device,
                            allow_tf32=self.allow_tf32,
                        )
                    )
                except BaseException:
                    failed.set()
                    raise
                callbacks.done(outcome)

        if self.workers == 1:
            worker()
            return
        with ThreadPoolExecutor(self.workers, thread_name_prefix=f"ntk-job-{work.job_id[:8]}") as pool:
            futures = [pool.submit(worker) for _ in range(self.workers)]
        for future in futures:
            future.result()  # re-raises the first failure
