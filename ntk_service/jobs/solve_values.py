"""The values of a solve (``jobs/solve_job.py`` runs one): what it computes and how (``SolveOptions``), where it
stands (``SolveProgress``, ``SolveState``), what came out (``SolveReport``, ``SolveOutcome``), and the checks of its
inputs. Each reads the JSON of an earlier version (absent fields take their defaults, unknown ones are dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, cast

import numpy as np
import torch

from ntk_service.analysis.solve import DEFAULT_LANDMARKS, CgOptions, SolverOptions, SolverState
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.streaming_operator import DEFAULT_EXAMPLES_PER_CHUNK

__all__ = [
    "DEFAULT_PROGRESS_EVERY",
    "HELDOUT_METRICS",
    "PRECONDITIONERS",
    "SOLVER_NAMES",
    "SOLVE_KINDS",
    "SOLVE_MODES",
    "HeldOutRows",
    "SolveCancelled",
    "SolveOptions",
    "SolveOutcome",
    "SolveProblem",
    "SolveProgress",
    "SolveReport",
    "SolveState",
    "check_choice",
    "check_heldout_targets",
    "check_targets",
    "parse_problem",
    "parse_solve_mode",
    "solver_options",
]

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
