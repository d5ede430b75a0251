"""Solves on stored data sets: kernel ridge, GP mean or linearized predictions at t = ∞, by operator CG.

A solve never forms a kernel. The train kernel is ``dataset_operator`` over the train rows (read in chunks from
the data set's memory map), CG (``conjugate_gradients``) solves (Θ + λI) α = y − f0 on it, and the test predictions
are f0* + Θ(test, train) α, one more streamed product per target column. Memory is O(P + chunk) plus the N·k
numbers of each CG vector, whatever N is. ``run_solve`` runs one: a solve job's (``jobs/kinds/solve.py``) or an
inline request's (``POST /v1/models/{name}/solve``).

    kernel_ridge   α = (Θ + λI)⁻¹ y,                predictions = Θ* α
    gp_mean        the same system: the NTK-GP posterior mean with noise variance λ (zero prior mean)
    linearized     α = (Θ + λI)⁻¹ (y − f0),         predictions = f0* + Θ* α: the linearized network trained to
                   t = ∞ by gradient flow on the MSE from its initial outputs f0 (Lee et al. 2019; λ = 0 for the
                   unregularized limit, as ``linearized_predictions(times=[inf])``)

A TRACE solve reads the kernel as (Θ_trace / k) ⊗ I_k, as ``gp_inference`` does (NOTE [operator layout] in
``analysis/solve/operators.py``).

Its values are typed and grow by fields with defaults: ``SolveOptions`` (what and how), ``SolveProgress`` (while it
runs), ``SolveState`` (where it stands after a segment: what a resumed job goes on from) and ``SolveReport`` (the
summary of a finished solve); each reads the JSON of an earlier version (absent fields take their defaults).

NOTE [solve progress]
    ``conjugate_gradients`` reports its residual only when it returns, so a solve runs CG in segments of
    ``progress_every`` iterations, each warm-started from the previous solution (``x0``) with the same
    preconditioner (built once): after every segment the progress holds the true relative residual and the
    iterations so far, and ``on_segment`` receives the state to go on from. A restart drops the Krylov space, so a
    segmented solve can take a few more iterations than one long run; ``progress_every`` large (or ≥
    max_iterations) gives the single run. Products, passes and elapsed time move with every operator product, and
    cancellation is checked before each product, so a cancel takes effect within one product.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from ntk_service.analysis.solve import (
    AUTO_NYSTROM_MIN_SIZE,
    CgOptions,
    KernelOperator,
    check_ridge,
    conjugate_gradients,
    kernel_operator,
    nystrom_preconditioner,
)
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.streaming_operator import DEFAULT_EXAMPLES_PER_CHUNK, dataset_operator

__all__ = [
    "DEFAULT_PROGRESS_EVERY",
    "PRECONDITIONERS",
    "SOLVE_KINDS",
    "SOLVE_MODES",
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
]

T = TypeVar("T")

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

PRECONDITIONERS = ("auto", "nystrom", "none")
"""As ``CgOptions.preconditioner``."""

DEFAULT_PROGRESS_EVERY = 200
"""CG iterations per segment (NOTE [solve progress]). Restarts cost convergence on an ill-conditioned kernel: on
a tiny tanh MLP (N = 20, k = 3, FULL, ridge 1e-3, condition ≈ 4·10⁴) one CG run converged in 191 iterations, while
segments of 5 had not reached a residual below 0.9 after 600; 200 keeps the benchmark solves (50-250 iterations)
at one or two segments while a long solve still shows its residual."""


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
        ridge: λ ≥ 0 (absolute). rtol, max_iterations, preconditioner, landmarks: as ``CgOptions``.
        progress_every: CG iterations per segment (NOTE [solve progress]).
        examples_per_chunk: rows per read (``dataset_operator``). memory_budget_bytes: per product, None = default.

    Raises:
        InvalidInput: an unknown kind, mode, preconditioner or dtype.
    """

    kind: SolveProblem
    mode: KernelMode = KernelMode.FULL
    dtype: str = "float64"
    params: tuple[str, ...] | None = None
    ridge: float = 0.0
    rtol: float = 1e-8
    max_iterations: int | None = None
    preconditioner: str = "auto"
    landmarks: int | None = None
    progress_every: int = DEFAULT_PROGRESS_EVERY
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK
    memory_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "kind", parse_problem(self.kind))
        set_field(self, "mode", parse_solve_mode(self.mode))
        check_choice(self.preconditioner, PRECONDITIONERS, "preconditioner")
        check_choice(self.dtype, ("float32", "float64"), "dtype")
        set_field(self, "params", None if self.params is None else tuple(self.params))

    def to_dict(self) -> dict[str, Any]:
        """The stored (JSON) form: wire values, params as a list."""
        data = dataclasses.asdict(self)
        data["kind"], data["mode"] = self.kind.value, self.mode.value
        data["params"] = None if self.params is None else list(self.params)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SolveOptions:
        return cls(**_known(cls, data))


@dataclass(frozen=True, slots=True)
class SolveProgress:
    """Where a running solve stands: CG iterations and the true relative residual after the last segment (None
    before the first), operator products (columns) and data passes so far, seconds since it started."""

    iterations: int = 0
    residual: float | None = None
    products: int = 0
    passes: int = 0
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SolveProgress:
        return cls(**_known(cls, data))


@dataclass(frozen=True, slots=True)
class SolveReport:
    """A finished solve's summary (everything but its arrays).

    Attributes:
        converged: every column reached rtol. stop_reason: "converged", "max_iterations", "breakdown: ...".
        iterations, products, passes: the cost. residual: the final relative residual per column.
        time_s: wall time. preconditioner: its name. alpha_shape, predictions_shape: the arrays' shapes.
    """

    converged: bool
    stop_reason: str
    iterations: int
    residual: tuple[float, ...]
    products: int
    passes: int
    time_s: float
    preconditioner: str
    alpha_shape: tuple[int, ...] = ()
    predictions_shape: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["residual"], data["alpha_shape"] = list(self.residual), list(self.alpha_shape)
        data["predictions_shape"] = None if self.predictions_shape is None else list(self.predictions_shape)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SolveReport:
        known = _known(cls, data)
        known["residual"] = tuple(float(r) for r in known.get("residual", ()))
        known["alpha_shape"] = tuple(known.get("alpha_shape", ()))
        shape = known.get("predictions_shape")
        known["predictions_shape"] = None if shape is None else tuple(shape)
        return cls(**known)


@dataclass(frozen=True)
class SolveState:
    """Where a solve stands after a CG segment: enough to go on with the same bits (NOTE [solve resume] in
    ``jobs/kinds/solve.py``).

    Attributes:
        x: the iterate after the segment, (n·k, 1) FULL or (n, k) TRACE, float64.
        iterations: CG iterations so far. finished: no further segment runs (converged, the cap, a breakdown).
        converged, stop_reason, residual, preconditioner: the last segment's report.
        progress: the counters at that point.
    """

    x: np.ndarray
    iterations: int
    finished: bool
    converged: bool
    stop_reason: str
    residual: tuple[float, ...]
    preconditioner: str
    progress: SolveProgress = field(default_factory=SolveProgress)

    def to_json(self) -> dict[str, Any]:
        """Everything but ``x``."""
        return {
            "iterations": self.iterations,
            "finished": self.finished,
            "converged": self.converged,
            "stop_reason": self.stop_reason,
            "residual": list(self.residual),
            "preconditioner": self.preconditioner,
            "progress": self.progress.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], x: np.ndarray) -> SolveState:
        return cls(
            x=x,
            iterations=int(data["iterations"]),
            finished=bool(data["finished"]),
            converged=bool(data["converged"]),
            stop_reason=str(data["stop_reason"]),
            residual=tuple(float(r) for r in data["residual"]),
            preconditioner=str(data["preconditioner"]),
            progress=SolveProgress.from_json(data.get("progress") or {}),
        )


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
        ShapeMismatch: y neither (n, k) nor, for k = 1, (n,). NonFiniteInput is left to CG (NaN in y).
    """
    arr = np.asarray(y, dtype=np.float64)
    if arr.ndim == 1 and k == 1 and arr.shape[0] == n:
        return arr.reshape(n, 1)
    if arr.shape != (n, k):
        expected = f"({n}, {k})" + (f" or ({n},)" if k == 1 else "")
        raise ShapeMismatch(
            f"{_OPERATION}: {name} has shape {tuple(arr.shape)}, expected {expected}: one row per train example and "
            f"one column per model output (k = {k}); upload targets matching the train rows"
        )
    return arr


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


def _watched(op: KernelOperator, on_product: Callable[[int], None], run: Callable[[Callable[[], Any]], Any]) -> Any:
    """``op`` whose ``apply`` first calls ``on_product(columns)`` (progress, cancellation), then runs the product
    through ``run`` (a compute slot)."""

    def apply(v: np.ndarray) -> np.ndarray:
        on_product(int(v.shape[1]))
        product: np.ndarray = run(lambda: op.apply(v))
        return product

    return dataclasses.replace(op, apply=apply)


def _direct(fn: Callable[[], T]) -> T:
    return fn()


def run_solve(
    spec: SolveOptions,
    module: nn.Module,
    train: Any,
    targets: np.ndarray,
    test: Any,
    *,
    k: int,
    should_stop: Callable[[], bool] = lambda: False,
    report: Callable[[SolveProgress], None] = lambda progress: None,
    run_compute: Callable[[Callable[[], Any]], Any] = _direct,
    resume: SolveState | None = None,
    on_segment: Callable[[SolveState], None] = lambda state: None,
) -> SolveOutcome:
    """Run one solve (module docstring): a job's, or an inline request's.

    Args:
        spec: the options. module: the model (read only). train: (n, *input) rows (a memmap, an array).
        targets: (n, k) or (n,). test: (m, *input) rows or None. k: outputs per example.
        should_stop: True once the job is cancelled (checked before each product). Default: never.
        report: called with the progress after each product and each segment. Default: none.
        run_compute: runs each operator product and the f0 pass (a job's compute slot). Default: here.
        resume: the state a previous run of the same solve reached (``on_segment``): CG goes on from it, and
            none of its segments is computed again. Default: None (from the start).
        on_segment: called with the state after every CG segment. Default: none.

    Returns:
        SolveOutcome: alpha (n, k), predictions (m, k) or None, and the report.

    Raises:
        SolveCancelled: should_stop() turned true. InvalidInput / ShapeMismatch / MemoryEstimateExceeded: from
        the operator or CG (a bad ridge, targets of the wrong shape, a product over the memory budget).
    """
    ridge = check_ridge(spec.ridge, operation=_OPERATION)
    n = int(train.shape[0])
    m = 0 if test is None else int(test.shape[0])
    y = check_targets(targets, n=n, k=k)
    dtype = torch.float64 if spec.dtype == "float64" else torch.float32
    common: dict[str, Any] = {
        "mode": spec.mode,
        "params": spec.params,
        "dtype": dtype,
        "examples_per_chunk": spec.examples_per_chunk,
        "memory_budget_bytes": spec.memory_budget_bytes,
    }
    start = time.perf_counter()
    counted = resume.progress if resume is not None else SolveProgress()
    progress = counted.to_json()
    offset = counted.elapsed_s

    def on_product(columns: int) -> None:
        if should_stop():
            raise SolveCancelled
        progress["products"] += columns
        progress["passes"] += columns * passes_per_product
        progress["elapsed_s"] = round(offset + time.perf_counter() - start, 3)
        report(SolveProgress(**progress))

    linearized = spec.kind is SolveProblem.LINEARIZED
    train_op = kernel_operator(
        dataset_operator(module, train, **common), k=k, name="the train kernel", operation=_OPERATION, rows=n, cols=n
    )
    passes_per_product = train_op.passes_per_product
    watched = _watched(train_op, on_product, run_compute)
    state = resume
    if state is None or not state.finished:
        f0 = run_compute(lambda: _outputs(module, train, dtype, spec.examples_per_chunk)) if linearized else 0.0
        state = _cg(spec, watched, (y - f0).reshape(n * k, 1) if train_op.mode.value == "full" else y - f0, ridge,
                    state, progress, report, on_segment)  # fmt: skip
    alpha = state.x.reshape(n, k)
    predictions = None
    if test is not None:
        test_op = kernel_operator(
            dataset_operator(module, test, train, **common),
            k=k,
            name="the test-train kernel",
            operation=_OPERATION,
            rows=m,
            cols=n,
        )
        moved = _watched(test_op, on_product, run_compute).apply(state.x).reshape(m, k)
        f0_test = run_compute(lambda: _outputs(module, test, dtype, spec.examples_per_chunk)) if linearized else 0.0
        predictions = f0_test + moved
    final = SolveReport(
        converged=state.converged,
        stop_reason=state.stop_reason,
        iterations=state.iterations,
        residual=state.residual,
        products=int(progress["products"]),
        passes=int(progress["passes"]),
        time_s=round(offset + time.perf_counter() - start, 6),
        preconditioner=state.preconditioner,
        alpha_shape=tuple(alpha.shape),
        predictions_shape=None if predictions is None else tuple(predictions.shape),
    )
    return SolveOutcome(alpha=alpha, predictions=predictions, report=final)


def _cg(
    spec: SolveOptions,
    op: KernelOperator,
    b: np.ndarray,
    ridge: float,
    state: SolveState | None,
    progress: dict[str, Any],
    report: Callable[[SolveProgress], None],
    on_segment: Callable[[SolveState], None],
) -> SolveState:
    """CG in segments from ``state`` (or from zero) until it converges, reaches the cap or breaks down; returns
    the finished state (NOTE [solve progress])."""
    choice = spec.preconditioner
    if choice == "auto":
        choice = "nystrom" if op.rows >= AUTO_NYSTROM_MIN_SIZE else "none"
    pre: Any = "none"
    if choice == "nystrom":
        pre = nystrom_preconditioner(op, ridge=ridge, landmarks=spec.landmarks)
    cap = spec.max_iterations if spec.max_iterations is not None else min(10 * op.rows, 2000)
    x, iterations = (None, 0) if state is None else (state.x, state.iterations)
    while True:
        segment = min(spec.progress_every, cap - iterations)
        options = CgOptions(rtol=spec.rtol, max_iterations=segment, preconditioner=pre)
        result = conjugate_gradients(op, b, ridge=ridge, options=options, x0=x)
        x, iterations = result.solution, iterations + result.iterations
        progress["iterations"] = iterations
        progress["residual"] = float(np.max(result.residual))
        done = (
            result.converged
            or iterations >= cap
            or result.stop_reason.startswith("breakdown")
            or segment == 0
            or result.iterations == 0  # CG made no step (it cannot): stop rather than loop
        )
        state = SolveState(
            x=x,
            iterations=iterations,
            finished=done,
            converged=bool(result.converged),
            stop_reason=result.stop_reason,
            residual=tuple(float(r) for r in result.residual),
            preconditioner=result.preconditioner,
            progress=SolveProgress(**progress),
        )
        report(state.progress)
        on_segment(state)
        if done:
            return state
