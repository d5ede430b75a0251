"""The solve job: kernel ridge, GP mean or linearized predictions at t = ∞ on stored data sets, by operator CG
(``jobs/solve_job.py``), never forming the kernel. Its folder, ``<results_dir>/solve/<id>/``, holds ``alpha.npy``
(n, k) and ``predictions.npy`` (m, k) once it succeeded, and its ``SolveState`` while it runs.

- **plan**: check the choices and the ridge, resolve the rows, run the model on the first train row (k), check the
  targets' shape against the train rows.
- **run**: ``run_solve`` with each product under a compute slot, progress after every product, and the state
  checkpointed after every CG segment (NOTE [solve resume]); its one tile is the solution, recorded once the arrays
  are written.
- **result**: the arrays and the ``SolveReport``.

NOTE [solve resume]
    After every CG segment the run writes the ``SolveState`` (the iterate x and the segment's report) to
    ``state.npz`` in the job's folder (a new file renamed over the old: never half written), then records the
    progress. A run that starts and finds it goes on from there: the same preconditioner is built again (seeded
    landmarks, the same products), the next segment is warm-started from the same x, exactly as the uninterrupted
    run started it, so no segment done is computed again and the resumed alpha and predictions are bitwise equal to
    an uninterrupted run's with the same torch threads. Only the report's cost counts what the resumed run computed
    again (the preconditioner's products). A solver that keeps other state (issue 38's block methods) adds its
    arrays to the state.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.jobs.kinds.base import JobKind, JobStopped, Layout, PlanContext, RunContext
from ntk_service.jobs.kinds.rows import DataRows, mapped_rows, probe_model, resolve_rows
from ntk_service.jobs.records import JobRecord
from ntk_service.jobs.solve_job import (
    SolveCancelled,
    SolveOptions,
    SolveProblem,
    SolveProgress,
    SolveReport,
    SolveState,
    check_targets,
    parse_problem,
    parse_solve_mode,
    run_solve,
)
from ntk_service.kernels.modes import KernelMode

__all__ = ["SOLVE_KIND", "SolveJobKind", "SolveRequest", "SolveSpec", "read_solution"]

_OPERATION = "solve job"
_STATE = "state.npz"
_REPORT = "report.json"


@dataclass(frozen=True, slots=True)
class SolveRequest:
    """A solve job as asked for (``jobs/solve_job.py`` for the kinds).

    Attributes:
        kind: "kernel_ridge", "gp_mean" or "linearized". model, version: the registered model (None: latest).
        train, targets, test: rows of stored data sets; targets rows must number the train rows, shape (n, k) or
            (n,) for k = 1. test None: no predictions.
        mode, dtype, params, ridge, rtol, max_iterations, preconditioner, landmarks, progress_every,
            examples_per_chunk: as ``SolveOptions`` (None: its default).
    """

    kind: SolveProblem | str
    model: str
    train: DataRows
    targets: DataRows
    test: DataRows | None = None
    version: int | None = None
    mode: KernelMode | str = KernelMode.FULL
    dtype: str = "float64"
    params: Sequence[str] | None = None
    ridge: float = 0.0
    rtol: float = 1e-8
    max_iterations: int | None = None
    preconditioner: str = "auto"
    landmarks: int | None = None
    progress_every: int | None = None
    examples_per_chunk: int | None = None


@dataclass(frozen=True, slots=True)
class SolveSpec:
    """What a solve job computes, resolved at submission (model version, rows, k), and how (its options).

    Attributes:
        model, version: the registered model version.
        train_dataset, train_start, n: the train rows ``[train_start, train_start + n)``.
        targets_dataset, targets_start: y rows ``[targets_start, targets_start + n)``, shape (n, k) or (n,).
        test_dataset, test_start, m: the test rows (None and 0: no test predictions).
        k: outputs per example.
        options: the math of the job (``SolveOptions``), stored flat beside the rows (``to_dict``).
    """

    model: str
    version: int
    train_dataset: str
    train_start: int
    n: int
    targets_dataset: str
    targets_start: int
    test_dataset: str | None
    test_start: int
    m: int
    k: int
    options: SolveOptions

    @property
    def kind(self) -> SolveProblem:
        return self.options.kind

    def to_dict(self) -> dict[str, Any]:
        """The rows and the options in one flat mapping (the stored and public form)."""
        rows = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        return {**rows, **self.options.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SolveSpec:
        names = {f.name for f in fields(SolveOptions)}
        options = SolveOptions.from_dict(data)
        return cls(**{key: value for key, value in data.items() if key not in names}, options=options)


SolveJob = JobRecord[SolveSpec, SolveProgress, SolveReport]


class SolveJobKind(JobKind[SolveRequest, SolveSpec, SolveProgress, SolveReport]):
    """Solve jobs (module docstring)."""

    name: ClassVar[str] = "solve"
    noun: ClassVar[str] = "solve job"
    operation: ClassVar[str] = _OPERATION
    route: ClassVar[str] = "/v1/solve-jobs"
    folder: ClassVar[str] = "solve"
    request_type: ClassVar[type] = SolveRequest
    spec_type: ClassVar[Any] = SolveSpec
    progress_type: ClassVar[Any] = SolveProgress
    result_type: ClassVar[Any] = SolveReport

    def layout(self, spec: SolveSpec) -> Layout:
        return Layout(
            tile_ids=(0,),
            result_shape=(spec.n, spec.k),
            estimate_bytes=(spec.n + spec.m) * spec.k * 8,
            what=f"alpha and predictions ({spec.n} + {spec.m} rows × {spec.k} float64s)",
            fix="use fewer rows, delete finished results, or more disk",
        )

    def plan(self, request: SolveRequest, ctx: PlanContext) -> SolveSpec:
        """Check and resolve a solve job.

        Raises:
            InvalidInput: an unknown kind / mode / preconditioner, a negative or NaN ridge, rows outside a data
                set, a model failing on the first train row. ShapeMismatch: targets that do not match the train
                rows (n, k). ModelNotFound / DatasetNotFound: no such model or data set.
        """
        defaults = {"progress_every": request.progress_every, "examples_per_chunk": request.examples_per_chunk}
        options = SolveOptions(
            kind=parse_problem(request.kind),
            mode=parse_solve_mode(request.mode),
            dtype=request.dtype,
            params=None if request.params is None else tuple(request.params),
            ridge=float(request.ridge),
            rtol=float(request.rtol),
            max_iterations=request.max_iterations,
            preconditioner=request.preconditioner,
            landmarks=request.landmarks,
            memory_budget_bytes=ctx.settings.memory_budget_bytes,
            **{name: int(value) for name, value in defaults.items() if value is not None},
        )
        if not np.isfinite(options.ridge) or options.ridge < 0:
            raise InvalidInput(
                f"{_OPERATION}: ridge must be a finite number ≥ 0, got {request.ridge}; pass e.g. ridge=1e-6"
            )
        x_lo, x_hi = resolve_rows(ctx.datasets, request.train, "train", operation=_OPERATION)
        version, k = probe_model(
            ctx.models, ctx.datasets, request.model, request.version, request.train.dataset, x_lo, operation=_OPERATION
        )
        y_shape = tuple(int(s) for s in ctx.datasets.get(request.targets.dataset).shape)
        y_lo, y_hi = resolve_rows(ctx.datasets, request.targets, "targets", operation=_OPERATION)
        if y_hi - y_lo != x_hi - x_lo:
            raise ShapeMismatch(
                f"{_OPERATION}: targets rows [{y_lo}, {y_hi}) are {y_hi - y_lo} rows, the train rows [{x_lo}, {x_hi}) "
                f"are {x_hi - x_lo}; send one target row per train example"
            )
        check_targets(np.broadcast_to(np.float64(0.0), (x_hi - x_lo, *y_shape[1:])), n=x_hi - x_lo, k=k)
        t_lo = t_hi = 0
        if request.test is not None:
            t_lo, t_hi = resolve_rows(ctx.datasets, request.test, "test", operation=_OPERATION)
        return SolveSpec(
            model=request.model,
            version=version,
            train_dataset=request.train.dataset,
            train_start=x_lo,
            n=x_hi - x_lo,
            targets_dataset=request.targets.dataset,
            targets_start=y_lo,
            test_dataset=None if request.test is None else request.test.dataset,
            test_start=t_lo,
            m=t_hi - t_lo,
            k=k,
            options=options,
        )

    def run(self, job: SolveJob, ctx: RunContext[SolveProgress]) -> SolveReport:
        folder = ctx.folder
        if not ctx.claim([0]):  # the arrays were written and recorded before a crash: the report is beside them
            return SolveReport.from_json(json.loads((folder / _REPORT).read_text()))
        spec = job.spec
        _, module = ctx.models.load_module(spec.model, spec.version)
        train = mapped_rows(ctx.datasets, spec.train_dataset, spec.train_start, spec.n)
        targets = np.asarray(mapped_rows(ctx.datasets, spec.targets_dataset, spec.targets_start, spec.n), np.float64)
        test = (
            None if spec.test_dataset is None else mapped_rows(ctx.datasets, spec.test_dataset, spec.test_start, spec.m)
        )

        def on_segment(state: SolveState) -> None:
            _save_state(folder, state)
            ctx.checkpoint(state.progress)

        started = time.perf_counter()
        try:
            outcome = run_solve(
                spec.options, module, train, targets, test, k=spec.k, should_stop=ctx.should_stop, report=ctx.report,
                run_compute=ctx.run_compute, resume=_load_state(folder), on_segment=on_segment,
            )  # fmt: skip
        except SolveCancelled:
            raise JobStopped from None
        np.save(folder / "alpha.npy", outcome.alpha)
        if outcome.predictions is not None:
            np.save(folder / "predictions.npy", outcome.predictions)
        _replace(folder / _REPORT, json.dumps(outcome.report.to_json()).encode())
        ctx.done([0], elapsed_s=time.perf_counter() - started)
        (folder / _STATE).unlink(missing_ok=True)
        return outcome.report


SOLVE_KIND = SolveJobKind()
"""The solve job kind (its row in ``JOB_KINDS``)."""


def read_solution(folder: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """A succeeded solve job's alpha (n, k) and predictions (m, k) or None."""
    alpha = np.load(folder / "alpha.npy", allow_pickle=False)
    path = folder / "predictions.npy"
    return alpha, np.load(path, allow_pickle=False) if path.exists() else None


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a new file renamed over the old one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def _save_state(folder: Path, state: SolveState) -> None:
    partial = folder / (_STATE + ".partial")
    with partial.open("wb") as file:
        np.savez(file, x=state.x, meta=np.frombuffer(json.dumps(state.to_json()).encode(), dtype=np.uint8))
    os.replace(partial, folder / _STATE)


def _load_state(folder: Path) -> SolveState | None:
    path = folder / _STATE
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as saved:
        return SolveState.from_json(json.loads(saved["meta"].tobytes()), np.array(saved["x"]))
