"""JobManager: submit, run, watch, cancel and resume batch kernel jobs.

One runner thread takes queued jobs in order and hands each job's remaining panels (``jobs/panels.py``) to the
executor (local or Ray); the executor reports every written panel back, and the manager records its tiles in
SQLite in one transaction. Everything a job needs to resume (its resolved spec, its tiles' states) is on disk, so a
server killed with SIGKILL loses nothing but the panels that were being computed at that instant.

    >>> manager = JobManager(data_dir=tmp, models=registry, datasets=datasets, executor=LocalExecutor())
    >>> manager.start()                                                           # resumes unfinished jobs
    >>> job = manager.submit(model="mlp", x1_dataset="ds_…", mode="trace")      # queued, tiles and panels planned
    >>> manager.wait_for_change(job.id, seen=0, timeout=1.0)                     # progress events
    >>> manager.read_result(job.id, rows=(0, 128), cols=None).shape               # (128, N) once succeeded

NOTE [resume]
    A panel's tiles move pending → running (``claim_tiles``, one transaction: their attempts are counted) → done
    (``mark_tiles_done``, one transaction, after all of the panel's chunks are written). When the server dies,
    tiles left ``running`` are those of the panels being computed at that instant; at the next start they go back
    to pending, and each panel holding a tile that is not done runs again, writing only those tiles (a chunk written
    but not recorded is overwritten with the same bits). Done tiles are never recomputed or rewritten. Every panel
    is computed with the same arguments, the panel size and the memory budget fixed at submission, so the resumed
    result is bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from ntk_service.errors import (
    Conflict,
    InvalidInput,
    JobNotFinished,
    JobNotFound,
    NtkServiceError,
    ResultNotFound,
    ShapeMismatch,
    format_bytes,
)
from ntk_service.jobs.disk import (
    DISK_FREE_FRACTION,
    DiskUsage,
    ResultBytes,
    available_bytes,
    check_disk,
    move_aside,
    stored_bytes,
    sweep_deletions,
    tree_bytes,
)
from ntk_service.jobs.executors.base import Executor, JobWork, PanelOutcome
from ntk_service.jobs.panels import (
    DEFAULT_PANEL_SECONDS,
    PANELS_PER_WORKER,
    Panel,
    estimate_panel_flops,
    panel_tiles_for,
)
from ntk_service.jobs.planner import DEFAULT_TILE_SIZE, Tile, TilePlan, plan_tiles
from ntk_service.jobs.records import JobRecord, JobSpec, JobStatus
from ntk_service.jobs.results import RESULT_GROUP_NAME, ResultArray, migrate_legacy
from ntk_service.jobs.store import JobStore
from ntk_service.kernels import compute_ntk
from ntk_service.kernels.modes import KernelMode, parse_mode
from ntk_service.kernels.problem.batch import Batch, embedding_feeds
from ntk_service.kernels.problem.outputs import parse_output, select_output
from ntk_service.kernels.types import NtkImplementation, parse_implementation

__all__ = ["DISK_FREE_FRACTION", "DatasetSource", "Deletion", "DiskUsage", "JobManager", "ModelSource", "plan_of"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": 4, "float64": 8}


@dataclass(frozen=True, slots=True)
class Deletion:
    """What ``JobManager.delete`` did: the job, the bytes freed on disk, and whether the record was kept."""

    job_id: str
    freed_bytes: int
    record_kept: bool


def _rows(rows: tuple[int, int] | None, size: int, side: str) -> tuple[int, int]:
    if rows is None:
        return 0, size
    start, stop = int(rows[0]), int(rows[1])
    if not 0 <= start < stop <= size:
        raise InvalidInput(
            f"jobs: {side} rows ({start}, {stop}) are outside the data set; expected 0 ≤ start < stop ≤ {size}"
        )
    return start, stop


class ModelSource(Protocol):
    """What the manager needs of the model registry."""

    def load_module(self, name: str, version: int | None = None) -> tuple[Any, nn.Module]: ...


class DatasetSource(Protocol):
    """What the manager needs of the data-set store: records with ``shape`` and ``sha256`` (and ``arrays``, each
    with ``name``/``shape``, for named arrays), rows as an array or a dict of named arrays, and the ids check."""

    def get(self, dataset_id: str) -> Any: ...

    def load(
        self, dataset_id: str, start: int | None = None, stop: int | None = None
    ) -> np.ndarray | dict[str, np.ndarray]: ...

    def first_out_of_range(
        self, dataset_id: str, array: str, size: int, start: int, stop: int
    ) -> tuple[int, int] | None: ...


def _check_named_sides(ds1: Any, ds2: Any) -> None:
    """x1's and x2's data sets hold the same named arrays (or both one array), each with one per-example shape."""
    a1, a2 = getattr(ds1, "arrays", None), getattr(ds2, "arrays", None)
    if (a1 is None) != (a2 is None):
        named, single = (ds1, ds2) if a1 is not None else (ds2, ds1)
        raise InvalidInput(
            f"jobs: data set {named.id!r} holds named arrays but {single.id!r} holds one array; give both sides "
            "the same inputs (both named arrays with the same names, or both one array)"
        )
    if a1 is None or a2 is None:
        return
    s1, s2 = {a.name: tuple(a.shape[1:]) for a in a1}, {a.name: tuple(a.shape[1:]) for a in a2}
    missing, extra = sorted(s1.keys() - s2.keys()), sorted(s2.keys() - s1.keys())
    if missing or extra:
        raise InvalidInput(
            f"jobs: x2's data set {ds2.id!r} has names that differ from x1's {ds1.id!r}: missing {missing}, extra "
            f"{extra}; upload x2 with exactly x1's names ({sorted(s1)})"
        )
    for name, shape in s1.items():
        if s2[name] != shape:
            raise ShapeMismatch(
                f"jobs: x2[{name!r}] has per-example shape {s2[name]}, x1[{name!r}] has {shape}; both sides must "
                "have the same per-example shapes"
            )


def _selected_size(module: nn.Module, example: Batch, output: str) -> int:
    """k of a job with ``output=``: the selected tensor's size per example (the model record's output_dim describes
    what forward returns, not the selection)."""
    with torch.no_grad():
        raw = (
            module(**example)
            if isinstance(example, dict)
            else module(*example)
            if isinstance(example, tuple)
            else module(example)
        )
    return int(select_output(raw, parse_output(output, "jobs"), "jobs")[0].numel())


def plan_of(spec: JobSpec) -> TilePlan:
    """The job's TilePlan, recomputed from its spec (the same on every host and after every restart)."""
    return plan_tiles(
        n=spec.n, m=None if spec.is_symmetric else spec.m, tile_size=spec.tile_size, mode=KernelMode(spec.mode)
    )


@dataclass
class _Run:
    """In-memory progress of the current run of a job (for the ETA)."""

    started: float
    tiles_done: int = 0


@dataclass(frozen=True, slots=True)
class _Inputs:
    """A job's data sets as resolved at submission: ids, row ranges (``(start, stop)``) and content hashes."""

    x1_dataset: str
    x2_dataset: str | None
    x1_rows: tuple[int, int]
    x2_rows: tuple[int, int] | None
    x1_sha256: str
    x2_sha256: str | None

    @property
    def n(self) -> int:
        return self.x1_rows[1] - self.x1_rows[0]

    @property
    def m(self) -> int | None:
        return None if self.x2_rows is None else self.x2_rows[1] - self.x2_rows[0]


class _Callbacks:
    """The PanelCallbacks of one job run: a panel is claimed in one transaction and recorded in one."""

    def __init__(self, manager: JobManager, job_id: str, implementations: set[str]) -> None:
        self.manager, self.job_id, self.implementations = manager, job_id, implementations
        self.generation = manager._generation

    def claim(self, panel: Panel) -> tuple[Tile, ...]:
        manager = self.manager
        with manager._recording:
            if manager._generation != self.generation:
                return ()  # given up by a stop (NOTE [stop timeout]): claim nothing more
            claimed = set(manager.store.claim_tiles(self.job_id, [t.id for t in panel.tiles]))
        return tuple(t for t in panel.tiles if t.id in claimed)

    def done(self, outcome: PanelOutcome) -> None:
        manager = self.manager
        with manager._recording:
            if manager._generation != self.generation:
                return  # a stop gave up on this panel and un-counted its attempt: NOTE [stop timeout]
            manager.store.mark_tiles_done(self.job_id, outcome.tile_ids, elapsed_s=outcome.elapsed_s)
        if outcome.implementation not in self.implementations:
            self.implementations.add(outcome.implementation)
            manager.store.set_implementation_used(self.job_id, ",".join(sorted(self.implementations)))
        with manager._lock:
            run = manager._runs.get(self.job_id)
            if run is not None:
                run.tiles_done += len(outcome.tile_ids)
        manager._bump(self.job_id)

    def should_stop(self) -> bool:
        return self.manager._stopping.is_set() or self.manager._is_cancelled(self.job_id)


class JobManager:
    """Owns the job store, the runner thread and the executor.

    Args:
        data_dir: the service's data directory; job state lives in ``<data_dir>/jobs/jobs.sqlite3``.
        models: the model registry (``load_module(name, version)``).
        datasets: the data-set store (``get(id)``, ``load(id, start, stop)``).
        executor: LocalExecutor or RayExecutor.
        default_tile_size: tile size when a job names none. Default: ``DEFAULT_TILE_SIZE``.
        disk_budget_bytes: what all stored results may take together. Default: ``DISK_FREE_FRACTION`` of the free
            space (less what unfinished jobs will still write).
        other_results: the solve and features jobs' results (``SolveJobs.result_bytes``), which share the disk
            budget. Default: none.
        memory_budget_bytes: the engine's memory budget per tile, fixed into each job at submission.
            Default: the executor's device's default at submission time (``Executor.memory_budget``).
        results_dir: where the result groups go, ``<results_dir>/<job id>/result.zarr``; on a Ray cluster a
            filesystem every worker mounts at the same path (the SQLite file stays in ``<data_dir>/jobs``: WAL
            needs a local disk). Default: ``<data_dir>/jobs``.
        panel_seconds: the work a panel targets when a job names no ``panel_tiles`` (``NTK_JOB_PANEL_SECONDS``).
            Default: ``DEFAULT_PANEL_SECONDS``.
    """

    def __init__(
        self,
        *,
        data_dir: Path,
        models: ModelSource,
        datasets: DatasetSource,
        executor: Executor,
        default_tile_size: int = DEFAULT_TILE_SIZE,
        disk_budget_bytes: int | None = None,
        other_results: Callable[[], ResultBytes] | None = None,
        memory_budget_bytes: int | None = None,
        results_dir: Path | None = None,
        panel_seconds: float = DEFAULT_PANEL_SECONDS,
    ) -> None:
        if panel_seconds <= 0:
            raise ValueError(f"JobManager: panel_seconds must be > 0, got {panel_seconds}")
        self.panel_seconds = panel_seconds
        self.jobs_dir = Path(data_dir) / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.store = JobStore(self.jobs_dir / "jobs.sqlite3")
        self.results_dir = (self.jobs_dir if results_dir is None else Path(results_dir)).absolute()
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.models = models
        self.datasets = datasets
        self.executor = executor
        self.default_tile_size = default_tile_size
        self.disk_budget_bytes = disk_budget_bytes
        self._other_results = other_results or ResultBytes
        self.memory_budget_bytes = memory_budget_bytes
        self._queue: queue.Queue[str] = queue.Queue()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._versions: dict[str, int] = {}
        self._runs: dict[str, _Run] = {}
        self._cancelled: set[str] = set()
        self._readers: dict[str, int] = {}
        self._deleting: set[str] = set()
        self._thread: threading.Thread | None = None
        self._recording = threading.Lock()  # a panel's record against a stop that gives up on it
        self._generation = 0  # runs whose panels may still be recorded: NOTE [stop timeout]

    # -- lifetime ---------------------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Migrate results of older versions, finish interrupted deletions, start the runner and re-queue every
        unfinished job (oldest first); returns the resumed ids."""
        self._sweep_deletions()
        self._migrate_legacy_results()
        resumed = []
        for record in sorted(
            self.store.list_jobs(statuses=[JobStatus.QUEUED, JobStatus.RUNNING]), key=lambda r: r.created_at
        ):
            released = self.store.release_running_tiles(record.id)
            self.store.set_status(record.id, JobStatus.QUEUED, only_from=[JobStatus.RUNNING, JobStatus.QUEUED])
            logger.info(
                "jobs: resuming %s at %d/%d tiles (%d interrupted tile(s) to redo)",
                record.id,
                record.tiles_done,
                record.tiles_total,
                released,
            )
            self._queue.put(record.id)
            resumed.append(record.id)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._runner, name="ntk-job-runner", daemon=True)
        self._thread.start()
        return resumed

    def _migrate_legacy_results(self) -> None:
        # Results of versions before the result group (a bare theta.zarr) become groups in place: nothing is copied,
        # nothing is lost; unfinished jobs then resume into the group.
        for record in self.store.list_jobs():
            if record.result_deleted_at is not None:
                continue
            plan = plan_of(record.spec)
            done = {t.id for t in plan.tiles} if record.status is JobStatus.SUCCEEDED else None
            job_dir = self.results_dir / record.id
            if migrate_legacy(
                job_dir,
                plan=plan,
                k=record.spec.k,
                done_tile_ids=done if done is not None else self.store.done_tile_ids(record.id),
                attributes={"job_id": record.id, **record.spec.result_attributes()},
            ):
                logger.info("jobs: migrated the result of %s to the result group format", record.id)

    def _sweep_deletions(self) -> None:
        # A deletion cut off after its rename: finish it (the record, if any, says the result is gone).
        for job_id in sweep_deletions(self.results_dir):
            self.store.mark_result_deleted(job_id)

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop after the panels being computed finish (they are recorded); unfinished jobs resume at next start.

        Args:
            timeout: seconds to wait for those panels (None: as long as they take). A panel still computing then
                is given up (NOTE [stop timeout]): it is not recorded even if it finishes later, its tiles go back
                to pending without the attempt it counted, and the next start computes them once.
        """
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("jobs: a panel still runs after %.0f s; it will be redone at the next start", timeout)
                self._give_up_running()
            self._thread = None
        self.executor.close()

    def _give_up_running(self) -> None:
        # NOTE [stop timeout]
        #     A stop that stops waiting for a panel leaves its tiles ``running`` with an attempt counted, and the
        #     next start would count a second one for the same computation. So the panels out now are given up,
        #     under the lock every record takes: their callbacks (of the current generation) record nothing from
        #     here on, and their tiles go back to pending with that attempt taken back. A chunk such a panel still
        #     writes is overwritten with the same bits by the re-run (NOTE [resume]), and only then recorded.
        with self._recording:
            self._generation += 1
            for record in self.store.list_jobs(statuses=[JobStatus.RUNNING]):
                self.store.release_running_tiles(record.id, uncount=True)

    # -- submit / read ----------------------------------------------------------------------------------------------

    def submit(
        self,
        *,
        model: str,
        x1_dataset: str,
        version: int | None = None,
        x2_dataset: str | None = None,
        mode: str = KernelMode.FULL.value,
        implementation: str = "auto",
        dtype: str = "float32",
        params: list[str] | None = None,
        tile_size: int | None = None,
        x1_rows: tuple[int, int] | None = None,
        x2_rows: tuple[int, int] | None = None,
        panel_tiles: int | None = None,
        output: str | None = None,
    ) -> JobRecord:
        """Validate, plan and queue a job.

        Args:
            model: registered model name. version: its version; None = latest.
            x1_dataset: data set id of x1 (N examples). x2_dataset: data set id of x2 (M examples); None = x1
                (symmetric job: only tiles on and above the diagonal are computed).
            mode, implementation, dtype, params: as for ``compute_ntk``. Default: "full", "auto", "float32", all.
            tile_size: examples per tile side (the storage chunk). Default: the manager's ``default_tile_size``.
            x1_rows, x2_rows: ``(start, stop)`` rows of the data sets to use. Default: all rows.
            panel_tiles: tiles per panel side (the work unit, ``jobs/panels.py``). Default: the cost model's, for
                the manager's ``panel_seconds``.
            output: the ``compute_ntk`` ``output=`` path where the model returns a mapping (e.g. "logits"); k is
                the selected tensor's size per example. Default: None (the model returns a tensor).

        Returns:
            The queued JobRecord.

        Raises:
            ModelNotFound, DatasetNotFound: unknown names (404).
            InvalidInput and its subclasses: bad mode, implementation, dtype, tile size, shapes, parameter globs,
                output path, named arrays that differ between the sides or from the model's inputs (422; a
                one-example probe of ``compute_ntk`` finds these before anything is stored), token ids outside an
                nn.Embedding's vocabulary in any row (every row is checked, in chunks).
            DiskEstimateExceeded: the result would not fit the disk budget (413, with the estimate).
        """
        kernel_mode = parse_mode(mode)
        impl = parse_implementation(implementation)
        if dtype not in _DTYPES:
            raise InvalidInput(f"jobs: dtype {dtype!r} is not supported; use 'float32' or 'float64'")
        if panel_tiles is not None and panel_tiles < 1:
            raise InvalidInput(f"jobs: panel_tiles must be ≥ 1, got {panel_tiles}; omit it for the cost model's")
        parse_output(output, "jobs")
        record, module = self.models.load_module(model, version)
        inputs = self._resolve_inputs(x1_dataset, x2_dataset, x1_rows, x2_rows)
        tile = self.default_tile_size if tile_size is None else tile_size
        plan = plan_tiles(n=inputs.n, m=inputs.m, tile_size=tile, mode=kernel_mode)
        budget = self.memory_budget_bytes if self.memory_budget_bytes is not None else self.executor.memory_budget()
        example = self._probe(module, inputs, kernel_mode, impl.value, dtype, params, budget, output)
        self._check_ids(module, example, inputs)
        k = int(record.output_dim) if output is None else _selected_size(module, example, output)
        estimate = plan.stored_bytes(k, _DTYPES[dtype])
        self._check_disk(estimate, plan)
        if panel_tiles is None:
            panel_tiles = self._panel_tiles(module, example, plan, k, impl, params, dtype, budget, output)
        spec = JobSpec(
            model=record.name,
            version=int(record.version),
            weights_sha256=str(record.weights_sha256),
            x1_dataset=x1_dataset,
            x2_dataset=x2_dataset,
            x1_sha256=inputs.x1_sha256,
            x2_sha256=inputs.x2_sha256,
            n=plan.n,
            m=plan.m,
            k=k,
            mode=kernel_mode.value,
            implementation=impl.value,
            dtype=dtype,
            params=None if params is None else list(params),
            tile_size=plan.tile_size,
            memory_budget_bytes=budget,
            x1_start=inputs.x1_rows[0],
            x2_start=0 if inputs.x2_rows is None else inputs.x2_rows[0],
            output=output,
            panel_tiles=panel_tiles,
        )
        return self._create(spec, plan, estimate)

    def _resolve_inputs(
        self,
        x1_dataset: str,
        x2_dataset: str | None,
        x1_rows: tuple[int, int] | None,
        x2_rows: tuple[int, int] | None,
    ) -> _Inputs:
        """Look up the data sets, check that their examples match and resolve the row ranges."""
        ds1 = self.datasets.get(x1_dataset)
        ds2 = None if x2_dataset is None else self.datasets.get(x2_dataset)
        if ds2 is not None:
            _check_named_sides(ds1, ds2)
        if ds2 is not None and tuple(ds2.shape[1:]) != tuple(ds1.shape[1:]):
            raise ShapeMismatch(
                f"jobs: x2 data set {x2_dataset!r} has examples of shape {tuple(ds2.shape[1:])}, x1 data set "
                f"{x1_dataset!r} has {tuple(ds1.shape[1:])}; both sides must match"
            )
        if ds2 is None and x2_rows is not None:
            raise InvalidInput("jobs: x2 rows given without an x2 data set; name x2's data set too, or omit x2 rows")
        r1 = _rows(x1_rows, int(ds1.shape[0]), "x1")
        r2 = None if ds2 is None else _rows(x2_rows, int(ds2.shape[0]), "x2")
        return _Inputs(
            x1_dataset=x1_dataset,
            x2_dataset=x2_dataset,
            x1_rows=r1,
            x2_rows=r2,
            x1_sha256=str(ds1.sha256),
            x2_sha256=None if ds2 is None else str(ds2.sha256),
        )

    def _panel_tiles(
        self,
        module: nn.Module,
        example: Batch,
        plan: TilePlan,
        k: int,
        implementation: NtkImplementation,
        params: list[str] | None,
        dtype: str,
        budget: int | None,
        output: str | None = None,
    ) -> int:
        """Panel side from the cost model: the engine's FLOP estimate within ``panel_seconds``, the panel's result
        within a quarter of the memory budget, ``PANELS_PER_WORKER`` panels per worker (see ``jobs/panels.py``)."""
        mode = plan.mode

        def flops_of(rows: int, cols: int) -> float:
            return estimate_panel_flops(
                module,
                example,
                rows=rows,
                cols=cols,
                mode=mode,
                implementation=implementation,
                params=params,
                dtype=dtype,
                output=output,
            )

        return panel_tiles_for(
            plan,
            k=k,
            itemsize=_DTYPES[dtype],
            flops_of=flops_of,
            memory_budget_bytes=budget,
            target_s=self.panel_seconds,
            min_panels=PANELS_PER_WORKER * self.executor.parallelism(),
        )

    def _create(self, spec: JobSpec, plan: TilePlan, estimate: int) -> JobRecord:
        """Store a planned job (its result array, then its SQLite rows) and queue it."""
        job = JobRecord(
            id=uuid.uuid4().hex,
            spec=spec,
            status=JobStatus.QUEUED,
            tiles_done=0,
            tiles_total=len(plan.tiles),
            created_at=time.time(),
            started_at=None,
            finished_at=None,
            error=None,
            implementation_used=None,
            executor=self.executor.name,
            result_shape=list(plan.result_shape(spec.k)),
            estimate_bytes=estimate,
        )
        job_dir = self.results_dir / job.id
        job_dir.mkdir(parents=True)
        # The array first: a crash before the SQLite row leaves an orphan directory, never a job without its array.
        attributes = {"job_id": job.id, **spec.result_attributes()}
        ResultArray.create(job_dir / RESULT_GROUP_NAME, plan=plan, k=spec.k, dtype=spec.dtype, attributes=attributes)
        self.store.create_job(job, tile_ids=[t.id for t in plan.tiles])
        logger.info(
            "jobs: queued %s (%s, %d tiles in panels of %d², %s)",
            job.id,
            spec.mode,
            job.tiles_total,
            spec.panel_tiles,
            format_bytes(estimate),
        )
        self._bump(job.id)
        self._queue.put(job.id)
        return job

    def _probe(
        self,
        module: nn.Module,
        inputs: _Inputs,
        mode: KernelMode,
        implementation: str,
        dtype: str,
        params: list[str] | None,
        budget: int | None,
        output: str | None = None,
    ) -> Batch:
        """One example per side: finds wrong shapes, dtypes, parameter globs and unsupported models in milliseconds,
        so the client gets a 422 now instead of a failed job later; named arrays are checked leaf by leaf against
        each other and the model by the library (``validate_inputs``, which names the leaf). Returns x1's first
        example (1, *input), a dict of such leaves for named arrays."""
        x1_start = inputs.x1_rows[0]
        x1 = self._tensor(inputs.x1_dataset, x1_start, x1_start + 1)
        x2 = None
        if inputs.x2_rows is not None and mode.spec.pairs:
            x2 = self._tensor(str(inputs.x2_dataset), inputs.x2_rows[0], inputs.x2_rows[0] + 1)
        try:
            compute_ntk(
                module,
                x1,
                x2,
                mode=mode,
                output=output,
                implementation=implementation,
                params=params,
                dtype=dtype,
                memory_budget_bytes=budget,
            )
        except NtkServiceError:
            raise
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            # The model's own forward pass fails on these examples (wrong feature count, token ids, ...).
            raise InvalidInput(
                f"jobs: the model fails on the first example of data set {inputs.x1_dataset!r}: {exc}; "
                "check that the data set matches the model's input shape and dtype"
            ) from exc
        return x1

    def _result_path(self, job_id: str) -> Path:
        return self.results_dir / job_id / RESULT_GROUP_NAME

    def _tensor(self, dataset_id: str, start: int | None = None, stop: int | None = None) -> Batch:
        rows = self.datasets.load(dataset_id, start, stop)
        if isinstance(rows, dict):  # named arrays: the model's keyword arguments
            return {name: torch.from_numpy(np.ascontiguousarray(leaf)) for name, leaf in rows.items()}
        return torch.from_numpy(np.ascontiguousarray(rows))

    def _check_ids(self, module: nn.Module, example: Batch, inputs: _Inputs) -> None:
        """Every row's token ids inside the vocabulary of the nn.Embedding each named int64 array feeds (found by
        one forward pass on the probe's example), read in chunks through the store's memory map, so a job never
        fails at its last tile for an id its first example did not have."""
        if not isinstance(example, dict):
            return
        with torch.no_grad(), embedding_feeds(module, example) as feeds:
            module(**example)
        sides = [("x1", inputs.x1_dataset, inputs.x1_rows)]
        if inputs.x2_dataset is not None and inputs.x2_rows is not None:
            sides.append(("x2", inputs.x2_dataset, inputs.x2_rows))
        for leaf, (module_name, size) in feeds.tables.items():
            name = leaf[2:-2]  # "['input_ids']" -> "input_ids" (batch.leaves' names)
            for side, dataset_id, (start, stop) in sides:
                bad = self.datasets.first_out_of_range(dataset_id, name, size, start, stop)
                if bad is not None:
                    raise InvalidInput(
                        f"jobs: {side}[{name!r}] (data set {dataset_id!r}) has token id {bad[1]} in row {bad[0]}, "
                        f"outside the vocabulary of nn.Embedding {module_name!r} ({size} ids, 0..{size - 1}); "
                        "upload ids inside the vocabulary"
                    )

    def _check_disk(self, estimate: int, plan: TilePlan) -> None:
        budget = available_bytes(self.store, self.results_dir, self.disk_budget_bytes, self._other_results())
        check_disk(estimate, plan, *budget)

    def get(self, job_id: str) -> JobRecord:
        """The job's record. Raises JobNotFound (404)."""
        return self.store.get_job(job_id)

    def list(self) -> list[JobRecord]:
        """Every job, newest first."""
        return self.store.list_jobs()

    def eta_s(self, record: JobRecord) -> float | None:
        """Seconds left at this run's pace; 0 when finished, None before the first tile of this run."""
        if record.is_finished:
            return 0.0
        with self._lock:
            run = self._runs.get(record.id)
            if run is None or run.tiles_done == 0:
                return None
            rate = run.tiles_done / max(time.monotonic() - run.started, 1e-9)
        return (record.tiles_total - record.tiles_done) / rate

    def cancel(self, job_id: str) -> JobRecord:
        """Cancel a queued or running job (its running tiles finish and are kept); a finished job is unchanged.

        Raises:
            JobNotFound: no such job (404).
        """
        record = self.store.get_job(job_id)
        if record.is_finished:
            return record
        with self._lock:
            self._cancelled.add(job_id)
        self.store.set_status(job_id, JobStatus.CANCELLED)
        logger.info("jobs: cancelled %s at %d/%d tiles", job_id, record.tiles_done, record.tiles_total)
        self._bump(job_id)
        return self.store.get_job(job_id)

    def open_result(self, job_id: str) -> tuple[JobRecord, ResultArray]:
        """The finished job's record and its result array.

        Raises:
            JobNotFound: no such job (404).
            JobNotFinished: the job has not succeeded (409): queued, running, failed or cancelled.
            ResultNotFound: the result was deleted, or is not on disk (404).
        """
        record = self.store.get_job(job_id)
        if record.result_deleted_at is not None:
            raise ResultNotFound(
                f"jobs: the result of job {job_id} was deleted (DELETE /v1/jobs/{job_id}); submit the job again "
                "to recompute it"
            )
        if record.status is not JobStatus.SUCCEEDED:
            why = f": {record.error}" if record.error else ""
            raise JobNotFinished(
                f"jobs: job {job_id} is {record.status.value} ({record.tiles_done}/{record.tiles_total} tiles){why}; "
                "its result can be read once it has succeeded (watch GET /v1/jobs/{id}/events)"
            )
        path = self._result_path(job_id)
        if not (path / "zarr.json").is_file():  # being deleted right now, or removed from disk by hand
            raise ResultNotFound(
                f"jobs: the result of job {job_id} is not on disk (deleted while being opened, or removed outside "
                f"the server); delete the job (DELETE /v1/jobs/{job_id}) and submit it again"
            )
        return record, ResultArray.open(path, plan=plan_of(record.spec))

    @contextmanager
    def reading(self, job_id: str) -> Iterator[None]:
        """Mark a download of the job's result in progress: ``delete`` refuses (409) until it ends."""
        with self._lock:
            self._readers[job_id] = self._readers.get(job_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._readers[job_id] -= 1
                if not self._readers[job_id]:
                    del self._readers[job_id]

    def delete(self, job_id: str, *, keep_record: bool = False) -> Deletion:
        """Remove a finished job's result from disk (and its record, unless ``keep_record``).

        Args:
            job_id: the job.
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
            Conflict: the job is still queued or running (cancel it first), its cancelled tiles are still finishing,
                or its result is being downloaded (409).
        """
        record = self.store.get_job(job_id)
        if record.result_deleted_at is not None:
            if keep_record:
                raise ResultNotFound(f"jobs: the result of job {job_id} was already deleted; nothing to delete")
            if not self.store.delete_job(job_id):
                raise JobNotFound(f"jobs: no job with id {job_id!r}; list jobs with GET /v1/jobs")
            logger.info("jobs: deleted the record of %s (its result was deleted before)", job_id)
            self._bump(job_id)
            return Deletion(job_id=job_id, freed_bytes=0, record_kept=False)
        if not record.is_finished:
            raise Conflict(
                f"jobs: job {job_id} is {record.status.value}; cancel it first (DELETE /v1/jobs/{job_id} cancels a "
                "running job), then delete its result"
            )
        with self._lock:
            if job_id in self._runs:  # cancelled, but its last tiles still finish writing: wait for them
                raise Conflict(
                    f"jobs: job {job_id} was cancelled and its running tiles are still finishing; retry in a moment"
                )
            if job_id in self._deleting:  # a concurrent DELETE of the same job got here first
                raise ResultNotFound(f"jobs: the result of job {job_id} is already being deleted; nothing to delete")
            readers = self._readers.get(job_id, 0)
            if readers:
                raise Conflict(
                    f"jobs: the result of job {job_id} is being downloaded ({readers} download(s)); retry when "
                    "they have finished"
                )
            self._deleting.add(job_id)
        try:
            trash = move_aside(self.results_dir, job_id)  # atomic: from here no reader can open it
            freed = tree_bytes(trash) if trash.exists() else 0
            if keep_record:
                if not self.store.mark_result_deleted(job_id):
                    raise ResultNotFound(f"jobs: the result of job {job_id} was already deleted; nothing to delete")
            elif not self.store.delete_job(job_id):
                raise JobNotFound(f"jobs: no job with id {job_id!r}; list jobs with GET /v1/jobs")
            shutil.rmtree(trash, ignore_errors=True)
        finally:
            with self._lock:
                self._deleting.discard(job_id)
        logger.info("jobs: deleted the result of %s (%s freed)", job_id, format_bytes(freed))
        self._bump(job_id)
        return Deletion(job_id=job_id, freed_bytes=freed, record_kept=keep_record)

    def disk_usage(self) -> DiskUsage:
        """What the stored results take and what a new job may still take (see ``jobs/disk.py``)."""
        other = self._other_results()
        available, _ = available_bytes(self.store, self.results_dir, self.disk_budget_bytes, other)
        return DiskUsage(
            used_bytes=stored_bytes(self.store) + other.stored,
            budget_bytes=self.disk_budget_bytes,
            available_bytes=available,
        )

    def read_result(
        self, job_id: str, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> np.ndarray:
        """The whole kernel of a succeeded job, or the block ``rows × cols`` (see ``ResultArray.read``)."""
        _, array = self.open_result(job_id)
        return array.read(rows=rows, cols=cols)

    # -- events -----------------------------------------------------------------------------------------------------

    def version(self, job_id: str) -> int:
        """A counter that grows with every change of the job (tile done, status change) in this process."""
        with self._lock:
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

    def _bump(self, job_id: str) -> None:
        with self._changed:
            self._versions[job_id] = self._versions.get(job_id, 0) + 1
            self._changed.notify_all()

    def _is_cancelled(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._cancelled

    # -- running ----------------------------------------------------------------------------------------------------

    def _runner(self) -> None:
        while not self._stopping.is_set():
            try:
                job_id = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._run_job(job_id)
            except Exception:  # noqa: BLE001 - the runner must survive anything one job does
                logger.exception("jobs: runner failed on %s", job_id)

    def _run_job(self, job_id: str) -> None:
        record = self.store.get_job(job_id)
        if record.is_finished or self._is_cancelled(job_id):
            return
        if not self.store.set_status(job_id, JobStatus.RUNNING, only_from=[JobStatus.QUEUED, JobStatus.RUNNING]):
            return
        with self._lock:
            self._runs[job_id] = _Run(started=time.monotonic())
        self._bump(job_id)
        spec = record.spec
        try:
            plan = plan_of(spec)
            pending = set(self.store.pending_tile_ids(job_id))
            work = JobWork(job_id=job_id, spec=spec, plan=plan, result_path=self._result_path(job_id))
            panels = [p for p in work.panels() if any(t.id in pending for t in p.tiles)]
            _, module = self.models.load_module(spec.model, spec.version)
            x1 = self._tensor(spec.x1_dataset, spec.x1_start, spec.x1_start + spec.n)
            x2_stop = spec.x2_start + spec.m
            x2 = None if spec.x2_dataset is None else self._tensor(spec.x2_dataset, spec.x2_start, x2_stop)
            used = set((record.implementation_used or "").split(",")) - {""}
            self.executor.run(work, module, x1, x2, panels, _Callbacks(self, job_id, used))
        except Exception as exc:  # noqa: BLE001 - any failure of a tile fails the job with its message
            self._end_run(job_id)
            message = exc.message if isinstance(exc, NtkServiceError) else f"{type(exc).__name__}: {exc}"
            if not self._stopping.is_set():
                logger.warning("jobs: %s failed: %s", job_id, message)
                self.store.set_status(job_id, JobStatus.FAILED, error=message)
        else:
            self._end_run(job_id)
            self._finish(job_id, used)
        finally:
            self._end_run(job_id)
            self._bump(job_id)

    def _end_run(self, job_id: str) -> None:
        # Before the final status is set: whoever sees a finished job must not also see its run (``delete`` would
        # answer "its tiles are still finishing" for a job that succeeded). Nothing writes once executor.run returned.
        with self._lock:
            self._runs.pop(job_id, None)

    def _finish(self, job_id: str, used: set[str]) -> None:
        if self._is_cancelled(job_id):
            return
        if self._stopping.is_set():
            self.store.release_running_tiles(job_id)  # resumed at the next start, see NOTE [resume]
            return
        record = self.store.get_job(job_id)
        if record.tiles_done < record.tiles_total:
            self.store.set_status(
                job_id, JobStatus.FAILED, error=f"{record.tiles_total - record.tiles_done} tile(s) were not computed"
            )
            return
        array = ResultArray.open(self._result_path(job_id), plan=plan_of(record.spec))
        array.update_attributes({"implementation_used": sorted(used)})
        self.store.set_status(job_id, JobStatus.SUCCEEDED, only_from=[JobStatus.RUNNING])
        seconds = sum(self.store.tile_seconds(job_id))
        logger.info("jobs: %s succeeded (%d tiles, %.1f tile-seconds)", job_id, record.tiles_total, seconds)
