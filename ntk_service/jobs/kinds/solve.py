"""The solve job: kernel ridge, GP mean or linearized predictions at t = ∞ on stored data sets, by the solver
table (``jobs/solve_job.py``: ``solve_kernel`` with ``solver`` "auto" by default), never forming a kernel it need
not. Its folder, ``<results_dir>/solve/<id>/``, holds ``alpha.npy`` (n, k) and ``predictions.npy`` (m, k) once it
succeeded, and its last checkpoint (``state.npz``) while it runs.

- **plan**: check the choices and the ridge, resolve the rows (train, targets, test, the held-out inputs and
  targets), run the model on the first train and held-out row (k), check the targets' shapes, and the solver's
  memory estimate against the budget (refused with the estimate in the message).
- **run**: ``run_solve`` with every product, JVP, VJP and kernel block under a compute slot (on Ray: on the shard
  actors of ``ray_ntk_operator``), the progress (the held-out curve included) after every epoch / iteration, and
  every checkpoint stored (NOTE [solve resume]); its one tile is the solution, recorded once the arrays are written.
- **result**: the arrays and the ``SolveReport``.

NOTE [solve resume]
    Each checkpoint of the solver (NOTE [exact resume] in ``analysis/solve/problem.py``: the block method's epochs,
    CG's restarts every ``progress_every`` iterations) is written to ``state.npz`` in the job's folder (α, w where
    the method keeps it, and the counters, curves and generator state as JSON; a new file renamed over the old:
    never half written), then the progress is recorded. A run that starts and finds it goes on from there with
    the same options, so no epoch or segment done is computed again and the resumed alpha and predictions are
    bitwise equal to an uninterrupted run's with the same torch threads. The work a resume repeats is the setup:
    CG's preconditioner, built again the same (seeded), and the method's first look at the problem. A dense solve
    is one step: a kill repeats it.
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
import torch

from ntk_service.analysis.solve.table import check_ridge_positive
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.jobs.executors.ray import RayExecutor
from ntk_service.jobs.kinds.base import JobKind, JobStopped, Layout, PlanContext, RunContext
from ntk_service.jobs.kinds.rows import DataRows, mapped_rows, probe_model, resolve_rows
from ntk_service.jobs.records import JobRecord
from ntk_service.jobs.solve_job import (
    HeldOutRows,
    OperatorFactory,
    SolveCancelled,
    SolveOptions,
    SolveProblem,
    SolveProgress,
    SolveReport,
    SolveState,
    check_heldout_targets,
    check_targets,
    local_operators,
    parse_problem,
    parse_solve_mode,
    run_solve,
    solve_estimate_bytes,
)
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.base import JacobianOperator

__all__ = ["SOLVE_KIND", "HeldOutRequest", "RayOperators", "SolveJobKind", "SolveRequest", "SolveSpec", "read_solution"]

_OPERATION = "solve job"
_STATE = "state.npz"
_REPORT = "report.json"


@dataclass(frozen=True, slots=True)
class HeldOutRequest:
    """A held-out set as asked for: input rows and their targets ((M, k), or (M,) class indices for accuracy), the
    metric ("accuracy" or "mse") reported per epoch, and ``patience`` / ``every`` as ``HeldOut``."""

    inputs: DataRows
    targets: DataRows
    metric: str = "accuracy"
    patience: int | None = None
    every: int = 1


@dataclass(frozen=True, slots=True)
class SolveRequest:
    """A solve job as asked for (``jobs/solve_job.py`` for the kinds).

    Attributes:
        kind: "kernel_ridge", "gp_mean" or "linearized". model, version: the registered model (None: latest).
        train, targets, test: rows of stored data sets; targets rows must number the train rows, shape (n, k) or
            (n,) for k = 1. test None: no predictions.
        mode, dtype, params, ridge, rtol, solver, block_size, inner_steps, max_passes, max_seconds, seed,
            max_iterations, preconditioner, landmarks, progress_every, examples_per_chunk: as ``SolveOptions``
            (None: its default).
        heldout: the held-out set scored per epoch, or None.
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
    rtol: float | None = None
    max_iterations: int | None = None
    preconditioner: str = "auto"
    landmarks: int | None = None
    progress_every: int | None = None
    examples_per_chunk: int | None = None
    solver: str = "auto"
    block_size: int | None = None
    inner_steps: int | None = None
    max_passes: float | None = None
    max_seconds: float | None = None
    seed: int = 0
    heldout: HeldOutRequest | None = None


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
        heldout_dataset, heldout_start, heldout_m: the held-out input rows (None and 0: no held-out set).
        heldout_targets_dataset, heldout_targets_start: their targets' rows.
        estimate_bytes: the solver's memory estimate, checked at submission.
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
    heldout_dataset: str | None = None
    heldout_start: int = 0
    heldout_m: int = 0
    heldout_targets_dataset: str | None = None
    heldout_targets_start: int = 0
    estimate_bytes: int = 0

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
            InvalidInput: an unknown kind / mode / solver / preconditioner / metric, a ridge ≤ 0 or NaN, options
                out of range (block size, rank, rtol under the float32 floor), rows outside a data set, a model
                failing on the first row. ShapeMismatch: targets (or held-out targets) that do not match their rows
                (n, k). ModelNotFound / DatasetNotFound: no such model or data set. MemoryEstimateExceeded: the
                solve's estimate is over the memory budget.
        """
        defaults = {"progress_every": request.progress_every, "examples_per_chunk": request.examples_per_chunk}
        heldout = request.heldout
        options = SolveOptions(
            kind=parse_problem(request.kind),
            mode=parse_solve_mode(request.mode),
            dtype=request.dtype,
            params=None if request.params is None else tuple(request.params),
            ridge=check_ridge_positive(request.ridge, operation=_OPERATION),
            rtol=None if request.rtol is None else float(request.rtol),
            max_iterations=request.max_iterations,
            preconditioner=request.preconditioner,
            landmarks=request.landmarks,
            memory_budget_bytes=ctx.settings.memory_budget_bytes,
            solver=request.solver,
            block_size=request.block_size,
            inner_steps=request.inner_steps,
            max_passes=request.max_passes,
            max_seconds=request.max_seconds,
            seed=request.seed,
            heldout_metric="accuracy" if heldout is None else heldout.metric,
            heldout_patience=None if heldout is None else heldout.patience,
            heldout_every=1 if heldout is None else heldout.every,
            **{name: int(value) for name, value in defaults.items() if value is not None},
        )
        x_lo, x_hi = resolve_rows(ctx.datasets, request.train, "train", operation=_OPERATION)
        n = x_hi - x_lo
        version, k = probe_model(
            ctx.models, ctx.datasets, request.model, request.version, request.train.dataset, x_lo, operation=_OPERATION
        )
        y_lo, y_hi = self._targets(request.targets, n, k, "targets", ctx)
        check_targets(np.broadcast_to(np.float64(0.0), (n, *self._shape(request.targets, ctx)[1:])), n=n, k=k)
        t_lo = t_hi = 0
        if request.test is not None:
            t_lo, t_hi = resolve_rows(ctx.datasets, request.test, "test", operation=_OPERATION)
        held: dict[str, Any] = {}
        if heldout is not None:
            h_lo, h_hi = resolve_rows(ctx.datasets, heldout.inputs, "heldout.inputs", operation=_OPERATION)
            probe_model(ctx.models, ctx.datasets, request.model, version, heldout.inputs.dataset, h_lo,
                        operation=_OPERATION)  # fmt: skip
            g_lo, _ = self._targets(heldout.targets, h_hi - h_lo, k, "heldout.targets", ctx)
            shape = (h_hi - h_lo, *self._shape(heldout.targets, ctx)[1:])
            check_heldout_targets(shape, m=h_hi - h_lo, k=k, metric=options.heldout_metric)
            if options.kind is SolveProblem.LINEARIZED and options.heldout_metric == "accuracy":
                raise InvalidInput(
                    f"{_OPERATION}: heldout.metric 'accuracy' is not available for kind 'linearized' (its "
                    "predictions add the initial outputs f0); use heldout.metric 'mse', or kind 'kernel_ridge'"
                )
            held = {
                "heldout_dataset": heldout.inputs.dataset,
                "heldout_start": h_lo,
                "heldout_m": h_hi - h_lo,
                "heldout_targets_dataset": heldout.targets.dataset,
                "heldout_targets_start": g_lo,
            }
        _, module = ctx.models.load_module(request.model, version)
        train_op = local_operators(module, options)(mapped_rows(ctx.datasets, request.train.dataset, x_lo, n), None)
        estimate = solve_estimate_bytes(options, train_op, n, k)  # raises past the budget, or on bad options
        return SolveSpec(
            model=request.model,
            version=version,
            train_dataset=request.train.dataset,
            train_start=x_lo,
            n=n,
            targets_dataset=request.targets.dataset,
            targets_start=y_lo,
            test_dataset=None if request.test is None else request.test.dataset,
            test_start=t_lo,
            m=t_hi - t_lo,
            k=k,
            options=options,
            estimate_bytes=estimate,
            **held,
        )

    @staticmethod
    def _shape(rows: DataRows, ctx: PlanContext) -> tuple[int, ...]:
        return tuple(int(s) for s in ctx.datasets.get(rows.dataset).shape)

    @staticmethod
    def _targets(rows: DataRows, count: int, k: int, name: str, ctx: PlanContext) -> tuple[int, int]:
        """The rows of targets, one per example of ``count``.

        Raises:
            ShapeMismatch: another number of rows (naming the field).
        """
        lo, hi = resolve_rows(ctx.datasets, rows, name, operation=_OPERATION)
        if hi - lo != count:
            raise ShapeMismatch(
                f"{_OPERATION}: {name} rows [{lo}, {hi}) are {hi - lo} rows, their inputs are {count}; send one "
                "target row per example"
            )
        return lo, hi

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
        heldout = None
        if spec.heldout_dataset is not None and spec.heldout_targets_dataset is not None:
            inputs = mapped_rows(ctx.datasets, spec.heldout_dataset, spec.heldout_start, spec.heldout_m)
            rows = mapped_rows(ctx.datasets, spec.heldout_targets_dataset, spec.heldout_targets_start, spec.heldout_m)
            heldout = HeldOutRows(inputs=inputs, targets=np.asarray(rows, np.float64))

        def on_checkpoint(state: SolveState) -> None:
            _save_state(folder, state)
            ctx.checkpoint(state.progress)

        ray = RayOperators(module, spec.options, ctx.executor) if isinstance(ctx.executor, RayExecutor) else None
        operators: OperatorFactory | None = ray
        started = time.perf_counter()
        try:
            outcome = run_solve(
                spec.options, module, train, targets, test, k=spec.k, heldout=heldout, operators=operators,
                should_stop=ctx.should_stop, report=ctx.report, run_compute=ctx.run_compute,
                resume=_load_state(folder), on_checkpoint=on_checkpoint,
            )  # fmt: skip
        except SolveCancelled:
            raise JobStopped from None
        finally:
            if ray is not None:
                ray.close()
        np.save(folder / "alpha.npy", outcome.alpha)
        if outcome.predictions is not None:
            np.save(folder / "predictions.npy", outcome.predictions)
        _replace(folder / _REPORT, json.dumps(outcome.report.to_json()).encode())
        ctx.done([0], elapsed_s=time.perf_counter() - started)
        (folder / _STATE).unlink(missing_ok=True)
        return outcome.report


class RayOperators:
    """An ``OperatorFactory`` of ``ray_ntk_operator``s on the executor's cluster (w replicated through the object
    store, every block's work on the shard actors: NOTE [parameter-space blocks]); ``close`` ends their actors."""

    def __init__(self, module: Any, options: SolveOptions, executor: RayExecutor) -> None:
        self.module, self.options, self.executor = module, options, executor
        self.built: list[Any] = []

    def __call__(self, x1: Any, x2: Any) -> JacobianOperator:
        from ntk_service.jobs.executors.ray_operator import DEFAULT_SHARDS, ray_ntk_operator

        o = self.options
        op = ray_ntk_operator(
            self.module, _tensor(x1), None if x2 is None else _tensor(x2),
            shards=self.executor.actors or DEFAULT_SHARDS, mode=o.mode, params=o.params, dtype=o.torch_dtype,
            num_cpus=self.executor.num_cpus, memory_budget_bytes=o.memory_budget_bytes,
            examples_per_chunk=o.examples_per_chunk, address=self.executor.address,
        )  # fmt: skip
        self.built.append(op)
        return op

    def close(self) -> None:
        for op in self.built:
            op.close()


def _tensor(rows: Any) -> torch.Tensor:
    """Rows of a data set (a memory map) in memory, for shipping to the shard actors."""
    return torch.from_numpy(np.array(rows))


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
    weights = state.solver.weights
    meta = np.frombuffer(json.dumps(state.to_json()).encode(), dtype=np.uint8)
    with partial.open("wb") as file:  # no weights: an empty array (a method that keeps no w)
        np.savez(file, meta=meta, solution=state.solver.solution, weights=np.zeros(0) if weights is None else weights)
    os.replace(partial, folder / _STATE)


def _load_state(folder: Path) -> SolveState | None:
    """The last checkpoint, or None (none written, or one of the CG path before the solver table: that job
    starts again from zero, which costs time and changes nothing of its answer's guarantee)."""
    path = folder / _STATE
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as saved:
        if "solution" not in saved.files:
            return None
        weights = np.array(saved["weights"]) if saved["weights"].size else None
        return SolveState.from_json(json.loads(saved["meta"].tobytes()), np.array(saved["solution"]), weights)
