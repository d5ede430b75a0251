"""JobManager: one lifecycle for jobs of every kind (``jobs/kinds``): submit, run, watch, cancel, delete, resume.

A kind plans a request into a typed spec and runs it; everything around that is here and the same for every kind:
the store (one SQLite file, ``jobs/store.py``), one runner thread per kind taking its queued jobs in order, the
compute slot each unit of work takes (``run_compute``: the server's limiter), progress events, cancellation at a
unit boundary, the shared disk budget, deletion, and resuming what a stopped or killed server left unfinished.
Everything a job needs to resume (its resolved spec, its tiles' states, its kind's checkpoint) is on disk, so a
server killed with SIGKILL loses nothing but the units being computed at that instant.

    >>> manager = JobManager(data_dir=tmp, models=registry, datasets=datasets, executor=LocalExecutor())
    >>> manager.start()                                                           # resumes unfinished jobs
    >>> job = manager.submit(model="mlp", x1_dataset="ds_…", mode="trace")      # a kernel job, queued
    >>> solve = manager.create(SolveRequest(kind="kernel_ridge", model="mlp", …))  # any kind, by its request
    >>> manager.wait_for_change(job.id, seen=0, timeout=1.0)                     # progress events
    >>> manager.read_result(job.id, rows=(0, 128), cols=None).shape               # (128, N) once succeeded

NOTE [resume]
    A unit's tiles move pending → running (``claim_tiles``, one transaction: their attempts are counted) → done
    (``mark_tiles_done``, one transaction, after what they stand for is written). When the server dies, tiles left
    ``running`` are those of the units being computed at that instant; at the next start they go back to pending,
    and each unit holding a tile that is not done runs again, writing only those tiles (a chunk written but not
    recorded is overwritten with the same bits). Done tiles are never recomputed or rewritten. Every unit is
    computed with the same arguments, fixed at submission (a kernel's panel size and memory budget), so the resumed
    result is bitwise equal to an uninterrupted run (NOTE [kind resume] in kinds/base.py for the other kinds).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ntk_service.errors import (
    Conflict,
    JobNotFinished,
    JobNotFound,
    ResultNotFound,
    format_bytes,
)
from ntk_service.jobs.activity import Activity
from ntk_service.jobs.disk import (
    DISK_FREE_FRACTION,
    DiskUsage,
    available_bytes,
    check_fits,
    move_aside,
    stored_bytes,
    sweep_deletions,
    tree_bytes,
)
from ntk_service.jobs.executors.base import Executor
from ntk_service.jobs.kinds import JOB_KINDS
from ntk_service.jobs.kinds.base import (
    DatasetSource,
    JobKind,
    JobSettings,
    ModelSource,
    PlanContext,
    RunCompute,
    direct,
)
from ntk_service.jobs.kinds.kernel import KERNEL_KIND, KernelRequest, plan_of
from ntk_service.jobs.migrations import import_legacy_jobs
from ntk_service.jobs.panels import DEFAULT_PANEL_SECONDS
from ntk_service.jobs.planner import DEFAULT_TILE_SIZE
from ntk_service.jobs.records import JobRecord, JobSpec, JobStatus
from ntk_service.jobs.results import RESULT_GROUP_NAME, ResultArray
from ntk_service.jobs.runner import Runner
from ntk_service.jobs.store import JOBS_DB, JobStore
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.types import NtkImplementation

__all__ = [
    "DISK_FREE_FRACTION",
    "DatasetSource",
    "Deletion",
    "DiskUsage",
    "JobManager",
    "ModelSource",
    "plan_of",
]

logger = logging.getLogger(__name__)

Record = JobRecord[Any, Any, Any]
Kind = JobKind[Any, Any, Any, Any]


@dataclass(frozen=True, slots=True)
class Deletion:
    """What ``JobManager.delete`` did: the job, the bytes freed on disk, and whether the record was kept."""

    job_id: str
    freed_bytes: int
    record_kept: bool


class JobManager:
    """Owns the job store, the runner threads, the executor and the compute slots of every job.

    Args:
        data_dir: the service's data directory; the store is ``<data_dir>/jobs/jobs.sqlite3`` (a store of an
            earlier version, and the solve and features jobs' ``solve_jobs.sqlite3``, are migrated at ``start``).
        models: the model registry (``load_module(name, version)``).
        datasets: the data-set store (``get(id)``, ``load(id, start, stop)``, ``path(id)``).
        executor: LocalExecutor or RayExecutor, for kernel jobs' panels.
        store: the store. Default: ``JobStore(<data_dir>/jobs/jobs.sqlite3)``.
        kinds: the job kinds, by name. Default: ``JOB_KINDS``.
        run_compute: runs one unit of computation of a solve or features job (the server passes one that takes a
            slot of its ComputeLimiter; the local executor takes its own for kernel panels). Default: directly.
        default_tile_size: tile size when a kernel job names none. Default: ``DEFAULT_TILE_SIZE``.
        disk_budget_bytes: what all stored results may take together. Default: ``DISK_FREE_FRACTION`` of the free
            space (less what unfinished jobs will still write).
        memory_budget_bytes: the engine's memory budget per unit of work, fixed into each job at submission.
            Default: a kernel job takes the executor's device's default at submission time
            (``Executor.memory_budget``), a solve or features job the engine's default when it runs.
        results_dir: where results go, ``<results_dir>/<kind's folder>/<job id>/``; on a Ray cluster a filesystem
            every worker mounts at the same path (the SQLite file stays in ``<data_dir>/jobs``: WAL needs a local
            disk). Default: ``<data_dir>/jobs``.
        panel_seconds: the work a kernel panel targets when a job names no ``panel_tiles``
            (``NTK_JOB_PANEL_SECONDS``). Default: ``DEFAULT_PANEL_SECONDS``.
    """

    def __init__(
        self,
        *,
        data_dir: Path,
        models: ModelSource,
        datasets: DatasetSource,
        executor: Executor,
        store: JobStore | None = None,
        kinds: Mapping[str, Kind] = JOB_KINDS,
        run_compute: RunCompute[Any] | None = None,
        default_tile_size: int = DEFAULT_TILE_SIZE,
        disk_budget_bytes: int | None = None,
        memory_budget_bytes: int | None = None,
        results_dir: Path | None = None,
        panel_seconds: float = DEFAULT_PANEL_SECONDS,
    ) -> None:
        if panel_seconds <= 0:
            raise ValueError(f"JobManager: panel_seconds must be > 0, got {panel_seconds}")
        self.panel_seconds = panel_seconds
        self.jobs_dir = Path(data_dir) / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.kinds: dict[str, Kind] = dict(kinds)
        self.store = store if store is not None else JobStore(self.jobs_dir / JOBS_DB, kinds=self.kinds)
        self.results_dir = (self.jobs_dir if results_dir is None else Path(results_dir)).absolute()
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.models = models
        self.datasets = datasets
        self.executor = executor
        self.run_compute: RunCompute[Any] = run_compute or direct
        self.default_tile_size = default_tile_size
        self.disk_budget_bytes = disk_budget_bytes
        self.memory_budget_bytes = memory_budget_bytes
        self._plan_context = PlanContext(
            models=models,
            datasets=datasets,
            executor=executor,
            settings=JobSettings(default_tile_size, panel_seconds, memory_budget_bytes),
            jobs=self,
        )
        self.activity = Activity()
        self._runner = Runner(
            store=self.store,
            kinds=self.kinds,
            activity=self.activity,
            folder=self.folder,
            models=models,
            datasets=datasets,
            executor=executor,
            run_compute=self.run_compute,
            jobs=self,
        )

    # -- lifetime ---------------------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Import the jobs of an earlier version's stores, finish interrupted deletions, bring results of older
        formats up to date, start the runners and re-queue every unfinished job (oldest first); returns the
        resumed ids."""
        import_legacy_jobs(self.store, self.jobs_dir)
        for root in {self._root(kind) for kind in self.kinds.values()}:
            for job_id in sweep_deletions(root):  # a deletion cut off after its rename: the record says it is gone
                self.store.mark_result_deleted(job_id)
        for record in self.store.list_jobs():
            kind = self.kinds[record.kind]
            kind.recover(record, self.folder(record), partial(self.store.done_tile_ids, record.id))
        resumed = []
        unfinished = self.store.list_jobs(statuses=[JobStatus.QUEUED, JobStatus.RUNNING])
        for record in sorted(unfinished, key=lambda r: r.created_at):
            released = self.store.release_running_tiles(record.id)
            self.store.set_status(record.id, JobStatus.QUEUED, only_from=[JobStatus.RUNNING, JobStatus.QUEUED])
            logger.info(
                "jobs: resuming %s job %s at %d/%d tiles (%d interrupted tile(s) to redo)",
                record.kind,
                record.id,
                record.tiles_done,
                record.tiles_total,
                released,
            )
            self._runner.put(record)
            resumed.append(record.id)
        self._runner.start()
        return resumed

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop after the units being computed finish (they are recorded); unfinished jobs resume at next start.

        Args:
            timeout: seconds to wait for those units (None: as long as they take). A unit still computing then is
                given up (NOTE [stop timeout] in runner.py): it is not recorded even if it finishes later, its tiles
                go back to pending without the attempt it counted, and the next start computes them once.
        """
        if not self._runner.stop(timeout):
            logger.warning("jobs: a unit still runs after %.0f s; it will be redone at the next start", timeout)
        self.executor.close()

    # -- submit -----------------------------------------------------------------------------------------------------

    def create(self, request: Any) -> Record:
        """Check, plan and queue a job of the kind whose request ``request`` is (``JobKind.request_type``).

        Returns:
            The queued record.

        Raises:
            What the kind's ``plan`` raises (4xx); DiskEstimateExceeded: the result would not fit the disk budget
            (413, with the estimate).
        """
        kind = next((k for k in self.kinds.values() if isinstance(request, k.request_type)), None)
        if kind is None:
            raise TypeError(f"JobManager.create: no job kind takes a {type(request).__name__}")
        spec = kind.plan(request, self._plan_context)
        layout = kind.layout(spec)
        check_fits(layout, *available_bytes(self.store, self.results_dir, self.disk_budget_bytes), kind.operation)
        job: Record = JobRecord(
            id=uuid.uuid4().hex,
            spec=spec,
            status=JobStatus.QUEUED,
            tiles_done=0,
            tiles_total=len(layout.tile_ids),
            created_at=time.time(),
            started_at=None,
            finished_at=None,
            error=None,
            implementation_used=None,
            executor=self.executor.name if kind.uses_executor else "local",
            result_shape=list(layout.result_shape),
            estimate_bytes=layout.estimate_bytes,
            kind=kind.name,
        )
        folder = self.folder(job)
        folder.mkdir(parents=True)
        kind.create(spec, folder)  # the result's files first: a crash before the row leaves an orphan folder only
        self.store.create_job(job, tile_ids=layout.tile_ids)
        logger.info(
            "jobs: queued %s job %s (%d tiles, %s)",
            kind.name,
            job.id,
            job.tiles_total,
            format_bytes(layout.estimate_bytes),
        )
        self.activity.bump(job.id)
        self._runner.put(job)
        return job

    def submit(
        self,
        *,
        model: str,
        x1_dataset: str,
        version: int | None = None,
        x2_dataset: str | None = None,
        mode: KernelMode | str = KernelMode.FULL,
        implementation: NtkImplementation | str = NtkImplementation.AUTO,
        dtype: str = "float32",
        params: Sequence[str] | None = None,
        tile_size: int | None = None,
        x1_rows: tuple[int, int] | None = None,
        x2_rows: tuple[int, int] | None = None,
        panel_tiles: int | None = None,
        output: str | None = None,
    ) -> JobRecord[JobSpec, None, None]:
        """Check, plan and queue a kernel job: ``create(KernelRequest(...))`` (its fields are documented there).

        Raises:
            ModelNotFound, DatasetNotFound: unknown names (404). InvalidInput and its subclasses: what
            ``KernelKind.plan`` refuses (422). DiskEstimateExceeded: the result would not fit the disk budget (413).
        """
        request = KernelRequest(
            model=model, x1_dataset=x1_dataset, version=version, x2_dataset=x2_dataset, mode=mode,
            implementation=implementation, dtype=dtype, params=params, tile_size=tile_size, x1_rows=x1_rows,
            x2_rows=x2_rows, panel_tiles=panel_tiles, output=output,
        )  # fmt: skip
        return self.create(request)

    # -- read -------------------------------------------------------------------------------------------------------

    def folder(self, job: Record) -> Path:
        """The job's result folder, ``<results_dir>/<kind's folder>/<id>``."""
        return self._root(self.kinds[job.kind]) / job.id

    def _root(self, kind: Kind) -> Path:
        return self.results_dir / kind.folder if kind.folder else self.results_dir

    def get(self, job_id: str, kind: Kind | None = None) -> Record:
        """The job's record (of ``kind``, when given: a job of another kind is not found). Raises JobNotFound."""
        try:
            record = self.store.get_job(job_id)
        except JobNotFound:
            record = None
        if record is None or (kind is not None and record.kind != kind.name):
            shown = kind or KERNEL_KIND
            raise JobNotFound(
                f"{shown.operation}: no {shown.noun} with id {job_id!r}; list {'them' if kind else 'jobs'} with "
                f"GET {shown.route}"
            )
        return record

    def list(self, kind: Kind | None = None) -> list[Record]:
        """Every job (of ``kind``, when given), newest first."""
        return self.store.list_jobs(kind=None if kind is None else kind.name)

    def progress(self, record: Record) -> Any:
        """The kind's progress value of a job: the live one while it runs, else the one last recorded."""
        live = self.activity.live(record.id)
        return live if live is not None else record.checkpoint

    def eta_s(self, record: Record) -> float | None:
        """Seconds left at this run's pace; 0 when finished, None before the first tile of this run."""
        if record.is_finished:
            return 0.0
        return self.activity.eta_s(record.id, record.tiles_total - record.tiles_done)

    def succeeded(self, job_id: str, kind: Kind = KERNEL_KIND) -> tuple[Record, Path]:
        """A succeeded job of ``kind`` and its result folder (read it inside ``reading``).

        Raises:
            JobNotFound: no such job of that kind (404). ResultNotFound: its result was deleted (404).
            JobNotFinished: it has not succeeded (409): queued, running, failed or cancelled.
        """
        record = self.get(job_id, kind)
        if record.result_deleted_at is not None:
            raise ResultNotFound(
                f"{kind.operation}: the result of job {job_id} was deleted (DELETE {kind.route}/{job_id}); submit the "
                "job again to recompute it"
            )
        if record.status is not JobStatus.SUCCEEDED:
            why = f": {record.error}" if record.error else ""
            raise JobNotFinished(
                f"{kind.operation}: job {job_id} is {record.status.value} ({record.tiles_done}/{record.tiles_total} "
                f"tiles){why}; its result can be read once it has succeeded (watch GET {kind.route}/{job_id}/events)"
            )
        return record, self.folder(record)

    def open_result(self, job_id: str) -> tuple[JobRecord[JobSpec, None, None], ResultArray]:
        """The succeeded kernel job's record and its result array.

        Raises:
            JobNotFound (404). JobNotFinished (409). ResultNotFound: the result was deleted, or is not on disk (404).
        """
        record, folder = self.succeeded(job_id, KERNEL_KIND)
        if not (folder / RESULT_GROUP_NAME / "zarr.json").is_file():  # being deleted now, or removed by hand
            raise ResultNotFound(
                f"jobs: the result of job {job_id} is not on disk (deleted while being opened, or removed outside "
                f"the server); delete the job (DELETE /v1/jobs/{job_id}) and submit it again"
            )
        return record, KERNEL_KIND.open_result(record, folder)

    def read_result(
        self, job_id: str, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> np.ndarray:
        """The whole kernel of a succeeded kernel job, or the block ``rows × cols`` (see ``ResultArray.read``)."""
        _, array = self.open_result(job_id)
        return array.read(rows=rows, cols=cols)

    def reading(self, job_id: str) -> AbstractContextManager[None]:
        """Mark a read of the job's result in progress for the ``with`` block: ``delete`` refuses (409) until it
        ends."""
        return self.activity.reading(job_id)

    def disk_usage(self) -> DiskUsage:
        """What the stored results take and what a new job may still take (see ``jobs/disk.py``)."""
        available, _ = available_bytes(self.store, self.results_dir, self.disk_budget_bytes)
        return DiskUsage(
            used_bytes=stored_bytes(self.store), budget_bytes=self.disk_budget_bytes, available_bytes=available
        )

    # -- cancel / delete --------------------------------------------------------------------------------------------

    def cancel(self, job_id: str, kind: Kind | None = None) -> Record:
        """Cancel a queued or running job (its running unit finishes and is kept); a finished job is unchanged.

        Raises:
            JobNotFound: no such job (of ``kind``) (404).
        """
        record = self.get(job_id, kind)
        if record.is_finished:
            return record
        self.activity.cancel(job_id)
        self.store.set_status(job_id, JobStatus.CANCELLED)
        logger.info("jobs: cancelled %s at %d/%d tiles", job_id, record.tiles_done, record.tiles_total)
        self.activity.bump(job_id)
        return self.store.get_job(job_id)

    def delete(self, job_id: str, *, keep_record: bool = False, kind: Kind | None = None) -> Deletion:
        """Remove a finished job's result from disk (and its record, unless ``keep_record``).

        Args:
            job_id: the job. kind: accept only a job of this kind. Default: any.
            keep_record: keep the job's record (its status, spec, times) with ``result_deleted_at`` set.
                Default: False (the job disappears; a later GET is a 404).

        A record kept by an earlier deletion (or by a deletion a crash cut off) is removed by a later one without
        ``keep_record`` (0 bytes freed): otherwise nothing could ever remove it.

        Returns:
            Deletion with the bytes freed on disk.

        Raises:
            JobNotFound: no such job (404), e.g. deleted already.
            ResultNotFound: the result was already deleted and ``keep_record`` asks to keep the record, or a
                concurrent deletion of it is under way (404).
            Conflict: the job is still queued or running (cancel it first), its cancelled unit is still finishing,
                or its result is being read (409).
        """
        record = self.get(job_id, kind)
        owner = self.kinds[record.kind]
        if record.result_deleted_at is not None:
            if keep_record:
                raise ResultNotFound(
                    f"{owner.operation}: the result of job {job_id} was already deleted; nothing to delete"
                )
            self._drop(job_id, owner)
            logger.info("jobs: deleted the record of %s (its result was deleted before)", job_id)
            return Deletion(job_id=job_id, freed_bytes=0, record_kept=False)
        if not record.is_finished:
            raise Conflict(
                f"{owner.operation}: job {job_id} is {record.status.value}; cancel it first (DELETE "
                f"{owner.route}/{job_id} cancels a running job), then delete it"
            )
        blocked = self.activity.begin_deletion(job_id)
        if blocked is not None:
            what, readers = blocked
            if what == "deleting":  # a concurrent DELETE of the same job got here first
                raise ResultNotFound(
                    f"{owner.operation}: the result of job {job_id} is already being deleted; nothing to delete"
                )
            raise Conflict(
                f"{owner.operation}: job {job_id} was cancelled and its running tiles are still finishing; retry in a "
                "moment"
                if what == "running"  # cancelled, but its last unit still finishes writing: wait for it
                else f"{owner.operation}: the result of job {job_id} is being read ({readers} reader(s): downloads, or "
                "running jobs that use it, such as attribution scoring of stored features); retry when they have "
                "finished"
            )
        try:
            trash = move_aside(self._root(owner), job_id)  # atomic: from here no reader can open it
            freed = tree_bytes(trash) if trash.exists() else 0
            if keep_record:
                if not self.store.mark_result_deleted(job_id):
                    raise ResultNotFound(
                        f"{owner.operation}: the result of job {job_id} was already deleted; nothing to delete"
                    )
                self.activity.bump(job_id)
            else:
                self._drop(job_id, owner)
            shutil.rmtree(trash, ignore_errors=True)
        finally:
            self.activity.end_deletion(job_id)
        logger.info("jobs: deleted the result of %s (%s freed)", job_id, format_bytes(freed))
        return Deletion(job_id=job_id, freed_bytes=freed, record_kept=keep_record)

    def _drop(self, job_id: str, kind: Kind) -> None:
        if not self.store.delete_job(job_id):
            raise JobNotFound(f"{kind.operation}: no {kind.noun} with id {job_id!r}; list them with GET {kind.route}")
        self.activity.bump(job_id)

    # -- events -----------------------------------------------------------------------------------------------------

    def version(self, job_id: str) -> int:
        """A counter that grows with every change of the job (a unit done, progress, a status) in this process."""
        return self.activity.version(job_id)

    def wait_for_change(self, job_id: str, seen: int, timeout: float) -> int:
        """Block until the job's version exceeds ``seen`` or ``timeout`` seconds pass; returns the version."""
        return self.activity.wait_for_change(job_id, seen, timeout)
