"""The solvers of (Θ + λI) α = y in one table, the ``auto`` rule over it, and ``solve_kernel``, the entry point.

A solver is a value with a name, a ``refusal`` (why it cannot run a problem, or None), a ``memory_bytes`` estimate
and ``solve`` (``Solver``). ``SOLVERS`` maps names to them; ``gp_inference(solver=...)``, ``solve_kernel`` and
``InverseOperator`` read it and nothing else, so a new solver is its module plus one line in ``_METHODS`` (and one
in ``auto_order`` if ``auto`` should pick it).

NOTE [auto rule]
    ``auto`` tries, in order, the methods ``auto_order`` lists that do not refuse the problem and fit the memory
    budget; a method that gives up ("stagnated", a breakdown, or ``AUTO_PASS_BUDGET`` passes spent) hands its α to
    the next as a warm start,
    and the dense solve, when it fits, is always last, so on a problem that fits ``auto`` returns converged. With
    nothing that fits it refuses up front (MemoryEstimateExceeded, listing each method's estimate). The order:

    - a dense kernel was given: "dense" (Cholesky; NOTE [gp solve]);
    - an operator of at most ``DENSE_MAX_ROWS`` rows: "dense", its kernel built by the structured engine
      (NOTE [dense from an operator]): at these sizes building the kernel and factoring it costs less than the
      passes any iterative method needs, and it is exact however ill-conditioned the problem (float64, k = 3,
      a few hundred examples, ridge 1e-6 × mean diagonal: CG stopped at 2000 iterations with residual 4.3);
    - a TRACE operator of a model, at any size: "dense" first, where it fits the budget. Its iterations are
      k passes per target column (k² for the k columns of a classification), and its dense kernel is N × N, not
      (N·k)²: at N = 20,000 (k = 10) dense took 203 s, where pcg's first iteration and residual took 683 s;
    - a larger operator: "pcg" (NOTE [pcg solver]; its adaptive Nyström rank), then, for a FULL operator with
      its model (``ntk_operator``, ``dataset_operator``, ``ray_ntk_operator``), "block" from its α (NOTE
      [parameter-space blocks]): pcg took fewer passes at every size measured (N = 2000-20,000 FULL), and the
      block method stalls where n = N·k exceeds P;
    - "dense" last when it fits, whatever the size.

    The numbers that chose ``DENSE_MAX_ROWS`` and the block method are in docs/analysis.md ("How auto chooses")
    and docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from ntk_service.analysis.solve.block import BlockSolver
from ntk_service.analysis.solve.dense import DenseSolver
from ntk_service.analysis.solve.operators import kernel_operator
from ntk_service.analysis.solve.pcg import PcgSolver
from ntk_service.analysis.solve.problem import (
    Attempt,
    HeldOut,
    Progress,
    ProgressCallback,
    SolveProblem,
    SolverOptions,
    SolverResult,
    SolverState,
    as_targets,
    check_rtol,
)
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch, format_bytes
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.runtime.device import default_memory_budget

__all__ = [
    "ALIASES",
    "AUTO_PASS_BUDGET",
    "DENSE_MAX_ROWS",
    "SOLVERS",
    "AutoSolver",
    "Solver",
    "auto_order",
    "check_ridge_positive",
    "make_problem",
    "resolve_solver",
    "solve_kernel",
    "solve_memory_bytes",
]

AUTO_PASS_BUDGET = 1000.0
"""Passes over the data an iterative method may spend in ``auto`` before the next method takes over from its α
(the last method has no budget but the caller's): 14x the most a converged run here needed (71 at N = 20,000), so
it only cuts a solve that crawls without stalling."""

DENSE_MAX_ROWS = 10_000
"""Rows n = N·k up to which ``auto`` solves an operator densely (NOTE [auto rule]; docs/analysis.md)."""


class Solver(Protocol):
    """What the table holds: a method for (A + λI) X = B."""

    @property
    def name(self) -> str: ...

    def refusal(self, problem: SolveProblem, options: SolverOptions) -> str | None:
        """Why this method cannot solve ``problem`` (None: it can). Raises InvalidInput for options out of range."""
        ...

    def memory_bytes(self, problem: SolveProblem, options: SolverOptions) -> int:
        """The peak bytes the solve needs beyond its inputs, estimated before anything runs."""
        ...

    def solve(
        self,
        problem: SolveProblem,
        options: SolverOptions,
        *,
        progress: ProgressCallback | None = None,
        state: SolverState | None = None,
    ) -> SolverResult:
        """Solve it; ``state`` (a previous result's or progress's) resumes from there."""
        ...


def auto_order(problem: SolveProblem) -> tuple[str, ...]:
    """The methods ``auto`` tries, in order (NOTE [auto rule])."""
    op = problem.kernel
    if op.matrix is not None:
        return ("dense", "pcg")
    order = ["dense"] if op.rows <= DENSE_MAX_ROWS or op.passes_per_product > 1 else []
    order.append("pcg")
    if problem.jacobian is not None:
        order.append("block")
    if "dense" not in order:
        order.append("dense")
    return tuple(order)


class AutoSolver:
    """``auto``: the methods of ``order`` (default ``auto_order``) in turn, each warm-starting the next (NOTE [auto
    rule]).

    Args:
        methods: name -> solver. order: problem -> the names to try, in order. Default: ``auto_order``.
    """

    name = "auto"

    def __init__(
        self, methods: Mapping[str, Solver], order: Callable[[SolveProblem], tuple[str, ...]] | None = None
    ) -> None:
        self._methods = methods
        self._order = auto_order if order is None else order

    def plan(self, problem: SolveProblem, options: SolverOptions) -> list[Solver]:
        """The methods that will be tried, in order.

        Raises:
            MemoryEstimateExceeded: none fits the budget (the message lists every estimate and refusal).
        """
        budget = _budget(options)
        chosen, notes = [], []
        for name in self._order(problem):
            method = self._methods[name]
            reason = method.refusal(problem, options)
            if reason is None:
                need = method.memory_bytes(problem, options)
                if need <= budget:
                    chosen.append(method)
                    continue
                reason = f"needs about {format_bytes(need)}"
            notes.append(f"{name}: {reason}")
        if not chosen:
            raise MemoryEstimateExceeded(
                f"solve_kernel: no method fits a problem of {problem.rows} rows in the memory budget of "
                f"{format_bytes(budget)} ({'; '.join(notes)}); raise memory_budget_bytes or solve a subset",
                estimate_bytes=min(self._methods[n].memory_bytes(problem, options) for n in self._order(problem)),
                budget_bytes=budget,
            )
        return chosen

    def refusal(self, problem: SolveProblem, options: SolverOptions) -> str | None:
        return None

    def memory_bytes(self, problem: SolveProblem, options: SolverOptions) -> int:
        return max(method.memory_bytes(problem, options) for method in self.plan(problem, options))

    def solve(
        self,
        problem: SolveProblem,
        options: SolverOptions,
        *,
        progress: ProgressCallback | None = None,
        state: SolverState | None = None,
    ) -> SolverResult:
        start = time.perf_counter()
        plan = self.plan(problem, options)
        attempts: list[Attempt] = []
        before: list[tuple[float, float]] = []  # the held-out curves of the methods tried, on one passes axis
        if state is not None:  # resume with the method that wrote the state, then the ones after it
            names = [method.name for method in plan]
            wrote = state.solver
            plan = plan[names.index(wrote) :] if wrote in names else plan
            attempts = [Attempt(str(a[0]), str(a[1]), float(a[2]), float(a[3])) for a in state.extras.get("auto", ())]
            before = [(float(p), float(v)) for p, v in state.extras.get("auto_curve", ())]
        result: SolverResult | None = None

        def shifted(curve: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
            spent = sum(a.passes for a in attempts)
            return (*before, *((p + spent, v) for p, v in curve))

        def tell(update: Progress) -> None:  # the attempts so far go into every state (NOTE [exact resume])
            extras = {
                **update.state.extras,
                "auto": [[a.solver, a.stop_reason, a.passes, a.time_s] for a in attempts],
                "auto_curve": [list(point) for point in before],
            }
            assert progress is not None
            state = dataclasses.replace(update.state, extras=extras)
            progress(dataclasses.replace(update, state=state, heldout_curve=shifted(update.heldout_curve)))

        for position, method in enumerate(plan):
            remaining = options
            if options.max_seconds is not None:
                left = options.max_seconds - (time.perf_counter() - start)
                if left <= 0 and result is not None:
                    break
                remaining = dataclasses.replace(options, max_seconds=max(left, 1e-3))
            if options.max_passes is None and position + 1 < len(plan) and method.name != "dense":
                remaining = dataclasses.replace(remaining, max_passes=AUTO_PASS_BUDGET)
            result = method.solve(problem, remaining, progress=None if progress is None else tell, state=state)
            curve = shifted(result.heldout_curve)
            attempts.append(Attempt(method.name, result.stop_reason, result.passes, result.time_s))
            if result.converged or result.stop_reason == "time_limit":
                break
            before = list(curve)
            state = result.state
        assert result is not None
        passes = sum(a.passes for a in attempts)
        return dataclasses.replace(
            result, attempts=tuple(attempts), passes=passes, time_s=time.perf_counter() - start, heldout_curve=curve
        )


def _budget(options: SolverOptions) -> int:
    return default_memory_budget() if options.memory_budget_bytes is None else int(options.memory_budget_bytes)


_METHODS: tuple[Solver, ...] = (DenseSolver(), PcgSolver(), BlockSolver())
"""Every method, registered once (a new solver: its module and a line here)."""

SOLVERS: dict[str, Solver] = {method.name: method for method in _METHODS}
SOLVERS["auto"] = AutoSolver({method.name: method for method in _METHODS})
"""Name -> solver: "auto" (NOTE [auto rule]), "dense", "pcg", "block"."""

ALIASES = {"direct": "dense", "cg": "pcg"}
"""Older names, kept for one release: ``gp_inference(solver="direct" | "cg")``."""


def resolve_solver(name: str, *, operation: str, field: str = "solver") -> Solver:
    """The solver of the table called ``name`` (or an alias).

    Raises:
        InvalidInput: an unknown name, naming the field and the choices.
    """
    key = ALIASES.get(name, name) if isinstance(name, str) else name
    if not isinstance(key, str) or key not in SOLVERS:
        choices = ", ".join(repr(n) for n in (*SOLVERS, *ALIASES))
        raise InvalidInput(f"{operation}: unknown {field} {name!r}; expected one of {choices}")
    return SOLVERS[key]


def check_ridge_positive(ridge: Any, *, operation: str) -> float:
    """λ as a float.

    Raises:
        InvalidInput: a ridge that is not a finite number > 0 (naming the field).
    """
    try:
        value = float(ridge)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{operation}: ridge must be a number > 0, got {ridge!r}") from exc
    if not (value > 0 and np.isfinite(value)):
        raise InvalidInput(
            f"{operation}: ridge must be a finite number > 0, got {ridge}; the iterative solvers need Θ + λI positive "
            "definite (pass e.g. ridge = 1e-3 × the mean diagonal entry of Θ)"
        )
    return value


def solve_kernel(
    kernel: Any,
    y: Any,
    *,
    ridge: float,
    options: SolverOptions | None = None,
    heldout: HeldOut | None = None,
    progress: ProgressCallback | None = None,
    state: SolverState | None = None,
    mode: KernelMode | str | None = None,
) -> SolverResult:
    """Solve (Θ + λI) α = y with a solver of the table (``options.solver``, default "auto": NOTE [auto rule]).

    Example::

        train = ntk_operator(model, x)                                    # Θ(x, x), never formed
        out = solve_kernel(train, y, ridge=1e-3, heldout=HeldOut(ntk_operator(model, x_val, x), y_val))
        out.converged, out.solver, out.passes, out.heldout_curve          # True, "block", 21.5, ((...), ...)
        predictions = ntk_operator(model, x_test, x).jvp(out.weights)     # J(x_test) w: (M, k)

    Args:
        kernel: Θ(x, x): a dense FULL (N, N, k, k) / TRACE (N, N) kernel, or an operator (NOTE [operator layout]).
        y: (N, k) targets ((N,) for k = 1).
        ridge: λ > 0 (absolute).
        options: ``SolverOptions``. Default: SolverOptions() (auto, the default rtol of the products' dtype).
        heldout: a held-out set whose metric is reported per epoch. Default: None.
        progress: called after every epoch / iteration with a ``Progress`` (raise from it to stop). Default: None.
        state: a ``SolverState`` to resume from (a previous result's or a progress's). Default: None.
        mode: checked against the kernel. Default: inferred.

    Returns:
        SolverResult: solution α in the kernel's layout ((N·k, 1) FULL, (N, k) TRACE), ``weights`` w = Jᵀα for the
        parameter-space method, the true residual, converged, the solver and every attempt, passes, steps,
        curves, time and memory.

    Raises:
        InvalidInput: ridge ≤ 0 or NaN, an unknown solver, rtol out of range or below the float32 floor, a block
            size or rank out of range, a held-out set of the wrong shape (each naming its field).
        ShapeMismatch: y or the kernel of the wrong shape. MemoryEstimateExceeded: the method (auto: every
            method) needs more than the budget, before anything runs.
    """
    options = options or SolverOptions()
    solver, problem, _ = _checked(kernel, y, ridge, options, heldout, mode)
    return solver.solve(problem, options, progress=progress, state=state)


def solve_memory_bytes(
    kernel: Any,
    y: Any,
    *,
    ridge: float,
    options: SolverOptions | None = None,
    heldout: HeldOut | None = None,
    mode: KernelMode | str | None = None,
) -> int:
    """What ``solve_kernel`` with these arguments would need (its solver's estimate; auto: the largest of the
    methods it would try), every input checked as ``solve_kernel`` checks it, and nothing solved: a job's check
    at submission.

    Raises:
        As ``solve_kernel`` (MemoryEstimateExceeded when over the budget, the estimate in the message).
    """
    return _checked(kernel, y, ridge, options or SolverOptions(), heldout, mode)[2]


def _checked(
    kernel: Any,
    y: Any,
    ridge: float,
    options: SolverOptions,
    heldout: HeldOut | None,
    mode: KernelMode | str | None,
) -> tuple[Solver, SolveProblem, int]:
    """The solver, the problem and the memory estimate of ``solve_kernel``'s arguments, refused past the budget."""
    operation = "solve_kernel"
    solver = resolve_solver(options.solver, operation=operation, field="options.solver")
    problem = make_problem(kernel, y, ridge=ridge, options=options, heldout=heldout, mode=mode)
    reason = solver.refusal(problem, options)
    if reason is not None:
        raise InvalidInput(f"{operation}: solver {solver.name!r} cannot solve this problem: {reason}")
    need = solver.memory_bytes(problem, options)  # auto: its plan, which refuses when no method fits
    if not isinstance(solver, AutoSolver):
        budget = _budget(options)
        if need > budget:
            raise MemoryEstimateExceeded(
                f"{operation}: solver {solver.name!r} needs about {format_bytes(need)} for {problem.rows} rows, over "
                f"the memory budget of {format_bytes(budget)}; use solver='auto', a smaller block or rank, or raise "
                "memory_budget_bytes",
                estimate_bytes=need,
                budget_bytes=budget,
            )
    return solver, problem, need


def make_problem(
    kernel: Any,
    y: Any,
    *,
    ridge: float,
    options: SolverOptions,
    heldout: HeldOut | None = None,
    mode: KernelMode | str | None = None,
) -> SolveProblem:
    """The ``SolveProblem`` of ``solve_kernel``'s arguments, every input checked (its Raises)."""
    operation = "solve_kernel"
    lam = check_ridge_positive(ridge, operation=operation)
    targets = as_targets(y, name="y", operation=operation)
    n, k = targets.shape
    op = kernel_operator(kernel, k=k, name="kernel", operation=operation, rows=n, cols=n, mode=mode)
    if op.rows != op.cols:
        raise ShapeMismatch(f"{operation}: the kernel has shape {op.shape}; solving needs Θ(x, x), a square one")
    rhs = targets.reshape(-1, 1) if op.mode is KernelMode.FULL else targets
    rtol = check_rtol(options.rtol, op.product_dtype, operation=operation)
    return SolveProblem(kernel=op, rhs=rhs, ridge=lam, rtol=rtol, heldout=heldout)
