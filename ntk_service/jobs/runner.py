"""The runner threads of a JobManager: one per job kind, each taking its kind's queued jobs in order and running
them through the kind's ``run`` with a ``RunContext`` (``kinds/base.py``); the outcome decides the job's status.

- the run returns: succeeded when every tile is recorded (with the kind's result summary), else failed;
- it raises ``JobStopped`` (cancelled, or the server stops): cancelled stays cancelled; a stopped job keeps its
  status and its tiles go back to pending, for the next start (NOTE [resume] in manager.py);
- it raises anything else: failed, with the message.

NOTE [stop timeout]
    A stop that stops waiting for a unit leaves its tiles ``running`` with an attempt counted, and the next start
    would count a second one for the same computation. So the units out then are given up (``give_up``), under the
    lock every record takes: their contexts (of the older generation) record nothing from there on (no tile, no
    progress), and their tiles go back to pending with that attempt taken back. What such a unit still writes is
    overwritten with the same bits by the re-run (NOTE [resume]), and only then recorded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ntk_service.errors import NtkServiceError
from ntk_service.jobs.activity import Activity
from ntk_service.jobs.executors.base import Executor
from ntk_service.jobs.kinds.base import DatasetSource, JobKind, JobLookup, JobStopped, ModelSource, RunCompute
from ntk_service.jobs.records import JobRecord, JobStatus
from ntk_service.jobs.store import JobStore

__all__ = ["Runner"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Record = JobRecord[Any, Any, Any]


class Runner:
    """Runs the queued jobs of every kind, one at a time per kind.

    Args:
        store, kinds, activity: the manager's. folder: a job's result folder.
        models, datasets, executor, run_compute, jobs: what a kind's run is given (``RunContext``).
    """

    def __init__(
        self,
        *,
        store: JobStore,
        kinds: Mapping[str, JobKind[Any, Any, Any, Any]],
        activity: Activity,
        folder: Callable[[Record], Path],
        models: ModelSource,
        datasets: DatasetSource,
        executor: Executor,
        run_compute: RunCompute[Any],
        jobs: JobLookup,
    ) -> None:
        self.store, self.kinds, self.activity, self.folder = store, kinds, activity, folder
        self.models, self.datasets, self.executor, self.run_compute = models, datasets, executor, run_compute
        self.jobs = jobs
        self.stopping = threading.Event()
        self._queues: dict[str, queue.Queue[str]] = {name: queue.Queue() for name in kinds}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self.stopping.clear()
        for name in self.kinds:
            thread = threading.Thread(target=self._loop, args=(name,), name=f"ntk-{name}-jobs", daemon=True)
            thread.start()
            self._threads.append(thread)

    def put(self, record: Record) -> None:
        """Queue a job behind those of its kind."""
        self._queues[record.kind].put(record.id)

    def stop(self, timeout: float | None) -> bool:
        """Stop the threads after their running units; False when one still runs after ``timeout`` seconds (its
        run is then given up: NOTE [stop timeout])."""
        self.stopping.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        stopped = not any(thread.is_alive() for thread in self._threads)
        if not stopped:
            self.give_up()
        self._threads = []
        return stopped

    def give_up(self) -> None:
        """NOTE [stop timeout]."""
        with self.activity.recording:
            self.activity.generation += 1
            for record in self.store.list_jobs(statuses=[JobStatus.RUNNING]):
                self.store.release_running_tiles(record.id, uncount=True)

    @property
    def threads(self) -> list[threading.Thread]:
        """The runner threads (one per kind, named ``ntk-<kind>-jobs``)."""
        return list(self._threads)

    def should_stop(self, job_id: str) -> bool:
        return self.stopping.is_set() or self.activity.is_cancelled(job_id)

    # -- one job ----------------------------------------------------------------------------------------------------

    def _loop(self, kind: str) -> None:
        jobs = self._queues[kind]
        while not self.stopping.is_set():
            try:
                job_id = jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._run(job_id)
            except Exception:  # noqa: BLE001 - the runner must survive anything one job does
                logger.exception("jobs: runner failed on %s", job_id)

    def _run(self, job_id: str) -> None:
        record = self.store.get_job(job_id)
        if record.is_finished or self.activity.is_cancelled(job_id):
            return
        if not self.store.set_status(job_id, JobStatus.RUNNING, only_from=[JobStatus.QUEUED, JobStatus.RUNNING]):
            return
        self.activity.begin(job_id)
        folder = self.folder(record)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            result = self.kinds[record.kind].run(record, _Context(self, record, folder))
        except JobStopped:
            self._end(job_id)
            self._finish(job_id, None)
        except Exception as exc:  # noqa: BLE001 - any failure of a unit fails the job with its message
            self._end(job_id)
            message = exc.message if isinstance(exc, NtkServiceError) else f"{type(exc).__name__}: {exc}"
            if not self.stopping.is_set():
                logger.warning("jobs: %s failed: %s", job_id, message)
                self.store.set_status(job_id, JobStatus.FAILED, error=message)
        else:
            self._end(job_id)
            self._finish(job_id, result)
        finally:
            self._end(job_id)
            self.activity.bump(job_id)

    def _end(self, job_id: str) -> None:
        # Before the final status is set: whoever sees a finished job must not also see its run (``delete`` would
        # answer "its tiles are still finishing" for a job that succeeded), and sees the progress it ended with. A
        # job left for the next start keeps the progress of its last checkpoint instead: the one it resumes from.
        # Nothing writes once the kind's run returned.
        ran, live = self.activity.end(job_id)
        if ran and live is not None and (self.activity.is_cancelled(job_id) or not self.stopping.is_set()):
            self.store.set_checkpoint(job_id, live)

    def _finish(self, job_id: str, result: Any) -> None:
        if self.activity.is_cancelled(job_id):
            return
        if self.stopping.is_set():
            self.store.release_running_tiles(job_id)  # resumed at the next start, see NOTE [resume]
            return
        record = self.store.get_job(job_id)
        if record.tiles_done < record.tiles_total:
            self.store.set_status(
                job_id, JobStatus.FAILED, error=f"{record.tiles_total - record.tiles_done} tile(s) were not computed"
            )
            return
        self.store.set_status(job_id, JobStatus.SUCCEEDED, only_from=[JobStatus.RUNNING], result=result)
        seconds = sum(self.store.tile_seconds(job_id))
        logger.info("jobs: %s succeeded (%d tiles, %.1f tile-seconds)", job_id, record.tiles_total, seconds)


class _Context:
    """The RunContext of one run of one job (``kinds/base.py``): its units claimed and recorded in one transaction
    each, and nothing recorded once a stop gave up on its generation (NOTE [stop timeout])."""

    def __init__(self, runner: Runner, job: Record, folder: Path) -> None:
        self.runner, self.job_id, self.folder = runner, job.id, folder
        self.models, self.datasets, self.executor = runner.models, runner.datasets, runner.executor
        self.jobs = runner.jobs
        self.store, self.activity = runner.store, runner.activity
        self.generation = runner.activity.generation

    def run_compute(self, fn: Callable[[], T]) -> T:
        result: T = self.runner.run_compute(fn)
        return result

    def claim(self, tile_ids: Sequence[int]) -> list[int]:
        with self.activity.recording:
            if self.activity.generation != self.generation:
                return []  # given up by a stop: claim nothing more
            return self.store.claim_tiles(self.job_id, tile_ids)

    def done(self, tile_ids: Sequence[int], *, elapsed_s: float) -> None:
        with self.activity.recording:
            if self.activity.generation != self.generation:
                return  # a stop gave up on this unit and un-counted its attempt
            self.store.mark_tiles_done(self.job_id, tile_ids, elapsed_s=elapsed_s)
        self.activity.advance(self.job_id, len(tile_ids))

    def pending(self) -> list[int]:
        return self.store.pending_tile_ids(self.job_id)

    def report(self, progress: Any) -> None:
        self.activity.report(self.job_id, progress, self.generation)

    def checkpoint(self, progress: Any) -> None:
        with self.activity.recording:
            if self.activity.generation != self.generation:
                return
            self.store.set_checkpoint(self.job_id, progress)
        self.report(progress)

    def used(self, names: Sequence[str]) -> None:
        self.store.set_implementation_used(self.job_id, ",".join(sorted(names)))

    def should_stop(self) -> bool:
        return self.runner.should_stop(self.job_id)
