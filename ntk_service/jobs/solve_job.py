"""Solves on stored data sets: kernel ridge, GP mean or linearized predictions at t = ∞, by the solver table.

A solve never forms a kernel it need not. The train kernel is ``dataset_operator`` over the train rows (read in
chunks from the data set's memory map; ``ray_ntk_operator`` over shard actors where the job runs on Ray), and
``solve_kernel`` solves (Θ + λI) α = y − f0 on it with ``solver`` ("auto" by default: NOTE [auto rule] in
``analysis/solve/table.py``; "dense", "pcg", "block"). Test predictions are J(x*) w, one JVP over the test rows,
when the parameter-space method left w = Jᵀα, else f0* + Θ(test, train) α, one more streamed product. A held-out
set (inputs and targets) is scored per epoch (CG: per iteration), accuracy or MSE, and may stop the solve
(``patience``). Memory is what the solver estimates, O(P + N·k + its preconditioner), checked against the budget
before anything runs. ``run_solve`` runs one: a solve job's (``jobs/kinds/solve.py``) or an inline request's
(``POST /v1/models/{name}/solve``).

    kernel_ridge   α = (Θ + λI)⁻¹ y,                predictions = Θ* α
    gp_mean        the same system: the NTK-GP posterior mean with noise variance λ (zero prior mean)
    linearized     α = (Θ + λI)⁻¹ (y − f0),         predictions = f0* + Θ* α: the linearized network trained to
                   t = ∞ by gradient flow on the MSE with weight decay read as λ, from its initial outputs f0
                   (Lee et al. 2019)

A TRACE solve reads the kernel as (Θ_trace / k) ⊗ I_k, as ``gp_inference`` does (NOTE [operator layout] in
``analysis/solve/operators.py``).

Its values are typed and grow by fields with defaults: ``SolveOptions`` (what and how), ``SolveProgress`` (while it
runs), ``SolveState`` (a checkpoint: what a resumed job goes on from) and ``SolveReport`` (the summary of a
finished solve); each reads the JSON of an earlier version (absent fields take their defaults, unknown ones are
dropped).

NOTE [solve progress]
    The solver reports after every epoch (block) or iteration (CG); each report is published as the job's live
    progress (the held-out curve so far included), and each report that is a checkpoint (NOTE [exact resume] in
    ``analysis/solve/problem.py``: the block method's epochs, CG's restarts every ``progress_every`` iterations)
    is handed to ``on_checkpoint`` to store. Every product, JVP, VJP and kernel block runs under ``run_compute``
    (a job's compute slot), after a check of ``should_stop``, so a cancel takes effect within one of them.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, TypeVar, cast

import numpy as np
import torch
from torch import nn

from ntk_service.analysis.solve import (
    DEFAULT_LANDMARKS,
    Attempt,
    CgOptions,
    HeldOut,
    Progress,
    SolverOptions,
    SolverResult,
    SolverState,
    kernel_operator,
    solve_kernel,
)
from ntk_service.analysis.solve.table import check_ridge_positive, solve_memory_bytes
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.base import JacobianOperator, LinearOperator, Ranges
from ntk_service.kernels.operators.streaming_operator import DEFAULT_EXAMPLES_PER_CHUNK, dataset_operator

__all__ = [
    "DEFAULT_PROGRESS_EVERY",
    "HELDOUT_METRICS",
    "PRECONDITIONERS",
    "SOLVE_KINDS",
    "SOLVE_MODES",
    "SOLVER_NAMES",
    "HeldOutRows",
    "SolveCancelled",
    "SolveOptions",
    "SolveOutcome",
    "SolveProblem",
    "SolveProgress",
    "SolveReport",
    "SolveState",
    "check_choice",
    "check_targets",
    "parse_problem",
    "parse_solve_mode",
    "run_solve",
    "solver_options",
]

T = TypeVar("T")

PreconditionerName = Literal["auto", "nystrom", "none"]

_OPERATION = "solve job"


class SolveProblem(StrEnum):
    """What a solve computes (its ``kind`` on the wire; module docstring)."""

    KERNEL_RIDGE = "kernel_ridge"
    GP_MEAN = "gp_mean"
    LINEARIZED = "linearized"


SOLVE_KINDS = tuple(p.value for p in SolveProblem)
"""The wire values of ``SolveProblem``."""

SOLVE_MODES = (KernelMode.FULL.value, KernelMode.TRACE.value)
"""The kernel modes a solve runs on (the operator modes)."""

SOLVER_NAMES = ("auto", "dense", "pcg", "block", "cg", "direct")
"""The solvers of the table (``SOLVERS``) and their older names ("cg" is "pcg", "direct" is "dense")."""

PRECONDITIONERS = ("auto", "nystrom", "none")
"""As ``CgOptions.preconditioner`` ("auto": the adaptive Nyström factor from the model, NOTE [pcg solver])."""

HELDOUT_METRICS = ("accuracy", "mse")
"""As ``HeldOut.metric``."""

DEFAULT_PROGRESS_EVERY = 200
"""CG iterations between restarts, each a checkpoint a killed job resumes from (NOTE [solve progress]). A restart
drops the Krylov space: on a tiny tanh MLP (N = 20, k = 3, FULL, ridge 1e-3, condition ≈ 4·10⁴) one CG run
converged in 191 iterations, while segments of 5 had not reached a residual below 0.9 after 600; 200 keeps most
solves at one or two segments."""


class SolveCancelled(Exception):  # noqa: N818 - a signal: the caller's should_stop() turned true
    """Raised inside a running solve when its ``should_stop()`` turned true (never leaves the job engine)."""


def check_choice(value: str, allowed: Sequence[str], what: str) -> str:
    """``value`` if allowed, else InvalidInput naming the choices (for callers that bypass the HTTP schema)."""
    if value not in allowed:
        raise InvalidInput(f"{_OPERATION}: unknown {what} {value!r}; expected one of {', '.join(allowed)}")
    return value


def parse_problem(value: SolveProblem | str) -> SolveProblem:
    """The SolveProblem of ``value`` or its wire value. Raises InvalidInput naming the choices."""
    return SolveProblem(check_choice(str(value), SOLVE_KINDS, "kind"))


def parse_solve_mode(value: KernelMode | str) -> KernelMode:
    """FULL or TRACE, from the mode or its wire value. Raises InvalidInput naming the choices."""
    return KernelMode(check_choice(str(value), SOLVE_MODES, "mode"))


def _known(cls: type[Any], data: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``data`` that are fields of ``cls`` (JSON of another version may have fewer or more)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {key: value for key, value in data.items() if key in names}


@dataclass(frozen=True, slots=True)
class SolveOptions:
    """What a solve computes and how, whatever its rows come from (a job's data sets, an inline request).

    Attributes:
        kind (SolveProblem): a wire value is accepted. mode (KernelMode): FULL or TRACE.
        dtype: the products' dtype ("float32" / "float64"). params: parameter-name globs (a tuple), None = all.
        ridge: λ > 0 (absolute). solver: a name of ``SOLVER_NAMES``. Default: "auto".
        rtol: the true relative residual to stop at; None: the library's default for the products' dtype (1e-8
            float64, 1e-4 float32; NOTE [float32 floor]).
        max_iterations, preconditioner: CG's (``CgOptions``) when "pcg" runs. landmarks: the Nyström rank cap
            (pcg) or landmark examples per block (block). block_size, inner_steps, seed, max_passes, max_seconds:
            as ``SolverOptions``.
        progress_every: CG iterations between checkpoints (NOTE [solve progress]).
        heldout_metric, heldout_patience, heldout_every: as ``HeldOut`` (used when held-out rows are given).
        examples_per_chunk: rows per read (``dataset_operator``). memory_budget_bytes: the solve's and each
            product's budget, None = the default.

    Raises:
        InvalidInput: an unknown kind, mode, solver, preconditioner, metric or dtype.
    """

    kind: SolveProblem
    mode: KernelMode = KernelMode.FULL
    dtype: str = "float64"
    params: tuple[str, ...] | None = None
    ridge: float = 0.0
    rtol: float | None = None
    max_iterations: int | None = None
    preconditioner: str = "auto"
    landmarks: int | None = None
    progress_every: int = DEFAULT_PROGRESS_EVERY
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK
    memory_budget_bytes: int | None = None
    solver: str = "auto"
    block_size: int | None = None
    inner_steps: int | None = None
    max_passes: float | None = None
    max_seconds: float | None = None
    seed: int = 0
    heldout_metric: str = "accuracy"
    heldout_patience: int | None = None
    heldout_every: int = 1

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "kind", parse_problem(self.kind))
        set_field(self, "mode", parse_solve_mode(self.mode))
        check_choice(self.preconditioner, PRECONDITIONERS, "preconditioner")
        check_choice(self.dtype, ("float32", "float64"), "dtype")
        check_choice(self.solver, SOLVER_NAMES, "solver")
        check_choice(self.heldout_metric, HELDOUT_METRICS, "heldout.metric")
        set_field(self, "params", None if self.params is None else tuple(self.params))

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32

    def to_dict(self) -> dict[str, Any]:
        """The stored (JSON) form: wire values, params as a list."""
        data = dataclasses.asdict(self)
        data["kind"], data["mode"] = self.kind.value, self.mode.value
        data["params"] = None if self.params is None else list(self.params)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SolveOptions:
        return cls(**_known(cls, data))


def solver_options(spec: SolveOptions) -> SolverOptions:
    """The library's ``SolverOptions`` of a solve's options (the CG fields go to ``CgOptions``)."""
    cg = CgOptions(
        max_iterations=spec.max_iterations,
        preconditioner=cast(PreconditionerName, spec.preconditioner),  # checked by SolveOptions
        landmarks=DEFAULT_LANDMARKS if spec.landmarks is None else spec.landmarks,
    )
    return SolverOptions(
        solver=spec.solver,
        rtol=spec.rtol,
        max_seconds=spec.max_seconds,
        max_passes=spec.max_passes,
        memory_budget_bytes=spec.memory_budget_bytes,
        block_size=spec.block_size,
        landmarks=spec.landmarks,
        inner_steps=spec.inner_steps,
        seed=spec.seed,
        cg=cg,
        checkpoint_every=spec.progress_every,
    )


@dataclass(frozen=True, slots=True)
class SolveProgress:
    """Where a running solve stands.

    Attributes:
        solver: the method running. iterations: its steps (CG iterations, block steps). epochs: block epochs.
        residual: the latest true relative residual (None before the first). estimate: the residual read off
            the work (CG's recursive one; the block visits'), None where none. passes: VJP + JVP passes over the
            train rows. products: round(passes) (CG's operator products). elapsed_s: seconds since it started.
        heldout: the held-out metric's latest value, None without one. heldout_curve: [[passes, value], ...].
    """

    iterations: int = 0
    residual: float | None = None
    products: int = 0
    passes: float = 0.0
    elapsed_s: float = 0.0
    solver: str = ""
    epochs: int = 0
    estimate: float | None = None
    heldout: float | None = None
    heldout_curve: tuple[tuple[float, float], ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["heldout_curve"] = [list(point) for point in self.heldout_curve]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SolveProgress:
        known = _known(cls, data)
        known["heldout_curve"] = tuple((float(p), float(v)) for p, v in known.get("heldout_curve", ()))
        return cls(**known)


@dataclass(frozen=True, slots=True)
class SolveReport:
    """A finished solve's summary (everything but its arrays).

    Attributes:
        converged: every column reached rtol. stop_reason: "converged", "max_passes", "time_limit",
            "stagnated: ...", "heldout: ...", "max_iterations", "breakdown: ...".
        iterations (steps), products, passes: the cost. residual: the final relative residual per column.
        time_s: wall time. preconditioner: its name. alpha_shape, predictions_shape: the arrays' shapes.
        solver: the method that produced α. epochs: block epochs. rtol: the target. attempts: every method auto
            tried, [{"solver", "stop_reason", "passes", "time_s"}]. heldout_curve: [[passes, value], ...] and
            heldout_metric. memory_bytes: the solver's estimate, checked before it ran. peak_rss_bytes: the
            process's peak resident memory at the end (None where unknown).
    """

    converged: bool
    stop_reason: str
    iterations: int
    residual: tuple[float, ...]
    products: int
    passes: float
    time_s: float
    preconditioner: str
    alpha_shape: tuple[int, ...] = ()
    predictions_shape: tuple[int, ...] | None = None
    solver: str = "pcg"
    epochs: int = 0
    rtol: float | None = None
    attempts: tuple[dict[str, Any], ...] = ()
    heldout_metric: str | None = None
    heldout_curve: tuple[tuple[float, float], ...] = ()
    memory_bytes: int = 0
    peak_rss_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["residual"], data["alpha_shape"] = list(self.residual), list(self.alpha_shape)
        data["predictions_shape"] = None if self.predictions_shape is None else list(self.predictions_shape)
        data["attempts"] = [dict(a) for a in self.attempts]
        data["heldout_curve"] = [list(point) for point in self.heldout_curve]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SolveReport:
        known = _known(cls, data)
        known["residual"] = tuple(float(r) for r in known.get("residual", ()))
        known["alpha_shape"] = tuple(known.get("alpha_shape", ()))
        shape = known.get("predictions_shape")
        known["predictions_shape"] = None if shape is None else tuple(shape)
        known["attempts"] = tuple(dict(a) for a in known.get("attempts", ()))
        known["heldout_curve"] = tuple((float(p), float(v)) for p, v in known.get("heldout_curve", ()))
        return cls(**known)


@dataclass(frozen=True)
class SolveState:
    """A checkpoint of a running solve: the library's ``SolverState`` and the job's progress at that point (NOTE
    [solve resume] in ``jobs/kinds/solve.py``)."""

    solver: SolverState
    progress: SolveProgress = field(default_factory=SolveProgress)

    def to_json(self) -> dict[str, Any]:
        """Everything but the arrays (``solver.solution``, ``solver.weights``)."""
        s = self.solver
        return {
            "solver": s.solver,
            "steps": s.steps,
            "epochs": s.epochs,
            "passes": s.passes,
            "extras": s.extras,
            "progress": self.progress.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], solution: np.ndarray, weights: np.ndarray | None) -> SolveState:
        state = SolverState(
            solver=str(data["solver"]),
            solution=solution,
            weights=weights,
            steps=int(data["steps"]),
            epochs=int(data["epochs"]),
            passes=float(data["passes"]),
            extras=dict(data.get("extras") or {}),
        )
        return cls(solver=state, progress=SolveProgress.from_json(data.get("progress") or {}))


@dataclass(frozen=True, slots=True)
class HeldOutRows:
    """A held-out set for ``run_solve``: inputs (m, *input) rows and targets (m, k) or (m,) class indices."""

    inputs: Any
    targets: np.ndarray


@dataclass(frozen=True, slots=True)
class SolveOutcome:
    """A finished solve: alpha (n, k) float64, predictions (m, k) float64 or None, and its report."""

    alpha: np.ndarray
    predictions: np.ndarray | None
    report: SolveReport

    def summary(self) -> dict[str, Any]:
        """The report's JSON (everything but the arrays)."""
        return self.report.to_json()


def check_targets(y: np.ndarray, *, n: int, k: int, name: str = "y") -> np.ndarray:
    """y as a float64 (n, k) array.

    Raises:
        ShapeMismatch: y neither (n, k) nor, for k = 1, (n,).
    """
    arr = np.asarray(y, dtype=np.float64)
    if arr.ndim == 1 and k == 1 and arr.shape[0] == n:
        return arr.reshape(n, 1)
    if arr.shape != (n, k):
        expected = f"({n}, {k})" + (f" or ({n},)" if k == 1 else "")
        raise ShapeMismatch(
            f"{_OPERATION}: {name} has shape {tuple(arr.shape)}, expected {expected}: one row per example and "
            f"one column per model output (k = {k}); upload targets matching the rows"
        )
    return arr


def check_heldout_targets(shape: tuple[int, ...], *, m: int, k: int, metric: str) -> None:
    """Held-out targets of ``shape`` against m held-out inputs and k outputs.

    Raises:
        ShapeMismatch: neither (m, k) nor, for accuracy, (m,) class indices (naming heldout.targets).
    """
    if shape == (m, k) or (metric == "accuracy" and shape == (m,)) or (k == 1 and shape == (m,)):
        return
    expected = f"({m}, {k})" + (f" or ({m},) class indices" if metric == "accuracy" else "")
    raise ShapeMismatch(
        f"{_OPERATION}: heldout.targets has shape {shape}, expected {expected}: one row per held-out input and one "
        f"column per model output (k = {k})"
    )


def _outputs(module: nn.Module, rows: Any, dtype: torch.dtype, chunk: int) -> np.ndarray:
    """f0: the model's outputs on ``rows`` (n, k) float64, read chunk by chunk."""
    parts = []
    private = copy.deepcopy(module).to(dtype)  # the registry's module is shared: never cast it in place
    with torch.no_grad():
        for start in range(0, int(rows.shape[0]), chunk):
            x = torch.from_numpy(np.array(rows[start : start + chunk]))
            x = x.to(dtype) if x.is_floating_point() else x
            parts.append(private(x).reshape(x.shape[0], -1).double().numpy())
    return np.concatenate(parts)


class _Slotted(JacobianOperator):
    """A ``JacobianOperator`` whose every product, JVP, VJP and kernel block first checks ``should_stop`` and then
    runs under ``run`` (a job's compute slot): NOTE [solve progress]."""

    def __init__(self, inner: JacobianOperator, run: Callable[[Callable[[], Any]], Any], stop: Callable[[], bool]):
        self._inner, self._run, self._stop = inner, run, stop
        self.shape, self.dtype, self.mode, self.k = inner.shape, inner.dtype, inner.mode, inner.k
        self.is_symmetric, self.num_params, self.examples = inner.is_symmetric, inner.num_params, inner.examples
        self.estimate_bytes = int(getattr(inner, "estimate_bytes", 0))

    def _call(self, fn: Callable[[], T]) -> T:
        if self._stop():
            raise SolveCancelled
        result: T = self._run(fn)
        return result

    def partitions(self) -> list[tuple[int, int]]:
        return self._inner.partitions()

    def _matmat(self, v: torch.Tensor) -> torch.Tensor:
        return self._call(lambda: self._inner.matmat(v))

    def matmat_float64(self, v: np.ndarray) -> np.ndarray:
        return self._call(lambda: self._inner.matmat_float64(v))

    def jvp(self, u: np.ndarray, rows: Ranges | None = None) -> np.ndarray:
        return self._call(lambda: self._inner.jvp(u, rows))

    def vjp(self, c: np.ndarray, cols: Ranges | None = None) -> np.ndarray:
        return self._call(lambda: self._inner.vjp(c, cols))

    def kernel_block(
        self, cols: Ranges, landmarks: np.ndarray | None, mode: KernelMode = KernelMode.FULL
    ) -> np.ndarray:
        return self._call(lambda: self._inner.kernel_block(cols, landmarks, mode))


OperatorFactory = Callable[[Any, Any], JacobianOperator]
"""(x1 rows, x2 rows or None) -> the kernel's operator (``dataset_operator`` here, ``ray_ntk_operator`` on Ray)."""


def local_operators(module: nn.Module, spec: SolveOptions) -> OperatorFactory:
    """The factory of ``dataset_operator``s over the model, in the solve's mode, dtype and chunking."""

    def build(x1: Any, x2: Any) -> JacobianOperator:
        return dataset_operator(
            module,
            x1,
            x2,
            mode=spec.mode,
            params=spec.params,
            dtype=spec.torch_dtype,
            examples_per_chunk=spec.examples_per_chunk,
            memory_budget_bytes=spec.memory_budget_bytes,
        )

    return build


def solve_estimate_bytes(spec: SolveOptions, train_op: LinearOperator, n: int, k: int) -> int:
    """The solve's memory estimate (its solver's, O(P + N·k + preconditioner)), checked against the budget.

    Raises:
        MemoryEstimateExceeded: over ``spec.memory_budget_bytes`` (the estimate in the message). InvalidInput:
            options out of range (a block size, a rank, an rtol under the float32 floor), naming the field.
    """
    zeros = np.zeros((n, k))
    return solve_memory_bytes(train_op, zeros, ridge=spec.ridge, options=solver_options(spec))


def run_solve(
    spec: SolveOptions,
    module: nn.Module,
    train: Any,
    targets: np.ndarray,
    test: Any,
    *,
    k: int,
    heldout: HeldOutRows | None = None,
    operators: OperatorFactory | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    report: Callable[[SolveProgress], None] = lambda progress: None,
    run_compute: Callable[[Callable[[], Any]], Any] | None = None,
    resume: SolveState | None = None,
    on_checkpoint: Callable[[SolveState], None] = lambda state: None,
) -> SolveOutcome:
    """Run one solve (module docstring): a job's, or an inline request's.

    Args:
        spec: the options. module: the model (read only). train: (n, *input) rows (a memmap, an array).
        targets: (n, k) or (n,). test: (m, *input) rows or None. k: outputs per example.
        heldout: the held-out inputs and targets, scored per epoch. Default: None.
        operators: builds the kernels' operators. Default: ``local_operators(module, spec)``.
        should_stop: True once the job is cancelled (checked before each product). Default: never.
        report: called with the progress after each epoch / iteration. Default: none.
        run_compute: runs each product, JVP, VJP, kernel block and the f0 pass (a job's compute slot). Default:
            here.
        resume: the checkpoint a previous run of the same solve reached (``on_checkpoint``): the solve goes on
            from it to the bits of an uninterrupted run (NOTE [exact resume]). Default: None (from the start).
        on_checkpoint: called with each checkpoint. Default: none.

    Returns:
        SolveOutcome: alpha (n, k), predictions (m, k) or None, and the report.

    Raises:
        SolveCancelled: should_stop() turned true. InvalidInput / ShapeMismatch / MemoryEstimateExceeded: from
        the solver (a bad ridge or option, targets of the wrong shape, a solve over the memory budget).
    """
    check_ridge_positive(spec.ridge, operation=_OPERATION)
    run = run_compute if run_compute is not None else _direct
    build = operators if operators is not None else local_operators(module, spec)
    n = int(train.shape[0])
    y = check_targets(targets, n=n, k=k)
    linearized = spec.kind is SolveProblem.LINEARIZED
    dtype = spec.torch_dtype
    train_op = _Slotted(build(train, None), run, should_stop)
    held = None
    if heldout is not None:
        m_held = int(heldout.inputs.shape[0])
        check_heldout_targets(tuple(heldout.targets.shape), m=m_held, k=k, metric=spec.heldout_metric)
        cross = _Slotted(build(heldout.inputs, train), run, should_stop)
        held_targets = heldout.targets
        if linearized:  # the held-out predictions are f0 + Θ α: score f0 + … by moving the targets instead
            f0_held = run(lambda: _outputs(module, heldout.inputs, dtype, spec.examples_per_chunk))
            held_targets = _shift_targets(held_targets, f0_held, spec.heldout_metric)
        held = HeldOut(
            kernel=cross,
            targets=held_targets,
            metric=spec.heldout_metric,  # type: ignore[arg-type]  # checked by SolveOptions
            patience=spec.heldout_patience,
            every=spec.heldout_every,
        )
    start = time.perf_counter()
    counted = resume.progress if resume is not None else SolveProgress()
    offset = counted.elapsed_s
    curve = list(counted.heldout_curve)

    def on_progress(p: Progress) -> None:
        if p.heldout_curve:
            curve[:] = p.heldout_curve
        progress = SolveProgress(
            iterations=p.steps,
            residual=p.residual,
            products=round(p.passes),
            passes=float(p.passes),
            elapsed_s=round(offset + time.perf_counter() - start, 3),
            solver=p.solver,
            epochs=p.epochs,
            estimate=p.estimate,
            heldout=curve[-1][1] if curve else None,
            heldout_curve=tuple(curve),
        )
        report(progress)
        if p.checkpoint:
            on_checkpoint(SolveState(solver=p.state, progress=progress))

    f0 = run(lambda: _outputs(module, train, dtype, spec.examples_per_chunk)) if linearized else 0.0
    result = solve_kernel(
        train_op,
        y - f0,
        ridge=spec.ridge,
        options=solver_options(spec),
        heldout=held,
        progress=on_progress,
        state=None if resume is None else resume.solver,
    )
    if result.heldout_curve:  # the method's own (a dense solve reports its one point only here)
        curve[:] = result.heldout_curve
    report(  # the last word, also for a method without progress reports (dense)
        SolveProgress(
            iterations=result.steps,
            residual=float(np.max(result.residual)) if np.size(result.residual) else 0.0,
            products=int(result.products),
            passes=float(result.passes),
            elapsed_s=round(offset + time.perf_counter() - start, 3),
            solver=result.solver,
            epochs=result.epochs,
            heldout=curve[-1][1] if curve else None,
            heldout_curve=tuple(curve),
        )
    )
    alpha = result.solution.reshape(n, k)
    predictions = None
    if test is not None:
        predictions = _predict(build, run, should_stop, module, spec, result, train, test, k, linearized)
    final = _report(result, spec, alpha, predictions, offset + time.perf_counter() - start, held is not None)
    return SolveOutcome(alpha=alpha, predictions=predictions, report=final)


def _shift_targets(targets: np.ndarray, f0: np.ndarray, metric: str) -> np.ndarray:
    """The targets Θ α is scored against where the predictions are f0 + Θ α: the MSE of (f0 + p) against t is
    that of p against t − f0. Accuracy (an argmax of f0 + p) has no such shift, so it is refused.

    Raises:
        InvalidInput: metric "accuracy" (naming heldout.metric).
    """
    if metric == "mse":
        shifted: np.ndarray = np.asarray(targets, dtype=np.float64).reshape(f0.shape) - f0
        return shifted
    raise InvalidInput(
        f"{_OPERATION}: heldout.metric 'accuracy' is not available for kind 'linearized' (its predictions add the "
        "initial outputs f0); use heldout.metric 'mse', or kind 'kernel_ridge'"
    )


def _predict(
    build: OperatorFactory,
    run: Callable[[Callable[[], Any]], Any],
    should_stop: Callable[[], bool],
    module: nn.Module,
    spec: SolveOptions,
    result: SolverResult,
    train: Any,
    test: Any,
    k: int,
    linearized: bool,
) -> np.ndarray:
    """f0* + J(test) w (one JVP over the test rows) where the solver left w, else f0* + Θ(test, train) α."""
    m = int(test.shape[0])
    cross = _Slotted(build(test, train), run, should_stop)
    if result.weights is not None:
        moved = cross.jvp(result.weights).reshape(m, k)
    else:
        op = kernel_operator(
            cross, k=k, name="the test-train kernel", operation=_OPERATION, rows=m, cols=train.shape[0]
        )
        moved = op.apply(result.solution).reshape(m, k)
    f0 = run(lambda: _outputs(module, test, spec.torch_dtype, spec.examples_per_chunk)) if linearized else 0.0
    return np.asarray(f0 + moved)


def _report(
    result: SolverResult,
    spec: SolveOptions,
    alpha: np.ndarray,
    predictions: np.ndarray | None,
    time_s: float,
    heldout: bool,
) -> SolveReport:
    return SolveReport(
        converged=bool(result.converged),
        stop_reason=result.stop_reason,
        iterations=result.steps,
        residual=tuple(float(r) for r in np.ravel(result.residual)),
        products=int(result.products),
        passes=float(result.passes),
        time_s=round(time_s, 6),
        preconditioner=result.preconditioner,
        alpha_shape=tuple(alpha.shape),
        predictions_shape=None if predictions is None else tuple(predictions.shape),
        solver=result.solver,
        epochs=result.epochs,
        rtol=result.rtol,
        attempts=tuple(
            {"solver": a.solver, "stop_reason": a.stop_reason, "passes": a.passes, "time_s": a.time_s}
            for a in result.attempts or (Attempt(result.solver, result.stop_reason, result.passes, result.time_s),)
        ),
        heldout_metric=spec.heldout_metric if heldout else None,
        heldout_curve=result.heldout_curve,
        memory_bytes=int(result.memory_bytes),
        peak_rss_bytes=result.peak_rss_bytes,
    )


def _direct(fn: Callable[[], T]) -> T:
    return fn()
