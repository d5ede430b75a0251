"""Preconditioned conjugate gradients on a kernel seen through products: (A + λI) X = B, B (n, r).

NOTE [cg]
    The r right-hand sides (the k target columns of a TRACE kernel, one FULL column, a GP variance's M·k columns)
    run as one block, by one of two sweeps (``block_cg.py``): "block" shares one Krylov space across the columns
    (NOTE [block cg]; s ≤ r products per iteration), "batched" gives each column its own CG scalars (one product
    per moving column). Either way a converged column costs nothing more. Vectors, scalars and sums are float64
    whatever the operator computes in. A column stops when its recursive residual ‖r‖ / ‖b‖ ≤ rtol; then the
    true residual ‖b − (A + λI) x‖ / ‖b‖ is recomputed with one more product, and if rounding has pulled it
    above rtol, CG restarts from x (a warm start) up to ``_RESTARTS`` times. ``converged`` is that true
    residual against rtol: a solve that runs out of iterations, or meets pᵀ(A + λI)p ≤ 0 (an operator that is
    not positive definite), says so in its result and in ``stop_reason``; nothing is dropped silently.

NOTE [cg method]
    ``DEFAULT_METHOD`` is "auto": "block" on an operator (a product is a pass over the data, so the count of
    products decides), "batched" on a dense kernel (a product is one cheap matrix product, so block CG's small
    algebra decides). Block CG took fewer products in every case of this A/B (dense TRACE kernel of the
    benchmark MLP 784-512-512-10 read as trace / k, ridge 1e-3 × the mean diagonal, rtol 1e-8;
    benchmarks/bench_solvers.py --section block, load 6-7 on 2 cores), products for block / batched:

    ====== ======================== ======================== ============================ ==========================
    N      ridge, k = 10, none      ridge, k = 10, Nyström   variance, m = 200, none      variance, m = 200, Nyström
    ====== ======================== ======================== ============================ ==========================
    500    178 / 259 (19 / 25 it.)  263 / 300                700 / 4400 (3 / 21 it.)      800 / 3699
    1000   227 / 340 (25 / 33 it.)  308 / 364                1203 / 5635 (6 / 29 it.)     1300 / 4700
    2000   301 / 460 (33 / 45 it.)  366 / 451                2000 / 7600 (9 / 37 it.)     2100 / 5992
    ====== ======================== ======================== ============================ ==========================

    The shared space resolves the NTK's k outlying class-mean modes once for all columns instead of once per
    column; a variance's columns Θ(x, x*) are nearly dependent, so its blocks lose rank and its iterations stay
    few. The price is O(n·s²) of small dense algebra per iteration, nothing beside an operator's product (a
    pass over the data) but visible on a dense kernel with many columns: the m = 200 variance at N = 2000 took
    18 s block against 5 s batched there (dense products are cheap), the k = 10 ridge 0.6 s against 0.9 s.
    One column (a FULL solve) is the same CG either way. ``SolveResult.method`` says which ran.

NOTE [cg default]
    ``preconditioner="auto"`` (the default) is no preconditioner below n = ``AUTO_NYSTROM_MIN_SIZE`` rows and the
    Nyström preconditioner with m = ``DEFAULT_LANDMARKS`` from there on, from this A/B on the benchmark MLP
    784-512-512-10 (FULL, ridge 1e-3 × the mean diagonal, benchmarks/bench_solvers.py, contended machine), in
    products (the cost; a preconditioner's m landmarks are m products; the first two rows float64 at rtol 1e-8,
    the last two float32 products at rtol 1e-5):

    ============ ============================ ==================================
    n = N·k      no preconditioner            Nyström
    ============ ============================ ==================================
    3,000        45 iterations, 46 products   m = 30: 35 iterations, 66 products
    10,000       74 iterations, 75 products   m = 50: 47 iterations, 98 products
    20,000       79 iterations, 80 products   m = 50: 36 iterations, 87 products
    100,000      230 iterations, 232 products m = 100: 99 iterations, 200 products
    ============ ============================ ==================================

    An MLP's NTK has a few outlying top eigenvalues that plain CG resolves in about one iteration each; the
    iterations of the bulk grow with N (≈ N^0.66 here), and once they are well above m the landmarks pay.

    What "auto" cannot build, because it needs the model, is the better one at scale: the shared-output Nyström
    preconditioner (NOTE [shared nystrom] in ``preconditioners.py``; m = 1000 landmark examples from one
    ``compute_ntk`` TRACE call, no products) took the same N = 10,000 solve to 51 iterations and 52 products, and
    a block-Jacobi preconditioner (the per-example k × k blocks) saved under 10 % of the iterations at
    N = 1000 and was not kept (benchmarks/bench_solvers.py --section preconditioners and --section scale).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from ntk_service.analysis.solve.block_cg import batched_sweep, block_sweep
from ntk_service.analysis.solve.operators import KernelOperator, check_ridge
from ntk_service.analysis.solve.preconditioners import LandmarkMethod, nystrom_preconditioner
from ntk_service.analysis.solve.problem import DEFAULT_RTOL
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, NonFiniteInput, ShapeMismatch, format_bytes
from ntk_service.kernels.runtime.device import default_memory_budget

__all__ = [
    "CG_ARRAYS",
    "DEFAULT_MAX_ITERATIONS",
    "DEFAULT_METHOD",
    "DEFAULT_RTOL",
    "CgMethod",
    "CgOptions",
    "Preconditioner",
    "SolveResult",
    "cg_memory_bytes",
    "check_cg_memory",
    "conjugate_gradients",
]

DEFAULT_MAX_ITERATIONS = 2000
"""The default cap on CG iterations (each is one product per moving column)."""

AUTO_NYSTROM_MIN_SIZE = 50_000
"""Rows n from which ``preconditioner="auto"`` builds a Nyström preconditioner (NOTE [cg default]): it did not pay
at n = 20,000 and paid at n = 100,000 on the benchmark MLP."""

CgMethod = Literal["auto", "block", "batched"]
"""How CG runs several columns (NOTE [block cg] in ``block_cg.py``); "auto" by the kind of kernel (NOTE [cg method])."""

DEFAULT_METHOD: CgMethod = "auto"
"""The sweep ``CgOptions`` uses unless told (NOTE [cg method])."""

CG_ARRAYS = 11
"""(n, r) float64 arrays a solve holds at its peak (B, X, R, the directions, their products, Z and the
temporaries of an update; tracemalloc measured 7.3-9.9 for r ≪ n), beside ``_SMALL_ARRAYS`` (r, r) ones (block
CG's Gram matrices and coefficients: 11.2 (n, r)-sized arrays in all at n = 300, r = 200); checked in
tests/analysis/test_block_cg.py."""

_SMALL_ARRAYS = 4

_FIXED_BYTES = 64 * 1024
"""What does not scale with n: the (r,) scalars and residuals, numpy's array headers (tracemalloc saw 35,529 bytes
against 35,232 for the (n, r) and (r, r) blocks alone at n = 400, r = 1)."""

_RESTARTS = 3
"""Warm restarts when the recomputed residual is above rtol although the recursive one was below (NOTE [cg])."""

_OPERATION = "conjugate_gradients"


def cg_memory_bytes(n: int, r: int) -> int:
    """The peak bytes of CG's vectors for B (n, r): ``CG_ARRAYS`` (n, r) and ``_SMALL_ARRAYS`` (r, r) float64
    blocks plus ``_FIXED_BYTES`` (the operator's and the preconditioner's own memory not included)."""
    return (CG_ARRAYS * n * r + _SMALL_ARRAYS * r * r) * 8 + _FIXED_BYTES


class Preconditioner(Protocol):
    """What CG asks of a preconditioner: P⁻¹ R for a block R (n, r), and a name for the result."""

    @property
    def name(self) -> str: ...

    def apply(self, r: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class CgOptions:
    """How to solve with CG (the ``cg=`` options of ``gp_inference`` and ``linearized_predictions``).

    Attributes:
        rtol: stop at ‖b − A x‖ / ‖b‖ ≤ rtol per column. Default: ``DEFAULT_RTOL``.
        max_iterations: per solve. Default: None, meaning min(10·n, ``DEFAULT_MAX_ITERATIONS``) (rounding makes
            CG need more than the n steps of exact arithmetic on an ill-conditioned kernel).
        preconditioner: "auto" (NOTE [cg default]), "nystrom" (NOTE [nystrom preconditioner]), "none", or a
            built ``Preconditioner``. Default: "auto".
        landmarks: m for "nystrom". Default: None (``DEFAULT_LANDMARKS``, capped at n).
        landmark_method: "uniform" or "pivoted_cholesky". seed: the uniform landmarks' generator.
        diagonal: (n,) the kernel's diagonal, for "pivoted_cholesky" on an operator.
        max_seconds: stop within this much wall time, the preconditioner's build included, with ``stop_reason``
            "time_limit" and ``converged`` False unless the residual made it: an iteration starts only while it and
            the closing true residual fit at the mean iteration time so far (the first always runs). Default: None
            (no limit).
        method: "block" (one Krylov space shared by the r columns, NOTE [block cg] in ``block_cg.py``),
            "batched" (a Krylov space per column, NOTE [cg]) or "auto" (block on an operator, batched on a dense
            kernel). Default: ``DEFAULT_METHOD`` ("auto", NOTE [cg method]).
        memory_budget_bytes: the solve's vectors (``cg_memory_bytes``) are refused above it. Default: None
            (``default_memory_budget()``).
    """

    rtol: float = DEFAULT_RTOL
    max_iterations: int | None = None
    preconditioner: Literal["auto", "nystrom", "none"] | Preconditioner = "auto"
    landmarks: int | None = None
    landmark_method: LandmarkMethod = "uniform"
    seed: int = 0
    diagonal: Any = None
    max_seconds: float | None = None
    method: CgMethod = DEFAULT_METHOD
    memory_budget_bytes: int | None = None


@dataclass(frozen=True)
class SolveResult:
    """What a CG solve did.

    Attributes:
        solution: X (n, r). residual: (r,) the true relative residual ‖b − (A + λI) x‖ / ‖b‖ of each column.
        converged: every column reached rtol. stop_reason: "converged", "max_iterations", "time_limit",
            "rounding: ..." (the true residual stayed above rtol through the warm restarts) or "breakdown: ...".
        iterations: CG iterations (all restarts). products: operator products (columns), the preconditioner's
            included. passes: VJP + JVP passes over the data those products cost (0 for a dense kernel).
        rtol: the target. time_s: wall time, the preconditioner's build included. preconditioner: its name.
        method: "block" or "batched", the sweep that ran (NOTE [cg method]).
    """

    solution: np.ndarray
    residual: np.ndarray
    converged: bool
    stop_reason: str
    iterations: int
    products: int
    passes: int
    rtol: float
    time_s: float
    preconditioner: str
    method: str = "batched"


def _build_preconditioner(op: KernelOperator, ridge: float, options: CgOptions) -> tuple[Any, int]:
    choice = options.preconditioner
    if choice == "auto":
        choice = "nystrom" if op.rows >= AUTO_NYSTROM_MIN_SIZE else "none"
    if choice == "none":
        return None, 0
    if choice == "nystrom":
        pre = nystrom_preconditioner(
            op,
            ridge=ridge,
            landmarks=options.landmarks,
            method=options.landmark_method,
            seed=options.seed,
            diagonal=options.diagonal,
        )
        return pre, pre.products
    if isinstance(choice, str) or not hasattr(choice, "apply"):
        raise InvalidInput(
            f"{_OPERATION}: unknown preconditioner {choice!r}; expected 'auto', 'nystrom', 'none' or an object with "
            "apply()"
        )
    return choice, 0


def check_cg_memory(n: int, r: int, options: CgOptions, *, operation: str, extra_bytes: int = 0) -> int:
    """The estimate ``cg_memory_bytes(n, r) + extra_bytes``, checked against the budget.

    Raises:
        MemoryEstimateExceeded: over ``options.memory_budget_bytes`` (default: ``default_memory_budget()``).
    """
    estimate = cg_memory_bytes(n, r) + int(extra_bytes)
    budget = default_memory_budget() if options.memory_budget_bytes is None else int(options.memory_budget_bytes)
    if estimate > budget:
        fits = max(0, (budget - int(extra_bytes)) // ((CG_ARRAYS * n + _SMALL_ARRAYS * r) * 8))
        raise MemoryEstimateExceeded(
            f"{operation}: CG on {r} right-hand sides of {n} rows needs about {format_bytes(estimate)}, over the "
            f"memory budget of {format_bytes(budget)}; solve at most {fits} columns at a time (e.g. fewer test "
            "points) or raise memory_budget_bytes",
            estimate_bytes=estimate,
            budget_bytes=budget,
        )
    return estimate


def conjugate_gradients(
    op: KernelOperator,
    rhs: Any,
    *,
    ridge: float = 0.0,
    options: CgOptions | None = None,
    x0: Any = None,
    callback: Callable[[int, np.ndarray, np.ndarray], str | None] | None = None,
) -> SolveResult:
    """Solve (A + λI) X = B by preconditioned CG (NOTE [cg]).

    Args:
        op: a square kernel (``kernel_operator``), symmetric positive semi-definite.
        rhs: B (n,) or (n, r). ridge: λ ≥ 0. options: ``CgOptions``. Default: CgOptions().
        x0: a warm start (n,) or (n, r), e.g. a previous ``SolveResult.solution``. Default: zeros.
        callback: called after each iteration with (iterations so far, X (n, r), the recursive relative
            residuals (r,)), both live arrays (copy what you keep); a string it returns stops the solve with that
            ``stop_reason`` (the true residual recomputed, as for the time limit); an exception it raises
            propagates (a job's cancel). Default: None.

    Returns:
        SolveResult: solution (n, r) (always 2-D), residuals, ``converged`` and the cost.

    Raises:
        ShapeMismatch: B or x0 not matching the operator. InvalidInput: a negative or NaN ridge, rtol ≤ 0,
        max_iterations < 0, an unknown method. NonFiniteInput: NaN in B or x0. MemoryEstimateExceeded: the
        vectors for B would not fit (``check_cg_memory``).
    """
    options = options or CgOptions()
    lam = check_ridge(ridge, operation=_OPERATION)
    if not (options.rtol > 0 and np.isfinite(options.rtol)):
        raise InvalidInput(f"{_OPERATION}: rtol must be a positive number, got {options.rtol}")
    if options.max_iterations is not None and options.max_iterations < 0:
        raise InvalidInput(f"{_OPERATION}: max_iterations must be ≥ 0, got {options.max_iterations}")
    if options.max_seconds is not None and not (options.max_seconds > 0 and np.isfinite(options.max_seconds)):
        raise InvalidInput(f"{_OPERATION}: max_seconds must be a positive number or None, got {options.max_seconds}")
    n = op.rows
    if op.rows != op.cols:
        raise ShapeMismatch(f"{_OPERATION}: the kernel has shape {op.shape}; CG needs a square one")
    b = np.asarray(rhs, dtype=np.float64)
    b = b[:, None] if b.ndim == 1 else b
    if b.ndim != 2 or b.shape[0] != n:
        raise ShapeMismatch(
            f"{_OPERATION}: the right-hand side has shape {np.shape(rhs)}; expected ({n},) or ({n}, r) for a kernel "
            f"of shape {op.shape}"
        )
    x = np.zeros_like(b) if x0 is None else np.array(x0, dtype=np.float64)
    x = x[:, None] if x.ndim == 1 else x
    if x.shape != b.shape:
        raise ShapeMismatch(f"{_OPERATION}: x0 has shape {np.shape(x0)}; expected {b.shape} like the right-hand side")
    if not (np.all(np.isfinite(b)) and np.all(np.isfinite(x))):
        raise NonFiniteInput(f"{_OPERATION}: the right-hand side or x0 holds NaN or inf")
    if options.method not in ("auto", "block", "batched"):
        raise InvalidInput(f"{_OPERATION}: unknown method {options.method!r}; expected 'auto', 'block' or 'batched'")
    check_cg_memory(n, b.shape[1], options, operation=_OPERATION)
    start = time.perf_counter()
    max_iterations = min(10 * n, DEFAULT_MAX_ITERATIONS) if options.max_iterations is None else options.max_iterations
    pre, products = _build_preconditioner(op, lam, options)
    bnorm = np.linalg.norm(b, axis=0)
    bnorm_safe = np.where(bnorm > 0, bnorm, 1.0)

    def product(v: np.ndarray, cols: np.ndarray | None) -> np.ndarray:
        """(A + λI) V for V (n, s), counting s products; with ``cols``, scattered into an (n, r) block."""
        nonlocal products
        products += v.shape[1]
        av = op.apply(v) + lam * v if v.shape[1] else np.zeros_like(v)
        if cols is None:
            return av
        out = np.zeros_like(b)
        out[:, cols] = av
        return out

    def should_stop(done: int) -> str | None:
        """Checked before each iteration (``done`` run in this sweep): the time limit, then the caller's say.

        An iteration starts only while it and the closing true residual (one product per column, about an
        iteration's cost) would end within ``max_seconds``, at the mean iteration time so far: a TRACE operator's
        iteration is k² passes (minutes at N = 100,000), so a check on the clock alone overran by two of them."""
        if options.max_seconds is not None:
            now = time.perf_counter()
            ran = iterations + done
            per = (now - iterating) / ran if ran else 0.0
            if now - start + 2 * per > options.max_seconds:
                return "time_limit"
        return None if callback is None or done == 0 else callback(iterations + done, x, residual)

    method = options.method
    if method == "auto":
        method = "batched" if op.matrix is not None else "block"
    sweep = block_sweep if method == "block" else batched_sweep
    iterations, stop_reason = 0, "max_iterations"
    moving = np.arange(b.shape[1])[bnorm > 0]
    x[:, bnorm == 0] = 0.0
    r = b - product(x[:, moving], moving) if np.any(x[:, moving]) else b.copy()
    residual = np.linalg.norm(r, axis=0) / bnorm_safe
    iterating = time.perf_counter()  # after the build: what the iterations (and the restarts' residuals) take
    for _ in range(_RESTARTS + 1):
        active = moving[residual[moving] > options.rtol]
        if active.size == 0:
            stop_reason = "converged"
            break
        done, reason = sweep(
            x,
            r,
            residual,
            active,
            bnorm=bnorm_safe,
            rtol=options.rtol,
            product=lambda v: product(v, None),
            pre=pre,
            max_iterations=max_iterations - iterations,
            should_stop=should_stop,
        )
        iterations += done
        stop_reason = reason or "converged"
        # the true residual (NOTE [cg]): one more product per moving column
        r = b - product(x[:, moving], moving)
        residual = np.linalg.norm(r, axis=0) / bnorm_safe
        residual[bnorm == 0] = 0.0
        if stop_reason not in ("converged", "max_iterations") or iterations >= max_iterations:
            break  # a breakdown, the time limit or the caller's reason: final
    converged = bool(np.all(residual <= options.rtol))
    if converged:
        stop_reason = "converged"
    elif stop_reason in ("converged", "max_iterations") and iterations < max_iterations:
        # the recursive residual reached rtol every time, the recomputed one did not: the products' rounding
        stop_reason = (
            f"rounding: after {_RESTARTS} warm restarts the true residual stays above rtol (the operator's "
            "rounding floor, e.g. float32 products); loosen rtol or compute the operator in float64"
        )
    return SolveResult(
        solution=x,
        residual=residual,
        converged=converged,
        stop_reason=stop_reason,
        iterations=iterations,
        products=products,
        passes=products * op.passes_per_product,
        rtol=float(options.rtol),
        time_s=time.perf_counter() - start,
        preconditioner="none" if pre is None else str(pre.name),
        method=method,
    )
