"""SolveJobs: submit, run, watch, cancel and read the matrix-free jobs: solves (``jobs/solve_job.py``: kernel
ridge, GP mean, linearized at t = ∞ by operator CG) and sketched features (``jobs/features_job.py``: Φ as zarr).

Records live in their own SQLite file, ``<data_dir>/jobs/solve_jobs.sqlite3`` (one row per job: kind, spec,
status, progress, result summary as JSON), results in ``<results_dir>/solve/<id>/``: ``alpha.npy`` and
``predictions.npy`` for a solve, ``features.zarr`` for features, written before the job is marked succeeded. One
runner thread takes queued jobs in order. Neither kind keeps partial state, so a job left queued or running by a
stopped server runs again from the start at the next start (its spec is fixed, so the result is the same).

Results share the kernel jobs' disk budget (``jobs/disk.py``): a job is refused at submission when its result
(Φ: n·k·D values; a solve: (n + m)·k float64s) does not fit, and a finished job's ``delete`` gives its bytes back.

    >>> jobs = SolveJobs(data_dir=tmp, models=registry, datasets=datasets)                  # doctest: +SKIP
    >>> jobs.start()                                                                        # doctest: +SKIP
    >>> job = jobs.submit(kind="kernel_ridge", model="mlp", train=("ds_x", None), targets=("ds_y", None),
    ...                   test=("ds_t", None), ridge=1e-3)                                  # doctest: +SKIP
    >>> jobs.get(job["id"])["progress"]    # {"iterations", "residual", "products", "passes", "elapsed_s"}
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ntk_service.errors import (
    Conflict,
    DiskEstimateExceeded,
    InvalidInput,
    JobNotFinished,
    JobNotFound,
    NtkServiceError,
    ShapeMismatch,
    format_bytes,
)
from ntk_service.jobs.disk import DISK_FREE_FRACTION, ResultBytes, move_aside, tree_bytes
from ntk_service.jobs.features_job import (
    FeaturesCancelled,
    FeaturesSpec,
    check_dim,
    default_rows_per_chunk,
    open_features,
    run_features,
)
from ntk_service.jobs.manager import DatasetSource, ModelSource
from ntk_service.jobs.records import TERMINAL_STATUSES, JobStatus
from ntk_service.jobs.solve_job import (
    PRECONDITIONERS,
    SOLVE_KINDS,
    SOLVE_MODES,
    SolveCancelled,
    SolveOptions,
    SolveSpec,
    check_choice,
    check_targets,
    run_solve,
)
from ntk_service.kernels.sketch.features import DEFAULT_SKETCH, SketchKind

__all__ = ["SolveJobs"]

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS solve_jobs (
    id TEXT PRIMARY KEY, job TEXT NOT NULL, status TEXT NOT NULL, spec TEXT NOT NULL, progress TEXT,
    result TEXT, error TEXT, created_at REAL NOT NULL, started_at REAL, finished_at REAL
)
"""

_OPERATION = "solve job"

JobKind = Literal["solve", "features"]


def _estimate_bytes(job: str, spec: dict[str, Any]) -> int:
    """The bytes a job's result takes on disk at most (zarr compression only makes Φ smaller)."""
    if job == "features":
        return int(spec["n"]) * int(spec["k"]) * int(spec["dim"]) * (8 if spec["dtype"] == "float64" else 4)
    return (int(spec["n"]) + int(spec["m"])) * int(spec["k"]) * 8


def _rows(rows: tuple[int | None, int | None] | None, size: int, side: str) -> tuple[int, int]:
    start, stop = (None, None) if rows is None else rows
    lo, hi = (0 if start is None else int(start)), (size if stop is None else int(stop))
    if not 0 <= lo < hi <= size:
        raise InvalidInput(
            f"{_OPERATION}: {side} rows [{start}, {stop}) are outside the data set of {size} rows; expected "
            f"0 ≤ start < stop ≤ {size}"
        )
    return lo, hi


class SolveJobs:
    """Owns the solve-job table, the runner thread and the result files.

    Args:
        data_dir: the service's data directory. models: ``load_module(name, version)``. datasets: ``get``,
            ``load``, ``path`` (the data set's .npy, read through a memory map).
        results_dir: where results go, ``<results_dir>/solve/<id>/``. Default: ``<data_dir>/jobs``.
        memory_budget_bytes: the budget of one operator product. Default: the engine's default.
        disk_budget_bytes: what all stored results may take together, kernel jobs' included
            (NTK_JOB_DISK_BUDGET_BYTES). Default: ``DISK_FREE_FRACTION`` of the free space less what unfinished
            jobs will still write.
        kernel_results: the kernel jobs' results sharing that budget (stored, still to be written). Default: none.
    """

    def __init__(
        self,
        *,
        data_dir: Path,
        models: ModelSource,
        datasets: DatasetSource,
        results_dir: Path | None = None,
        memory_budget_bytes: int | None = None,
        disk_budget_bytes: int | None = None,
        kernel_results: Callable[[], ResultBytes] | None = None,
    ) -> None:
        self.models, self.datasets, self.memory_budget_bytes = models, datasets, memory_budget_bytes
        self.disk_budget_bytes = disk_budget_bytes
        self._kernel_results = kernel_results or ResultBytes
        jobs_dir = Path(data_dir) / "jobs"
        jobs_dir.mkdir(parents=True, exist_ok=True)
        self.results_dir = Path(results_dir or jobs_dir) / "solve"
        self._db = sqlite3.connect(jobs_dir / "solve_jobs.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._cancelled: set[str] = set()
        self._live: dict[str, dict[str, Any]] = {}  # progress of the running job, newer than its row
        self._versions: dict[str, int] = {}  # grows at every change of a job in this process (event streams)
        self._readers: dict[str, int] = {}  # open reads of a job's stored Φ: its deletion waits (409)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> list[str]:
        """Requeue jobs a stopped server left running and start the runner. Returns the requeued ids."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM solve_jobs WHERE status = ?", (JobStatus.RUNNING.value,)).fetchall()
            self._db.execute(
                "UPDATE solve_jobs SET status = ?, progress = NULL WHERE status = ?",
                (JobStatus.QUEUED.value, JobStatus.RUNNING.value),
            )
        self._thread = threading.Thread(target=self._runner, name="solve-jobs", daemon=True)
        self._thread.start()
        return [r[0] for r in rows]

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop the runner: the running solve stops at its next product and runs again at the next start."""
        self._stopping.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._db.close()

    # -- submit / read ------------------------------------------------------------------------------------------
    def submit(
        self,
        *,
        kind: str,
        model: str,
        train: tuple[str, tuple[int | None, int | None] | None],
        targets: tuple[str, tuple[int | None, int | None] | None],
        test: tuple[str, tuple[int | None, int | None] | None] | None = None,
        version: int | None = None,
        mode: str = "full",
        dtype: str = "float64",
        params: list[str] | None = None,
        ridge: float = 0.0,
        rtol: float = 1e-8,
        max_iterations: int | None = None,
        preconditioner: str = "auto",
        landmarks: int | None = None,
        progress_every: int | None = None,
        examples_per_chunk: int | None = None,
    ) -> dict[str, Any]:
        """Check and queue a solve job (module docstring of ``solve_job.py`` for the kinds).

        Args:
            kind: "kernel_ridge", "gp_mean" or "linearized". model, version: the registered model (None: latest).
            train, targets, test: (data set id, (start, stop) or None for all rows); targets rows must number
                the train rows, shape (n, k) or (n,) for k = 1. test None: no predictions.
            mode: "full" or "trace". dtype: "float32" or "float64" products. params: parameter globs.
            ridge: λ ≥ 0. rtol, max_iterations, preconditioner, landmarks: as ``CgOptions``.
            progress_every, examples_per_chunk: NOTE [solve progress]; ``dataset_operator``.

        Returns:
            dict: the job (``get``), status "queued".

        Raises:
            InvalidInput: an unknown kind / mode / preconditioner, a negative or NaN ridge, rows outside a data
                set, a model failing on the first train row. ShapeMismatch: targets that do not match the
                train rows (n, k). ModelNotFound / DatasetNotFound: no such model or data set.
        """
        check_choice(kind, SOLVE_KINDS, "kind")
        check_choice(mode, SOLVE_MODES, "mode")
        check_choice(preconditioner, PRECONDITIONERS, "preconditioner")
        check_choice(dtype, ("float32", "float64"), "dtype")
        ridge_value = float(ridge)
        if not np.isfinite(ridge_value) or ridge_value < 0:
            raise InvalidInput(f"{_OPERATION}: ridge must be a finite number ≥ 0, got {ridge}; pass e.g. ridge=1e-6")
        x_lo, x_hi = _rows(train[1], int(self.datasets.get(train[0]).shape[0]), "train")
        record_version, k = self._probe(model, version, train[0], x_lo)
        y_shape = tuple(int(s) for s in self.datasets.get(targets[0]).shape)
        y_lo, y_hi = _rows(targets[1], y_shape[0], "targets")
        if y_hi - y_lo != x_hi - x_lo:
            raise ShapeMismatch(
                f"{_OPERATION}: targets rows [{y_lo}, {y_hi}) are {y_hi - y_lo} rows, the train rows [{x_lo}, {x_hi}) "
                f"are {x_hi - x_lo}; send one target row per train example"
            )
        check_targets(np.broadcast_to(np.float64(0.0), (x_hi - x_lo, *y_shape[1:])), n=x_hi - x_lo, k=k)
        t_lo = t_hi = 0
        if test is not None:
            t_lo, t_hi = _rows(test[1], int(self.datasets.get(test[0]).shape[0]), "test")
        options = SolveOptions(
            kind=kind,
            mode=mode,
            dtype=dtype,
            params=params,
            ridge=ridge_value,
            rtol=float(rtol),
            max_iterations=max_iterations,
            preconditioner=preconditioner,
            landmarks=landmarks,
            memory_budget_bytes=self.memory_budget_bytes,
            **({} if progress_every is None else {"progress_every": int(progress_every)}),
            **({} if examples_per_chunk is None else {"examples_per_chunk": int(examples_per_chunk)}),
        )
        spec = SolveSpec(
            model=model,
            version=record_version,
            train_dataset=train[0],
            train_start=x_lo,
            n=x_hi - x_lo,
            targets_dataset=targets[0],
            targets_start=y_lo,
            test_dataset=None if test is None else test[0],
            test_start=t_lo,
            m=t_hi - t_lo,
            k=k,
            options=options,
        )
        return self._queue("solve", self._fits_on_disk("solve", spec.to_dict()))

    def submit_features(
        self,
        *,
        model: str,
        dataset: tuple[str, tuple[int | None, int | None] | None],
        dim: int,
        seed: int = 0,
        version: int | None = None,
        params: list[str] | None = None,
        dtype: str = "float32",
        rows_per_chunk: int | None = None,
        sketch: str = DEFAULT_SKETCH.value,
    ) -> dict[str, Any]:
        """Check and queue a features job: Φ (n, k, D) of the rows, as zarr (``jobs/features_job.py``).

        Args:
            model, version: the registered model (None: latest). dataset: (id, (start, stop) or None).
            dim: D in [1, MAX_FEATURE_DIM]. seed: the sketch (the same seed, D and params: the same Φ anywhere).
            params: parameter globs. dtype: "float32" or "float64". rows_per_chunk: rows per stored chunk.
                Default: about 8 MiB per chunk. sketch: "structured" or "gaussian" (``SketchKind``). Default:
                ``DEFAULT_SKETCH``.

        Returns:
            dict: the queued job.

        Raises:
            InvalidInput: D outside the limits, rows outside the data set, a model failing on the first row.
            ModelNotFound / DatasetNotFound.
        """
        d = check_dim(dim)
        check_choice(dtype, ("float32", "float64"), "dtype")
        check_choice(sketch, tuple(s.value for s in SketchKind), "sketch")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise InvalidInput(f"features job: seed must be an integer in [0, 2**63), got {seed!r}")
        lo, hi = _rows(dataset[1], int(self.datasets.get(dataset[0]).shape[0]), "dataset")
        record_version, k = self._probe(model, version, dataset[0], lo)
        itemsize = 8 if dtype == "float64" else 4
        spec = FeaturesSpec(
            model=model,
            version=record_version,
            dataset=dataset[0],
            start=lo,
            n=hi - lo,
            k=k,
            dim=d,
            seed=seed,
            params=params,
            dtype=dtype,
            rows_per_chunk=int(rows_per_chunk or default_rows_per_chunk(k, d, itemsize)),
            memory_budget_bytes=self.memory_budget_bytes,
            sketch=sketch,
        )
        return self._queue("features", self._fits_on_disk("features", spec.to_dict()))

    # -- disk -----------------------------------------------------------------------------------------------------
    def result_bytes(self) -> ResultBytes:
        """Every job's result at its estimate while its row exists (finished or not: a cancelled or failed job's
        partial files stay until it is deleted), and what the queued and running ones will still write."""
        with self._lock:
            rows = self._db.execute("SELECT id, job, status, spec FROM solve_jobs").fetchall()
            live = dict(self._live)
        stored = unwritten = 0
        for job_id, job, status, spec in rows:
            estimate = _estimate_bytes(job, json.loads(spec))
            stored += estimate
            if status in (JobStatus.QUEUED.value, JobStatus.RUNNING.value):
                done = (live.get(job_id) or {}).get("rows_done", 0) if job == "features" else 0
                total = max(int(json.loads(spec)["n"]), 1)
                unwritten += estimate * (total - min(int(done), total)) // total
        return ResultBytes(stored=stored, unwritten=unwritten)

    def _fits_on_disk(self, job: JobKind, spec: dict[str, Any]) -> dict[str, Any]:
        """``spec`` when its result fits the disk budget; else DiskEstimateExceeded (413) with both numbers."""
        estimate = _estimate_bytes(job, spec)
        ours, kernels = self.result_bytes(), self._kernel_results()
        if self.disk_budget_bytes is not None:
            used = ours.stored + kernels.stored
            available = max(0, self.disk_budget_bytes - used)
            source = "the disk budget (NTK_JOB_DISK_BUDGET_BYTES)"
            if used:
                source += f" of {format_bytes(self.disk_budget_bytes)} less {format_bytes(used)} of stored results,"
        else:
            self.results_dir.mkdir(parents=True, exist_ok=True)
            reserved = ours.unwritten + kernels.unwritten
            available = max(0, int(shutil.disk_usage(self.results_dir).free * DISK_FREE_FRACTION) - reserved)
            source = f"{DISK_FREE_FRACTION:.0%} of the free space in {self.results_dir}"
            if reserved:
                source += f" less {format_bytes(reserved)} that unfinished jobs will still write,"
        if estimate > available:
            what = (
                f"Φ ({spec['n']}, {spec['k']}, {spec['dim']}) in {spec['dtype']}"
                if job == "features"
                else f"alpha and predictions ({spec['n']} + {spec['m']} rows × {spec['k']} float64s)"
            )
            hint = "a smaller dim or fewer rows" if job == "features" else "fewer rows"
            raise DiskEstimateExceeded(
                f"{job} job: {what} needs {format_bytes(estimate)} on disk, more than {source} of "
                f"{format_bytes(available)}; use {hint}, delete finished results, or more disk",
                estimate_bytes=estimate,
                budget_bytes=available,
            )
        return spec

    def delete(self, job_id: str, job: JobKind) -> int:
        """Remove a finished (succeeded, failed or cancelled) job: its result files and its row. Returns the bytes
        freed on disk.

        Raises:
            JobNotFound: no such job of that kind. Conflict: the job is queued or running (cancel it first), or
                its Φ is being read.
        """
        record = self.get(job_id, job)
        with self._lock:
            row = self._db.execute("SELECT status FROM solve_jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise JobNotFound(f"{_OPERATION}: no {job} job {job_id!r}; it was deleted already")
            if row[0] not in {s.value for s in TERMINAL_STATUSES}:
                raise Conflict(f"{_OPERATION}: {job} job {job_id} is {row[0]}; cancel it first, then delete it")
            if self._readers.get(job_id):
                raise Conflict(f"{_OPERATION}: the result of {job} job {job_id} is being read; retry when it is done")
            self._db.execute("DELETE FROM solve_jobs WHERE id = ?", (job_id,))
            self._bump(job_id)
        trash = move_aside(self.results_dir, job_id)  # atomic: from here no reader can open it
        freed = tree_bytes(trash)
        shutil.rmtree(trash, ignore_errors=True)
        logger.info("solve jobs: deleted %s job %s (%s freed)", record["job"], job_id, format_bytes(freed))
        return freed

    def _probe(self, model: str, version: int | None, dataset: str, row: int) -> tuple[int, int]:
        """(the model version, k): the model run on one row, so a wrong data set is a 422 now, not a failed job."""
        record, module = self.models.load_module(model, version)
        first = torch.from_numpy(np.ascontiguousarray(self.datasets.load(dataset, row, row + 1)))
        try:
            with torch.no_grad():
                own = next(iter(module.parameters()), torch.empty(0)).dtype  # the shared module is never cast
                out = module(first.to(own) if first.is_floating_point() else first)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            raise InvalidInput(
                f"{_OPERATION}: the model fails on the first row of data set {dataset!r}: {exc}; check that "
                "the data set matches the model's input shape and dtype"
            ) from exc
        k = int(out.reshape(1, -1).shape[1])
        return int(record.version), k

    def _queue(self, job: str, spec: dict[str, Any]) -> dict[str, Any]:
        job_id = uuid.uuid4().hex
        with self._wake:
            self._db.execute(
                "INSERT INTO solve_jobs (id, job, status, spec, created_at) VALUES (?, ?, ?, ?, ?)",
                (job_id, job, JobStatus.QUEUED.value, json.dumps(spec), time.time()),
            )
            self._bump(job_id)
            self._wake.notify_all()
        return self.get(job_id)

    def get(self, job_id: str, job: Literal["solve", "features"] | None = None) -> dict[str, Any]:
        """The job: id, status, kind, spec, progress, result (the CG report once finished), error, times.

        Args:
            job_id: the id. job: "solve" or "features" to accept only that kind of job. Default: either.

        Raises:
            JobNotFound: no such id (of that kind).
        """
        with self._lock:
            row = self._db.execute(
                "SELECT id, status, spec, progress, result, error, created_at, started_at, finished_at, job "
                "FROM solve_jobs WHERE id = ?",
                (job_id,),
            ).fetchone()
            live = self._live.get(job_id)
        if row is None or (job is not None and row[9] != job):
            kind, route = ("features", "feature-jobs") if job == "features" else ("solve", "solve-jobs")
            raise JobNotFound(f"{_OPERATION}: no {kind} job {job_id!r}; list them with GET /v1/{route}")
        spec = json.loads(row[2])
        progress = live if live is not None else (json.loads(row[3]) if row[3] else None)
        return {
            "id": row[0],
            "job": row[9],
            "status": row[1],
            "kind": spec.get("kind", row[9]),
            "spec": spec,
            "progress": progress,
            "result": json.loads(row[4]) if row[4] else None,
            "error": row[5],
            "created_at": row[6],
            "started_at": row[7],
            "finished_at": row[8],
        }

    def list(self, job: Literal["solve", "features"] = "solve") -> list[dict[str, Any]]:
        """Every job of that kind ("solve" or "features"), newest first."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM solve_jobs WHERE job = ? ORDER BY created_at DESC", (job,))
            ids = [r[0] for r in rows.fetchall()]
        return [self.get(i) for i in ids]

    def version(self, job_id: str) -> int:
        """A counter that grows with every change of the job (queued, started, progress, finished) in this process."""
        with self._lock:
            return self._versions.get(job_id, 0)

    def _bump(self, job_id: str) -> None:
        """Count a change of the job; the caller holds ``self._lock``."""
        self._versions[job_id] = self._versions.get(job_id, 0) + 1

    def cancel(self, job_id: str, job: Literal["solve", "features"] | None = None) -> dict[str, Any]:
        """Cancel a queued or running job (the running solve stops before its next product); a finished job is
        returned unchanged. ``job``: as in ``get``.

        Raises:
            JobNotFound: no such id (of that kind).
        """
        record = self.get(job_id, job)
        if JobStatus(record["status"]) in TERMINAL_STATUSES:
            return record
        with self._lock:
            self._cancelled.add(job_id)
            row = self._db.execute("SELECT status FROM solve_jobs WHERE id = ?", (job_id,)).fetchone()
            if row[0] == JobStatus.QUEUED.value:  # read under the lock: the runner cannot take it meanwhile
                self._finish_row(job_id, JobStatus.CANCELLED, None, None)
        return self.get(job_id)

    def result(self, job_id: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray | None]:
        """(job, alpha (n, k), predictions (m, k) or None) of a succeeded solve job.

        Raises:
            JobNotFound: no such solve job. JobNotFinished: the job has not succeeded (its status in the message).
        """
        job = self._succeeded(job_id, "solve")
        folder = self.results_dir / job_id
        alpha = np.load(folder / "alpha.npy", allow_pickle=False)
        path = folder / "predictions.npy"
        return job, alpha, np.load(path, allow_pickle=False) if path.exists() else None

    @contextmanager
    def features(self, job_id: str) -> Iterator[tuple[dict[str, Any], Any]]:
        """(job, Φ as a read-only zarr array (n, k, D)) of a succeeded features job, for the ``with`` block: a
        deletion of the job waits (409) until the block has ended.

        Raises:
            JobNotFound: no such features job. JobNotFinished: the job has not succeeded.
        """
        with self._lock:
            self._readers[job_id] = self._readers.get(job_id, 0) + 1
        try:
            job = self._succeeded(job_id, "features")
            yield job, open_features(self.results_dir / job_id / "features.zarr")
        finally:
            with self._lock:
                self._readers[job_id] -= 1
                if not self._readers[job_id]:
                    del self._readers[job_id]

    def _succeeded(self, job_id: str, kind: Literal["solve", "features"]) -> dict[str, Any]:
        job = self.get(job_id, kind)
        if job["status"] != JobStatus.SUCCEEDED.value:
            why = f": {job['error']}" if job["error"] else ""
            raise JobNotFinished(
                f"{_OPERATION}: job {job_id} is {job['status']}{why}; its result exists once it has succeeded "
                "(poll GET /v1/solve-jobs/{id} or /v1/feature-jobs/{id})"
            )
        return job

    # -- the runner ---------------------------------------------------------------------------------------------
    def _finish_row(self, job_id: str, status: JobStatus, result: dict[str, Any] | None, error: str | None) -> None:
        self._db.execute(
            "UPDATE solve_jobs SET status = ?, result = ?, error = ?, finished_at = ?, progress = ? WHERE id = ?",
            (
                status.value,
                None if result is None else json.dumps(result),
                error,
                time.time(),
                json.dumps(self._live.pop(job_id, None)),
                job_id,
            ),
        )
        self._bump(job_id)

    def _next(self) -> str | None:
        with self._wake:
            while not self._stopping.is_set():
                row = self._db.execute(
                    "SELECT id FROM solve_jobs WHERE status = ? ORDER BY created_at LIMIT 1", (JobStatus.QUEUED.value,)
                ).fetchone()
                if row is not None:
                    self._db.execute(
                        "UPDATE solve_jobs SET status = ?, started_at = ? WHERE id = ?",
                        (JobStatus.RUNNING.value, time.time(), row[0]),
                    )
                    self._bump(str(row[0]))
                    return str(row[0])
                self._wake.wait(1.0)
        return None

    def _runner(self) -> None:
        while (job_id := self._next()) is not None:
            self._run(job_id)

    def _run(self, job_id: str) -> None:
        job = self.get(job_id)

        def report(progress: dict[str, Any]) -> None:
            with self._lock:
                self._live[job_id] = progress
                self._bump(job_id)

        def should_stop() -> bool:
            return self._stopping.is_set() or job_id in self._cancelled

        folder = self.results_dir / job_id
        try:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            if job["job"] == "features":
                features = FeaturesSpec(**job["spec"])
                _, module = self.models.load_module(features.model, features.version)
                rows = self._rows(features.dataset, features.start, features.n)
                shape = run_features(
                    features, module, rows, folder / "features.zarr", should_stop=should_stop, report=report
                )
                summary: dict[str, Any] = {"shape": list(shape), "seed": features.seed, "dim": features.dim}
            else:
                spec = SolveSpec.from_dict(job["spec"])
                _, module = self.models.load_module(spec.model, spec.version)
                train = self._rows(spec.train_dataset, spec.train_start, spec.n)
                targets = np.asarray(self._rows(spec.targets_dataset, spec.targets_start, spec.n), dtype=np.float64)
                test = None if spec.test_dataset is None else self._rows(spec.test_dataset, spec.test_start, spec.m)
                outcome = run_solve(
                    spec.options, module, train, targets, test, k=spec.k, should_stop=should_stop, report=report
                )
                np.save(folder / "alpha.npy", outcome.alpha)
                if outcome.predictions is not None:
                    np.save(folder / "predictions.npy", outcome.predictions)
                summary = outcome.summary()
        except (SolveCancelled, FeaturesCancelled):
            with self._lock:
                if self._stopping.is_set() and job_id not in self._cancelled:
                    self._db.execute(
                        "UPDATE solve_jobs SET status = ?, progress = NULL WHERE id = ?",
                        (JobStatus.QUEUED.value, job_id),
                    )
                    self._live.pop(job_id, None)
                    self._bump(job_id)
                else:
                    self._finish_row(job_id, JobStatus.CANCELLED, None, None)
            return
        except NtkServiceError as exc:
            with self._lock:
                self._finish_row(job_id, JobStatus.FAILED, None, exc.message)
            return
        except Exception as exc:  # the job fails with the reason; the runner keeps serving other jobs
            logger.exception("solve job %s failed", job_id)
            with self._lock:
                self._finish_row(job_id, JobStatus.FAILED, None, f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            self._finish_row(job_id, JobStatus.SUCCEEDED, summary, None)

    def _rows(self, dataset_id: str, start: int, count: int) -> np.ndarray:
        """Rows ``[start, start + count)`` as a read-only memory map (``dataset_operator`` reads them in chunks)."""
        mapped: np.ndarray = np.load(self.datasets.path(dataset_id), mmap_mode="r", allow_pickle=False)  # type: ignore[attr-defined]
        return mapped[start : start + count]
