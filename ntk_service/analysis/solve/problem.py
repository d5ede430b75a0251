"""The values every solver shares: what to solve (``SolveProblem``), how (``SolverOptions``), what came out
(``SolverResult``), where it stands (``SolverState``, ``Progress``) and the held-out set it reports on (``HeldOut``).

A solver (``table.py``) reads a problem and options and returns a result; it never reads anything else. The same
values carry a solve through a job: ``progress`` is called after every epoch (block methods) or iteration (CG)
with a ``Progress`` whose ``state`` is enough to resume (``solve_kernel(..., state=...)``) after a kill.

NOTE [float32 floor]
    Products in float32 (the default dtype of a float32 model) put a floor under the relative residual that no
    number of iterations crosses: a product's rounding is about eps32 · ‖J‖ ‖Jᵀα‖ against ‖y‖, which grows with
    ‖α‖ ~ ‖y‖ / λ for a small ridge. It was measured at 1.2e-5 (FULL, N = 30,000, ridge 1e-3 × mean diagonal;
    docs/benchmarks.md) and is ≥ 1e-6 in every float32 run here. So ``DEFAULT_RTOL`` (1e-8) holds for float64
    products only, and float32 products default to ``DEFAULT_RTOL_FLOAT32``; a tighter rtol on float32 products
    is refused up front (``check_rtol``), naming float64 products as the fix. Vectors, scalars and sums are float64
    in every solver (CG's recursions, the parameter-space methods' w and α, Ray's shard sums): an accumulation over
    thousands of steps is where float32 would lose digits, and float64 there costs nothing beside a product.

NOTE [exact resume]
    A ``Progress`` with ``checkpoint=True`` carries a state from which ``solve_kernel(..., state=...)`` repeats
    the rest of this very run, bit for bit (with the same torch threads): the block method's checkpoints are its
    epochs' ends (α, w, the generator, the residual checks and curves are in the state, and nothing is recomputed
    on resume); "pcg" checkpoints where it restarts CG (``SolverOptions.checkpoint_every``; the preconditioner is
    seeded, so it is built again the same), and ``auto`` adds the attempts made so far and resumes with the method
    that wrote the state, then the ones after it. A dense solve has no checkpoint: it is one step. A state that is
    no checkpoint (CG's iterate between restarts, another method's) is a warm start: the solve converges from it,
    by other steps. Every value in ``extras`` is JSON (a job stores it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ntk_service.analysis.layout import to_float64
from ntk_service.analysis.solve.operators import KernelOperator, kernel_operator
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.operators.base import JacobianOperator

__all__ = [
    "DEFAULT_RTOL",
    "DEFAULT_RTOL_FLOAT32",
    "FLOAT32_FLOOR",
    "Attempt",
    "HeldOut",
    "HeldOutMetric",
    "Progress",
    "ProgressCallback",
    "SolveProblem",
    "SolverOptions",
    "SolverResult",
    "SolverState",
    "as_targets",
    "check_rtol",
    "heldout_metric",
    "heldout_value",
    "peak_rss_bytes",
]

DEFAULT_RTOL = 1e-8
"""Relative residual at which a solve on float64 products stops: float64 predictions then agree with a dense solve
to about rtol × cond(A + λI)^(1/2) (measured in tests/analysis/test_solvers.py and benchmarks/bench_solvers.py)."""

DEFAULT_RTOL_FLOAT32 = 1e-4
"""The relative residual a solve on float32 products stops at unless told (NOTE [float32 floor]): 10x above the
largest floor measured, so a default solve never chases rounding."""

FLOAT32_FLOOR = 1e-5
"""Below this rtol, float32 products are refused up front (NOTE [float32 floor]): the floor was measured at 1.2e-5."""

HeldOutMetric = Literal["accuracy", "mse"]
"""What the held-out curve reports: "accuracy" (argmax of the predictions against the class of each target: an
index, or the argmax of a one-hot / centred row) or "mse" (mean over all M·k entries)."""


@dataclass(frozen=True)
class HeldOut:
    """A held-out set whose metric is reported per epoch (and may stop the solve).

    Attributes:
        kernel: Θ(x_heldout, x_train): a ``JacobianOperator`` (``ntk_operator(model, x_heldout, x_train)``: the
            parameter-space solvers predict J(x_heldout) w with one JVP over it), or any kernel the solvers take
            (dense (M, N, k, k) / (M, N), an operator: one product per evaluation).
        targets: (M, k) targets, or (M,) class indices for "accuracy".
        metric: "accuracy" or "mse". Default: "accuracy".
        patience: stop when the metric has not improved for this many evaluations in a row; None: never stop on
            it (only report). Default: None.
        every: evaluate every this many epochs (CG: iterations). Default: 1.
    """

    kernel: Any
    targets: Any
    metric: HeldOutMetric = "accuracy"
    patience: int | None = None
    every: int = 1


@dataclass(frozen=True)
class SolverOptions:
    """How ``solve_kernel`` solves (Θ + λI) α = y.

    Attributes:
        solver: a name of the table (``SOLVERS`` in ``table.py``: "auto", "dense", "pcg", "block"). Default: "auto".
        rtol: stop at a true relative residual ‖y − (Θ + λI) α‖ / ‖y‖ ≤ rtol per column. Default: None, meaning
            ``DEFAULT_RTOL`` (1e-8) on float64 products and ``DEFAULT_RTOL_FLOAT32`` on float32 ones.
        max_seconds: stop within this much wall time ("time_limit", not converged unless the residual made it;
            pcg starts an iteration only while it and the closing residual fit: ``CgOptions.max_seconds``).
        max_passes: a budget of passes over the data (one pass: a VJP and a JVP over all N examples); a method
            that spends it without converging gives up (auto then falls back). Default: None (the method's own).
        memory_budget_bytes: the solve's estimate (``memory_bytes`` of its solver) is refused above it. Default:
            None (``default_memory_budget()``).
        block_size: examples per block of the parameter-space method. Default: None (``DEFAULT_BLOCK_SIZE``).
        landmarks: landmark examples per block (block method) or the largest Nyström rank (pcg). Default: None.
        inner_steps: preconditioned CG steps on each block's system (block method). Default: None.
        seed: the generator of block orders and landmarks. Default: 0.
        cg: CG's own options for "pcg" (preconditioner, method, ...). Default: None (``CgOptions()``).
        checkpoint_every: "pcg" restarts CG from its iterate every this many iterations, each restart a checkpoint
            (NOTE [exact resume]); None: one CG run, no checkpoint before it ends. Default: None.
    """

    solver: str = "auto"
    rtol: float | None = None
    max_seconds: float | None = None
    max_passes: float | None = None
    memory_budget_bytes: int | None = None
    block_size: int | None = None
    landmarks: int | None = None
    inner_steps: int | None = None
    seed: int = 0
    cg: Any = None
    checkpoint_every: int | None = None


@dataclass(frozen=True)
class SolveProblem:
    """What to solve: (A + λI) X = B, A the kernel (``KernelOperator``), B (n, r).

    Attributes:
        kernel: the train kernel as the solvers' float64 view (``kernel_operator``).
        rhs: B (n, r) float64 (the targets in the kernel's layout: FULL one column of N·k, TRACE k columns).
        ridge: λ > 0 (absolute). heldout: the held-out set, or None.
        rtol: the target (``SolverOptions.rtol`` resolved, NOTE [float32 floor]).
    """

    kernel: KernelOperator
    rhs: np.ndarray
    ridge: float
    rtol: float
    heldout: HeldOut | None = None

    @property
    def rows(self) -> int:
        return self.kernel.rows

    @property
    def jacobian(self) -> JacobianOperator | None:
        """The ``JacobianOperator`` behind a FULL train kernel (the parameter-space solvers need it)."""
        return self.kernel.source if self.kernel.mode.value == "full" else None


@dataclass(frozen=True)
class SolverState:
    """Where a solve stands: enough to resume it (``solve_kernel(..., state=...)``) after a kill.

    Attributes:
        solver: the method that wrote it. solution: α (n, r) float64. weights: w = Jᵀα (P,) float64 for the
            parameter-space method, else None (recomputed on resume). steps, epochs, passes: the counters so far.
        extras: the method's own small counters (e.g. the block order's generator state).
    """

    solver: str
    solution: np.ndarray
    weights: np.ndarray | None = None
    steps: int = 0
    epochs: int = 0
    passes: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    """What ``progress`` is told after each epoch (block) or iteration (CG).

    Attributes:
        solver: the method running. steps, epochs, passes: counters. residual: the latest true relative residual
            (max over columns), or None before the first check. heldout: the latest held-out metric or None.
        elapsed_s: wall time so far. state: a snapshot to resume from (``SolverState``).
        estimate: a residual read off the work already done, without a product (the block method: the residuals
            seen at the blocks' visits this epoch; CG: its recursive residual), or None.
        checkpoint: ``state`` is a checkpoint: a solve resumed from it goes on exactly as this one does (NOTE
            [exact resume]). Default: False.
        heldout_curve: the method's held-out curve so far, ((passes, metric), ...), as its result will hold it.
    """

    solver: str
    steps: int
    epochs: int
    passes: float
    residual: float | None
    heldout: float | None
    elapsed_s: float
    state: SolverState
    estimate: float | None = None
    checkpoint: bool = False
    heldout_curve: tuple[tuple[float, float], ...] = ()


ProgressCallback = Callable[[Progress], None]
"""Called with each ``Progress``; raising from it stops the solve (a job's cancel), the exception propagating."""


@dataclass(frozen=True)
class Attempt:
    """One method tried by ``auto``: its name, why it stopped, and what it spent."""

    solver: str
    stop_reason: str
    passes: float
    time_s: float


@dataclass(frozen=True)
class SolverResult:
    """What a solve did (the fields of CG's ``SolveResult`` included, so either reads the same).

    Attributes:
        solution: α (n, r). weights: w = Jᵀα (P,) for the parameter-space method, else None.
        residual: (r,) the true relative residual of each column. converged: every column ≤ rtol.
        stop_reason: "converged", "time_limit", "max_passes", "stagnated: ...", "breakdown: ...".
        solver: the method that produced the solution. attempts: every method auto tried, in order.
        steps: block steps or CG iterations (``iterations`` too). epochs: passes of the block order over the data.
        passes: VJP + JVP passes over the N examples (a block step over b examples counts b / N of one; a
            dense solve's kernel counts 0: it is no product). products: operator products (columns; CG counts its
            preconditioner's too), or product-equivalents round(passes) for the block method.
        rtol. time_s. memory_bytes: the estimate checked against the budget. peak_rss_bytes: the process's peak
            resident memory (VmHWM) at the end, None where unknown.
        residual_curve: ((passes, residual), ...) at each true check. heldout_curve: ((passes, metric), ...).
        preconditioner: what preconditioned it ("none" where nothing did). state: to resume from.
        cg: CG's own ``SolveResult`` when "pcg" ran, else None.
    """

    solution: np.ndarray
    residual: np.ndarray
    converged: bool
    stop_reason: str
    solver: str
    rtol: float
    time_s: float
    steps: int = 0
    epochs: int = 0
    passes: float = 0.0
    weights: np.ndarray | None = None
    attempts: tuple[Attempt, ...] = ()
    memory_bytes: int = 0
    peak_rss_bytes: int | None = None
    residual_curve: tuple[tuple[float, float], ...] = ()
    heldout_curve: tuple[tuple[float, float], ...] = ()
    preconditioner: str = "none"
    state: SolverState | None = None
    products: int = 0
    cg: Any = None

    @property
    def iterations(self) -> int:
        return self.steps

    @property
    def method(self) -> str:
        return self.solver


def as_targets(y: Any, *, name: str, operation: str) -> np.ndarray:
    """y as float64 (N, k) ((N,) is k = 1).

    Raises:
        ShapeMismatch: y of another rank. NonFiniteInput: NaN or inf in y.
    """
    targets = to_float64(y, name=name, operation=operation)
    targets = targets[:, None] if targets.ndim == 1 else targets
    if targets.ndim != 2:
        raise ShapeMismatch(f"{operation}: {name} has shape {targets.shape}; expected (N, k) or (N,)")
    return targets


def check_rtol(rtol: float | None, product_dtype: torch.dtype, *, operation: str) -> float:
    """The rtol a solve stops at: the default for the products' dtype, or the given one checked.

    Raises:
        InvalidInput: rtol not in (0, 1), or below ``FLOAT32_FLOOR`` on float32 products (NOTE [float32 floor]).
    """
    if rtol is None:
        return DEFAULT_RTOL_FLOAT32 if product_dtype == torch.float32 else DEFAULT_RTOL
    value = float(rtol)
    if not (0 < value < 1 and math.isfinite(value)):
        raise InvalidInput(f"{operation}: rtol must be in (0, 1), got {rtol}")
    if product_dtype == torch.float32 and value < FLOAT32_FLOOR:
        raise InvalidInput(
            f"{operation}: rtol {value:g} is below the floor float32 products put under the residual (about "
            f"{FLOAT32_FLOOR:g}, NOTE [float32 floor]); build the operator with dtype=torch.float64, or use "
            f"rtol ≥ {FLOAT32_FLOOR:g}"
        )
    return value


def heldout_metric(predictions: np.ndarray, targets: np.ndarray, metric: str) -> float:
    """The held-out metric of predictions (M, k) against targets (M, k) or (M,) class indices."""
    if metric == "mse":
        return float(np.mean((predictions - targets.reshape(predictions.shape)) ** 2))
    classes = targets if targets.ndim == 1 else np.argmax(targets, axis=1)
    return float(np.mean(np.argmax(predictions, axis=1) == classes))


def check_heldout(heldout: HeldOut, *, m: int | None, k: int, operation: str) -> np.ndarray:
    """The held-out targets as float64, checked against the held-out kernel's M examples and k.

    Raises:
        ShapeMismatch: targets that are not (M, k) (or (M,) class indices for accuracy).
        InvalidInput: an unknown metric, patience or every < 1.
    """
    if heldout.metric not in ("accuracy", "mse"):
        raise InvalidInput(f"{operation}: heldout.metric must be 'accuracy' or 'mse', got {heldout.metric!r}")
    for name in ("patience", "every"):
        value = getattr(heldout, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidInput(f"{operation}: heldout.{name} must be an integer ≥ 1, got {value!r}")
    raw = heldout.targets
    raw = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else raw
    targets = np.asarray(raw, dtype=np.float64)
    rows = targets.shape[0] if targets.ndim else None
    shape_ok = targets.ndim == 2 and targets.shape[1] == k or (targets.ndim == 1 and heldout.metric == "accuracy")
    if not shape_ok or (m is not None and rows != m):
        expected = f"({m if m is not None else 'M'}, {k})" + (
            " or (M,) class indices" if heldout.metric == "accuracy" else ""
        )
        raise ShapeMismatch(
            f"{operation}: heldout.targets has shape {targets.shape}; expected {expected}, one row per example of "
            "the held-out kernel's rows"
        )
    if not np.all(np.isfinite(targets)):
        raise InvalidInput(f"{operation}: heldout.targets holds NaN or inf")
    return targets


def heldout_value(heldout: HeldOut, alpha: np.ndarray, k: int, n: int, *, operation: str) -> float:
    """The held-out metric of the solution α (in the kernel's layout): Θ(x_heldout, x) α, one product."""
    kernel = heldout.kernel
    m = kernel.examples[0] if isinstance(kernel, JacobianOperator) else None
    targets = check_heldout(heldout, m=m, k=k, operation=operation)
    cross = kernel_operator(kernel, k=k, name="heldout.kernel", operation=operation, cols=n)
    return heldout_metric(cross.apply(alpha).reshape(cross.n, k), targets, heldout.metric)


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory (VmHWM: its own, not a parent's; DESIGN §6), None off Linux."""
    try:
        with open(f"/proc/{os.getpid()}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
