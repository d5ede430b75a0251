"""What this process is doing with its jobs, beside what the store holds: the runs under way (their pace, for the
ETA) and their live progress, the cancellations, the reads and deletions in progress, a change counter per job that
event streams wait on, and the generation of runs a stop may give up on (NOTE [stop timeout] in runner.py).

One condition guards it all; nothing here is on disk: a restarted process starts with none of it, and the store
says what to resume.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Activity"]


@dataclass
class _Run:
    """The current run of a job: when it started and the tiles it recorded."""

    started: float
    tiles_done: int = 0


class Activity:
    """The in-memory state of the jobs of one process (module docstring); every method is thread-safe."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._versions: dict[str, int] = {}
        self._runs: dict[str, _Run] = {}
        self._live: dict[str, Any] = {}
        self._cancelled: set[str] = set()
        self._readers: dict[str, int] = {}
        self._deleting: set[str] = set()
        self.recording = threading.Lock()
        """Held while a unit is claimed or recorded, and while a stop gives up on the runs out (``give_up``)."""
        self.generation = 0
        """Grows when a stop gives up on the runs out: a run of an older generation records nothing more."""

    # -- events -----------------------------------------------------------------------------------------------------

    def bump(self, job_id: str) -> None:
        """Count a change of the job and wake whoever waits for one."""
        with self._changed:
            self._versions[job_id] = self._versions.get(job_id, 0) + 1
            self._changed.notify_all()

    def version(self, job_id: str) -> int:
        """A counter that grows with every change of the job (a unit done, progress, a status) in this process."""
        with self._changed:
            return self._versions.get(job_id, 0)

    def wait_for_change(self, job_id: str, seen: int, timeout: float) -> int:
        """Block until the job's version exceeds ``seen`` or ``timeout`` seconds pass; returns the version."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._versions.get(job_id, 0) <= seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self._versions.get(job_id, 0)

    # -- runs -------------------------------------------------------------------------------------------------------

    def begin(self, job_id: str) -> None:
        """A run of the job starts."""
        with self._changed:
            self._runs[job_id] = _Run(started=time.monotonic())
        self.bump(job_id)

    def end(self, job_id: str) -> tuple[bool, Any]:
        """The run ends: (whether one was under way, the live progress it reported last, or None); both forgotten."""
        with self._changed:
            run = self._runs.pop(job_id, None)
            return run is not None, self._live.pop(job_id, None) if run is not None else None

    def is_running(self, job_id: str) -> bool:
        with self._changed:
            return job_id in self._runs

    def advance(self, job_id: str, tiles: int) -> None:
        """The run recorded ``tiles`` more tiles."""
        with self._changed:
            run = self._runs.get(job_id)
            if run is not None:
                run.tiles_done += tiles
        self.bump(job_id)

    def eta_s(self, job_id: str, tiles_left: int) -> float | None:
        """Seconds for ``tiles_left`` at this run's pace; None before it recorded a tile (or without a run)."""
        with self._changed:
            run = self._runs.get(job_id)
            if run is None or run.tiles_done == 0:
                return None
            rate = run.tiles_done / max(time.monotonic() - run.started, 1e-9)
        return tiles_left / rate

    def report(self, job_id: str, progress: Any, generation: int) -> None:
        """The run's live progress, unless a stop gave up on its generation (a newer run reports now)."""
        with self._changed:
            if generation != self.generation:
                return
            self._live[job_id] = progress
        self.bump(job_id)

    def live(self, job_id: str) -> Any:
        """The live progress of a run under way, or None."""
        with self._changed:
            return self._live.get(job_id)

    # -- cancellation, reads, deletions -----------------------------------------------------------------------------

    def cancel(self, job_id: str) -> None:
        with self._changed:
            self._cancelled.add(job_id)

    def is_cancelled(self, job_id: str) -> bool:
        with self._changed:
            return job_id in self._cancelled

    @contextmanager
    def reading(self, job_id: str) -> Iterator[None]:
        """Count a read of the job's result for the ``with`` block (a deletion waits for none)."""
        with self._changed:
            self._readers[job_id] = self._readers.get(job_id, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                self._readers[job_id] -= 1
                if not self._readers[job_id]:
                    del self._readers[job_id]

    def begin_deletion(self, job_id: str) -> tuple[str, int] | None:
        """Mark a deletion of the job under way, or say what stands in its way and mark nothing: ("running", 0) a
        run still records, ("deleting", 0) another deletion got there first, ("reading", n) n reads are open."""
        with self._changed:
            if job_id in self._runs:
                return "running", 0
            if job_id in self._deleting:
                return "deleting", 0
            if self._readers.get(job_id):
                return "reading", self._readers[job_id]
            self._deleting.add(job_id)
            return None

    def end_deletion(self, job_id: str) -> None:
        with self._changed:
            self._deleting.discard(job_id)
