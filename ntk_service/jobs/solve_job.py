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

Its values (``jobs/solve_values.py``, re-exported here) are typed and grow by fields with defaults:
``SolveOptions`` (what and how), ``SolveProgress`` (while it runs), ``SolveState`` (a checkpoint: what a resumed job
goes on from) and ``SolveReport`` (the summary of a finished solve).

NOTE [solve progress]
    The solver reports after every epoch (block) or iteration (CG); each report is published as the job's live
    progress (the held-out curve so far included), and each report that is a checkpoint (NOTE [exact resume] in
    ``analysis/solve/problem.py``: the block method's epochs, CG's restarts every ``progress_every`` iterations)
    is handed to ``on_checkpoint`` to store. Every product, JVP, VJP and kernel block runs under ``run_compute``
    (a job's compute slot), after a check of ``should_stop``, so a cancel takes effect within one of them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from ntk_service.analysis.solve import (
    Attempt,
    HeldOut,
    Progress,
    SolverResult,
    kernel_operator,
    solve_kernel,
)
from ntk_service.analysis.solve.table import check_ridge_positive, solve_memory_bytes
from ntk_service.errors import InvalidInput
from ntk_service.jobs.solve_values import (
    DEFAULT_PROGRESS_EVERY,
    HELDOUT_METRICS,
    PRECONDITIONERS,
    SOLVE_KINDS,
    SOLVE_MODES,
    SOLVER_NAMES,
    HeldOutRows,
    SolveCancelled,
    SolveOptions,
    SolveOutcome,
    SolveProblem,
    SolveProgress,
    SolveReport,
    SolveState,
    check_choice,
    check_heldout_targets,
    check_targets,
    parse_problem,
    parse_solve_mode,
    solver_options,
)
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.base import JacobianOperator, LinearOperator, Ranges
from ntk_service.kernels.operators.streaming_operator import dataset_operator

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
    "check_heldout_targets",
    "check_targets",
    "local_operators",
    "parse_problem",
    "parse_solve_mode",
    "run_solve",
    "solve_estimate_bytes",
    "solver_options",
]

T = TypeVar("T")

_OPERATION = "solve job"


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
        self.estimate_bytes = inner.estimate_bytes

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
