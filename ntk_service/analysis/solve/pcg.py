"""The preconditioned CG solver of the table: ``conjugate_gradients`` with a Nyström preconditioner whose rank
adapts to the kernel where the model is there to build it (NOTE [adaptive nystrom]).

NOTE [pcg solver]
    Which preconditioner: the caller's ``CgOptions(preconditioner=...)`` when it names one; else, when the kernel
    has a model behind it (``KernelOperator.source``), the adaptive RPCholesky Nyström preconditioner built from the
    structured engine's columns (no operator products); else ``CgOptions``' own "auto" (none below 50,000 rows,
    m = 100 landmark products above: NOTE [cg default] in ``cg.py``). Progress is reported after every iteration
    (the state: CG's current X, a warm start to resume from); a held-out evaluation costs one product with the
    held-out kernel, every ``HeldOut.every`` iterations. The solver gives up ("stagnated") when the recursive
    residual's best has not halved in ``STAGNATION_WINDOW`` iterations: then ``auto`` goes on with the next method.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from ntk_service.analysis.solve.adaptive_nystrom import (
    BYTES_PER_ENTRY,
    adaptive_nystrom_preconditioner,
    max_adaptive_rank,
)
from ntk_service.analysis.solve.cg import (
    DEFAULT_MAX_ITERATIONS,
    CgOptions,
    SolveResult,
    _build_preconditioner,
    cg_memory_bytes,
    conjugate_gradients,
)
from ntk_service.analysis.solve.operators import KernelOperator, kernel_operator
from ntk_service.analysis.solve.problem import (
    Progress,
    ProgressCallback,
    SolveProblem,
    SolverOptions,
    SolverResult,
    SolverState,
    check_heldout,
    heldout_metric,
    peak_rss_bytes,
)
from ntk_service.errors import InvalidInput
from ntk_service.kernels.operators.base import JacobianOperator
from ntk_service.kernels.runtime.device import default_memory_budget

__all__ = ["STAGNATION_WINDOW", "PcgSolver", "cg_options"]

STAGNATION_WINDOW = 200
"""Iterations in which the best recursive residual must halve, or the solve gives up (NOTE [pcg solver]): CG's
residual is not monotone, and a slow but steady solve halves it every few dozen iterations."""

_OPERATION = "pcg solver"


def cg_options(options: SolverOptions) -> CgOptions:
    """The ``CgOptions`` of a solve: the caller's, or the defaults."""
    if options.cg is None:
        return CgOptions()
    if not isinstance(options.cg, CgOptions):
        raise InvalidInput(f"{_OPERATION}: options.cg must be a CgOptions, got {type(options.cg).__name__}")
    return options.cg


def _uses_adaptive(op: KernelOperator, cg: CgOptions) -> bool:
    return cg.preconditioner == "auto" and op.source is not None


def _rank_cap(problem: SolveProblem, options: SolverOptions) -> int:
    budget = default_memory_budget() if options.memory_budget_bytes is None else int(options.memory_budget_bytes)
    cap = max_adaptive_rank(problem.kernel.n, budget // 2)
    return cap if options.landmarks is None else min(cap, int(options.landmarks))


class PcgSolver:
    """Preconditioned (block) CG (NOTE [pcg solver], NOTE [cg] in ``cg.py``)."""

    name = "pcg"

    def refusal(self, problem: SolveProblem, options: SolverOptions) -> str | None:
        cg_options(options)  # raises on a wrong type
        if options.landmarks is not None and (isinstance(options.landmarks, bool) or options.landmarks < 1):
            raise InvalidInput(f"{_OPERATION}: landmarks must be an integer ≥ 1, got {options.landmarks!r}")
        return None

    def memory_bytes(self, problem: SolveProblem, options: SolverOptions) -> int:
        op = problem.kernel
        estimate = cg_memory_bytes(op.rows, problem.rhs.shape[1])
        if _uses_adaptive(op, cg_options(options)):
            estimate += BYTES_PER_ENTRY * op.n * _rank_cap(problem, options)
        source = op.source
        return estimate + (0 if source is None else source.estimate_bytes)

    def solve(
        self,
        problem: SolveProblem,
        options: SolverOptions,
        *,
        progress: ProgressCallback | None = None,
        state: SolverState | None = None,
    ) -> SolverResult:
        start = time.perf_counter()
        op = problem.kernel
        cg = cg_options(options)
        every = _checkpoint_every(options)
        preconditioner: Any = cg.preconditioner
        if _uses_adaptive(op, cg):
            preconditioner = adaptive_nystrom_preconditioner(
                op, ridge=problem.ridge, max_rank=max(1, _rank_cap(problem, options)), seed=options.seed
            )
        chosen = dataclasses.replace(cg, preconditioner=preconditioner)
        built, products = _build_preconditioner(op, problem.ridge, chosen)  # once, for every segment
        max_seconds = cg.max_seconds if options.max_seconds is None else options.max_seconds
        cap = min(10 * op.rows, DEFAULT_MAX_ITERATIONS) if cg.max_iterations is None else cg.max_iterations
        cg = dataclasses.replace(cg, rtol=problem.rtol, preconditioner="none" if built is None else built)
        watch = _Watch(self.name, problem, options, progress, start, op.passes_per_product)
        x0 = None if state is None else np.asarray(state.solution, dtype=np.float64).reshape(problem.rhs.shape)
        done = watch.resume(state) if state is not None and state.solver == self.name else 0
        if done and state is not None:  # the preconditioner built again is the same: its products count once
            products = int(state.extras.get("products", products))
        while True:  # segments of ``every`` iterations, each a restart from the last iterate (NOTE [exact resume])
            left = None if max_seconds is None else max(1e-3, max_seconds - (time.perf_counter() - start))
            segment = cap - done if every is None else min(every, cap - done)
            watch.offset = done
            result = conjugate_gradients(
                op,
                problem.rhs,
                ridge=problem.ridge,
                options=dataclasses.replace(cg, max_iterations=segment, max_seconds=left),
                x0=x0,
                callback=watch,
            )
            done, x0, products = done + result.iterations, result.solution, products + result.products
            if result.stop_reason != "max_iterations" or done >= cap or result.iterations == 0:
                break
            watch.checkpoint(x0, done, products, result)
        result = dataclasses.replace(
            result, iterations=done, products=products, passes=products * op.passes_per_product
        )
        return _as_result(self.name, result, problem, watch, self.memory_bytes(problem, options), start)


def _checkpoint_every(options: SolverOptions) -> int | None:
    every = options.checkpoint_every
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise InvalidInput(f"{_OPERATION}: checkpoint_every must be an integer ≥ 1 or None, got {every!r}")
    return every


class _Watch:
    """CG's callback: progress, the held-out curve, the pass budget and stagnation (NOTE [pcg solver])."""

    def __init__(
        self,
        name: str,
        problem: SolveProblem,
        options: SolverOptions,
        progress: ProgressCallback | None,
        start: float,
        passes_per_product: int,
    ) -> None:
        self.name, self.problem, self.options, self.progress, self.start = name, problem, options, progress, start
        self.per_iteration = problem.rhs.shape[1] * max(passes_per_product, 0)
        self.offset = 0  # iterations of the segments before this CG run
        self.best: list[float] = []
        self.heldout_curve: list[tuple[float, float]] = []
        self.best_heldout: float | None = None
        self.since_best = 0
        self.heldout = problem.heldout
        self.cross: KernelOperator | None = None
        self.targets = None
        if self.heldout is not None:
            kernel = self.heldout.kernel
            m = kernel.examples[0] if isinstance(kernel, JacobianOperator) else None
            self.targets = check_heldout(self.heldout, m=m, k=problem.kernel.k, operation=_OPERATION)
            self.cross = kernel_operator(
                kernel, k=problem.kernel.k, name="heldout.kernel", operation=_OPERATION, cols=problem.kernel.n
            )

    def resume(self, state: SolverState) -> int:
        """Take the counters of a checkpoint (NOTE [exact resume]); returns the iterations done (0: not one)."""
        extras = state.extras
        if "best" not in extras:
            return 0
        self.best = [float(v) for v in extras["best"]]
        self.heldout_curve = [(float(p), float(v)) for p, v in extras.get("heldout_curve", ())]
        best = extras.get("best_heldout")
        self.best_heldout = None if best is None else float(best)
        self.since_best = int(extras.get("since_best", 0))
        return int(state.steps)

    def checkpoint(self, x: np.ndarray, iterations: int, products: int, result: SolveResult) -> None:
        """Report the end of a segment: a checkpoint (NOTE [exact resume])."""
        if self.progress is None:
            return
        passes = float(iterations * self.per_iteration)
        extras = {
            "best": list(self.best),
            "heldout_curve": [list(point) for point in self.heldout_curve],
            "best_heldout": self.best_heldout,
            "since_best": self.since_best,
            "products": products,
        }
        state = SolverState(solver=self.name, solution=x.copy(), steps=iterations, passes=passes, extras=extras)
        self.progress(
            Progress(
                solver=self.name,
                steps=iterations,
                epochs=0,
                passes=passes,
                residual=float(result.residual.max()) if result.residual.size else 0.0,
                heldout=self.heldout_curve[-1][1] if self.heldout_curve else None,
                elapsed_s=time.perf_counter() - self.start,
                state=state,
                checkpoint=True,
                heldout_curve=tuple(self.heldout_curve),
            )
        )

    def __call__(self, iterations: int, x: np.ndarray, residual: np.ndarray) -> str | None:
        iterations += self.offset
        worst = float(residual.max()) if residual.size else 0.0
        self.best.append(min(worst, self.best[-1]) if self.best else worst)
        passes = iterations * self.per_iteration
        value = None
        if self.cross is not None and self.heldout is not None and iterations % self.heldout.every == 0:
            k = self.problem.kernel.k
            predictions = self.cross.apply(x).reshape(self.cross.n, k)
            value = heldout_metric(predictions, np.asarray(self.targets), self.heldout.metric)
            self.heldout_curve.append((float(passes), value))
            better = self.best_heldout is None or (
                value > self.best_heldout if self.heldout.metric == "accuracy" else value < self.best_heldout
            )
            self.best_heldout, self.since_best = (value, 0) if better else (self.best_heldout, self.since_best + 1)
        if self.progress is not None:
            state = SolverState(solver=self.name, solution=x.copy(), steps=iterations, passes=float(passes))
            self.progress(
                Progress(
                    solver=self.name,
                    steps=iterations,
                    epochs=0,
                    passes=float(passes),
                    residual=None,
                    heldout=value,
                    elapsed_s=time.perf_counter() - self.start,
                    state=state,
                    estimate=worst,
                    heldout_curve=tuple(self.heldout_curve),
                )
            )
        if self.options.max_passes is not None and passes >= self.options.max_passes:
            return "max_passes"
        if self.heldout is not None and self.heldout.patience is not None and self.since_best >= self.heldout.patience:
            return f"heldout: no better {self.heldout.metric} in {self.since_best} evaluations"
        if len(self.best) > STAGNATION_WINDOW and self.best[-1] > 0.5 * self.best[-1 - STAGNATION_WINDOW]:
            return f"stagnated: the residual did not halve in {STAGNATION_WINDOW} iterations"
        return None


def _as_result(
    name: str, result: SolveResult, problem: SolveProblem, watch: _Watch, memory: int, start: float
) -> SolverResult:
    return SolverResult(
        solution=result.solution,
        residual=result.residual,
        converged=result.converged,
        stop_reason=result.stop_reason,
        solver=name,
        rtol=result.rtol,
        time_s=time.perf_counter() - start,
        steps=result.iterations,
        passes=float(result.passes),
        products=result.products,
        memory_bytes=memory,
        peak_rss_bytes=peak_rss_bytes(),
        residual_curve=((float(result.passes), float(result.residual.max()) if result.residual.size else 0.0),),
        heldout_curve=tuple(watch.heldout_curve),
        preconditioner=result.preconditioner,
        state=SolverState(solver=name, solution=result.solution, steps=result.iterations, passes=float(result.passes)),
        cg=result,
    )
