"""The parameter-space block solver: randomized block descent on (Θ + λI) α = y with Θ = J Jᵀ never formed.

NOTE [parameter-space blocks]
    The solver keeps α (n = N·k numbers, FULL) and w = Jᵀα (P numbers) and visits blocks B of b examples in a
    random order each epoch. On a block:

    - its residual g = y_B − λα_B − (Θα)_B needs (Θα)_B = J_B w: one JVP over the block alone;
    - the step δ approximately solves (Θ_BB + λI) δ = g by ``inner_steps`` preconditioned CG steps, each a
      product with the block's own kernel, J_B (J_Bᵀ p): a VJP and a JVP over the block; the VJPs J_Bᵀ p are
      what w needs, so the update α_B += δ, w += J_Bᵀ δ costs nothing more;
    - the preconditioner is the block's kernel approximated from the structured engine on a subsample: the FULL
      columns Θ(x_B, x_S) at s landmark examples S ⊂ B (one ``compute_ntk`` call, b·s·k² entries) give a Nyström
      factor F (b·k × s·k), and each example's own k × k block Θ(x_n, x_n) − F_n F_nᵀ (``example_diagonal``)
      keeps the rest: P_B = F Fᵀ + blockdiag(Θ(x_n, x_n) − F_n F_nᵀ) + λI, applied by Woodbury (an s·k × s·k
      core). It is exact on the landmarks and on every example's own block, and P_B ⪰ λI.

    An epoch costs (1 + 2·inner_steps) / 2 passes over the data (a pass: a JVP and a VJP over all N examples)
    and takes N / b preconditioned steps, against one CG iteration per pass. Test predictions are J(x*) w: one
    JVP over the test set, no test-train operator. This is the linearized network trained with a preconditioned
    block optimizer: ASkotch (Rathore, Frangella, Yang, Dereziński, Udell) with its Nyström block preconditioner
    built by the structured engine, and its line search exact (the inner CG), so no step size is estimated. Each
    step decreases the error in the (Θ + λI)-norm, whatever the block, so the method cannot diverge.

    Blocks are drawn anew each epoch: the examples, in runs of ``BLOCK_CHUNK`` consecutive ones (a data set is read
    in slices), are shuffled and dealt into blocks, each block taking the same share of every partition (Ray's
    shard actors each work on every block). A partition fixed once converges too, but stalls: every block's
    residual is driven down while the error that lives across the fixed blocks barely moves. The residual is
    recomputed truly (w ← Jᵀα, then y − λα − J w: one pass) whenever the residuals seen at the blocks' visits
    suggest rtol is near, and every ``CHECK_EVERY`` epochs; that is also when w's accumulated rounding is reset.

    Where it is weak: errors in the null space of Jᵀ (n = N·k > P leaves n − P eigenvalues of Θ at exactly 0),
    which a block step shrinks only by λ / (λ + the block's floor) per visit; they do not move the predictions
    J(x*) w, but they hold the residual up. There the solver stagnates and ``auto`` goes on with CG from its α,
    which resolves that cluster in one iteration (NOTE [auto rule] in ``table.py``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg

from ntk_service.analysis.solve.operators import kernel_operator
from ntk_service.analysis.solve.problem import (
    HeldOut,
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
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.base import JacobianOperator, Ranges

__all__ = [
    "CHECK_EVERY",
    "DEFAULT_BLOCK_LANDMARKS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_INNER_STEPS",
    "BLOCK_CHUNK",
    "MAX_BLOCK_ROWS",
    "BlockPreconditioner",
    "BlockSolver",
    "block_preconditioner",
    "make_blocks",
]

DEFAULT_BLOCK_SIZE = 1000
"""Examples per block: large enough that a block's JVP and VJP run as batched passes (their fixed cost per call
amortized) and its landmark columns as one ``compute_ntk`` call, small enough that b·k × s·k columns stay tens of
MB (NOTE [block defaults])."""

DEFAULT_BLOCK_LANDMARKS = 32
"""Landmark examples per block (a Nyström factor of rank ≤ s·k; NOTE [block defaults])."""

DEFAULT_INNER_STEPS = 2
"""Preconditioned CG steps on each block's system (NOTE [block defaults])."""

MAX_BLOCK_ROWS = 200_000
"""The most rows b·k a block may have (its vectors and columns are b·k long)."""

BLOCK_CHUNK = 16
"""Examples per run of the random partition (NOTE [parameter-space blocks]): a block is random runs of this many
consecutive examples, read as slices; one fixed partition stalled at a residual of 7e-2 on the benchmark MLP's
kernel (N = 1000) where a partition drawn anew each epoch, of single examples or of runs of 10 or 25, went on at the
same 0.4-0.5 per epoch."""

CHECK_EVERY = 2
"""Epochs between true residual checks when the residuals seen at the visits are still far from rtol."""

STAGNATION_CHECKS = 4
"""A solve gives up ("stagnated") when its best true residual has not fallen by a quarter in this many checks:
a steady solve falls faster (the residual is not monotone, so the best is compared, and slowly is not stalled)."""

_OPERATION = "block solver"


@dataclass(frozen=True)
class BlockPreconditioner:
    """P_B⁻¹ of NOTE [parameter-space blocks] for one block: F (b·k, r), the per-example inverses of
    blockdiag(Θ_nn − F_n F_nᵀ) + λI (b, k, k), and the Cholesky factor of the Woodbury core (r, r)."""

    factor: np.ndarray
    inverses: np.ndarray
    core: Any
    scaled: np.ndarray

    def apply(self, v: np.ndarray) -> np.ndarray:
        """P_B⁻¹ v for v (b, k): (b, k)."""
        d: np.ndarray = np.einsum("nab,nb->na", self.inverses, v).reshape(-1)
        if self.factor.shape[1]:
            d -= self.scaled @ scipy.linalg.cho_solve(self.core, self.factor.T @ d)
        return d.reshape(v.shape)


def block_preconditioner(
    jacobian: JacobianOperator, ranges: Ranges, landmarks: np.ndarray, positions: np.ndarray, ridge: float
) -> BlockPreconditioner:
    """P_B of NOTE [parameter-space blocks] for the block ``ranges``.

    Args:
        jacobian: the FULL train operator. ranges: the block. landmarks: (s,) their example indices (global).
        positions: (s,) the landmarks' positions within the block's examples. ridge: λ > 0.
    """
    k = jacobian.k
    diagonal = jacobian.kernel_block(ranges, None, KernelMode.EXAMPLE_DIAGONAL)  # (b, k, k)
    b = diagonal.shape[0]
    factor = np.zeros((b * k, 0))
    if landmarks.size:
        columns = jacobian.kernel_block(ranges, landmarks, KernelMode.FULL)  # (b, s, k, k)
        c = columns.transpose(0, 2, 1, 3).reshape(b * k, landmarks.size * k)
        rows = (positions[:, None] * k + np.arange(k)).reshape(-1)
        w = c[rows]
        values, vectors = np.linalg.eigh((w + w.T) / 2)
        keep = values > max(float(values[-1]), 0.0) * w.shape[0] * np.finfo(np.float64).eps * 100
        factor = c @ (vectors[:, keep] / np.sqrt(values[keep]))
    blocks = factor.reshape(b, k, -1)
    rest = diagonal - np.einsum("nar,nbr->nab", blocks, blocks)
    rest = (rest + rest.transpose(0, 2, 1)) / 2 + ridge * np.eye(k)
    try:
        inverses = np.linalg.inv(rest)
    except np.linalg.LinAlgError:  # the Nyström error is PSD, so rest ⪰ λI but for rounding: lift it
        lift = float(np.abs(rest).max()) * 1e-10 + ridge
        inverses = np.linalg.inv(rest + lift * np.eye(k))
    scaled = np.einsum("nab,nbr->nar", inverses, blocks).reshape(b * k, -1)
    core = scipy.linalg.cho_factor(np.eye(factor.shape[1]) + factor.T @ scaled, lower=True)
    return BlockPreconditioner(factor=factor, inverses=inverses, core=core, scaled=scaled)


def make_blocks(
    partitions: list[tuple[int, int]], size: int, rng: np.random.Generator, chunk: int = BLOCK_CHUNK
) -> list[list[tuple[int, int]]]:
    """One epoch's blocks of about ``size`` examples: every partition cut into runs of ``chunk`` examples, the runs
    shuffled and dealt out, each block taking the same share of every partition (NOTE [parameter-space blocks]).
    Returns each block as its sorted ranges, consecutive runs merged."""
    runs = [[(a, min(a + chunk, stop)) for a in range(start, stop, chunk)] for start, stop in partitions]
    for part in runs:
        rng.shuffle(part)
    per = max(1, math.ceil(size / (chunk * len(partitions))))
    count = max(math.ceil(len(part) / per) for part in runs)
    blocks = []
    for j in range(count):
        chosen = sorted(r for part in runs for r in part[j * per : (j + 1) * per])
        merged: list[tuple[int, int]] = []
        for a, b in chosen:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        blocks.append(merged)
    return blocks


def _stalled(checks: list[float]) -> bool:
    """No quarter off the best residual in the last ``STAGNATION_CHECKS`` checks (NOTE [parameter-space blocks])."""
    if len(checks) <= STAGNATION_CHECKS:
        return False
    return min(checks[-STAGNATION_CHECKS:]) > 0.75 * min(checks[:-STAGNATION_CHECKS])


def _rows_of(ranges: Ranges) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in ranges])


class BlockSolver:
    """The parameter-space block method (NOTE [parameter-space blocks])."""

    name = "block"

    def refusal(self, problem: SolveProblem, options: SolverOptions) -> str | None:
        jacobian = problem.jacobian
        if jacobian is None:
            return (
                "it needs a FULL operator with the model behind it (ntk_operator, dataset_operator, ray_ntk_operator)"
            )
        if not jacobian.is_symmetric or jacobian.examples[0] != jacobian.examples[1]:
            return "it needs the train kernel Θ(x, x) (an operator built without x2)"
        if problem.rhs.shape[1] != 1:
            return "it solves one right-hand side (a FULL kernel's targets)"
        if problem.ridge <= 0:
            return "it needs a ridge λ > 0 (its block systems are Θ_BB + λI)"
        _settings(options, jacobian.examples[1], jacobian.k)  # raises on bad values
        return None

    def memory_bytes(self, problem: SolveProblem, options: SolverOptions) -> int:
        jacobian = problem.jacobian
        n = problem.rows
        if jacobian is None:
            return 6 * n * 8
        b, s, _ = _settings(options, jacobian.examples[1], jacobian.k)
        k = jacobian.k
        bk, sk = b * k, s * k
        own = (4 * jacobian.num_params + 5 * n) * 8  # w, Δw, J_Bᵀp and a spare; α, y, r, temporaries
        block = (4 * bk * sk + 3 * b * k * k + 8 * bk + 3 * sk * sk) * 8 + b * s * k * k * 8
        product = jacobian.estimate_bytes
        return own + block + product

    def solve(
        self,
        problem: SolveProblem,
        options: SolverOptions,
        *,
        progress: ProgressCallback | None = None,
        state: SolverState | None = None,
    ) -> SolverResult:
        jacobian = problem.jacobian
        if jacobian is None:
            raise InvalidInput(f"{_OPERATION}: {self.refusal(problem, options)}")
        return _BlockRun(self.name, problem, options, jacobian, progress, state).run()


def _settings(options: SolverOptions, examples: int, k: int) -> tuple[int, int, int]:
    """(block size b, landmarks s, inner steps), checked.

    Raises:
        InvalidInput: a block size, landmark count or inner step count out of range, naming the field.
    """
    b = DEFAULT_BLOCK_SIZE if options.block_size is None else options.block_size
    s = min(DEFAULT_BLOCK_LANDMARKS, b if isinstance(b, int) else 0) if options.landmarks is None else options.landmarks
    t = DEFAULT_INNER_STEPS if options.inner_steps is None else options.inner_steps
    for name, value, low in (("block_size", b, 1), ("landmarks", s, 0), ("inner_steps", t, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidInput(f"{_OPERATION}: {name} must be an integer ≥ {low}, got {value!r}")
    if b * k > MAX_BLOCK_ROWS:
        raise InvalidInput(
            f"{_OPERATION}: block_size {b} with k = {k} outputs is {b * k} rows per block, above {MAX_BLOCK_ROWS}; "
            f"use block_size ≤ {MAX_BLOCK_ROWS // k}"
        )
    if s > b:
        raise InvalidInput(f"{_OPERATION}: landmarks ({s}) must be ≤ block_size ({b}): they are examples of a block")
    return min(b, examples), s, t


class _BlockRun:
    """One run of the block method: its vectors and counters (NOTE [parameter-space blocks])."""

    def __init__(
        self,
        name: str,
        problem: SolveProblem,
        options: SolverOptions,
        jacobian: JacobianOperator,
        progress: ProgressCallback | None,
        state: SolverState | None,
    ) -> None:
        self.name, self.problem, self.options, self.j, self.progress = name, problem, options, jacobian, progress
        self.n_examples, self.k = jacobian.examples[1], jacobian.k
        self.b, self.s, self.inner = _settings(options, self.n_examples, self.k)
        self.lam = problem.ridge
        self.y = problem.rhs[:, 0].reshape(self.n_examples, self.k)
        self.ynorm = float(np.linalg.norm(self.y)) or 1.0
        self.start = time.perf_counter()
        self.rng = np.random.default_rng(options.seed)
        self.steps = self.epochs = 0
        self.passes = 0.0
        self.alpha = np.zeros((self.n_examples, self.k))
        self.w: np.ndarray | None = None
        self.residual_curve: list[tuple[float, float]] = []
        self.heldout_curve: list[tuple[float, float]] = []
        self.heldout = problem.heldout
        self.best_heldout: float | None = None
        self.since_best = 0
        self.checks: list[float] = []
        self.exact = False  # resumed from a checkpoint of this method (NOTE [exact resume])
        self.resumed_stop: str | None = None
        if state is not None:
            self._resume(state)
        self.heldout_targets = None
        if self.heldout is not None:
            m = self.heldout.kernel.examples[0] if isinstance(self.heldout.kernel, JacobianOperator) else None
            self.heldout_targets = check_heldout(self.heldout, m=m, k=self.k, operation=_OPERATION)

    def _resume(self, state: SolverState) -> None:
        alpha = np.asarray(state.solution, dtype=np.float64)
        if alpha.size != self.n_examples * self.k:
            raise ShapeMismatch(
                f"{_OPERATION}: the state's solution has {alpha.size} entries, this problem has "
                f"{self.n_examples * self.k}; resume with the state of the same problem"
            )
        self.alpha = alpha.reshape(self.n_examples, self.k).copy()
        weights = state.weights
        if weights is not None and np.asarray(weights).shape == (self.j.num_params,) and state.solver == self.name:
            self.w = np.array(weights, dtype=np.float64)
        if state.solver == self.name:  # another method's counters are its own (auto sums each method's)
            self.steps, self.epochs, self.passes = state.steps, state.epochs, state.passes
        if state.solver == self.name and "rng" in state.extras:
            self.rng.bit_generator.state = state.extras["rng"]
        extras = state.extras
        if self.w is not None and "checks" in extras:  # a checkpoint of this method: go on exactly from it
            self.exact = True
            self.checks = [float(c) for c in extras["checks"]]
            self.residual_curve = [(float(p), float(v)) for p, v in extras.get("residual_curve", ())]
            self.heldout_curve = [(float(p), float(v)) for p, v in extras.get("heldout_curve", ())]
            best = extras.get("best_heldout")
            self.best_heldout = None if best is None else float(best)
            self.since_best = int(extras.get("since_best", 0))
            self.resumed_stop = self._still(extras.get("stop"))

    def _still(self, stop: str | None) -> str | None:
        """A checkpoint's stop, if it still holds under these options (a time limit never does: time is new)."""
        if stop == "converged":
            return stop if self.checks and self.checks[-1] <= self.problem.rtol else None
        if stop == "max_passes":
            limit = self.options.max_passes
            return stop if limit is not None and self.passes >= limit else None
        return None if stop == "time_limit" else stop

    # --- the loop ------------------------------------------------------------------------------------------
    def run(self) -> SolverResult:
        checks = self.checks
        stop: str | None
        if self.exact:  # NOTE [exact resume]: the state is an epoch's end, w and the checks as they were
            stop = self.resumed_stop
        else:
            if self.w is None:
                self.w = self.j.vjp(self.alpha) if np.any(self.alpha) else np.zeros(self.j.num_params)
                self.passes += 0.5 if np.any(self.alpha) else 0.0
            residual = self._true_residual()
            checks.append(residual)
            stop = "converged" if residual <= self.problem.rtol else None
            self._report(residual, self._heldout(), None, stop)
        while stop is None:
            estimate_sq, stop = 0.0, None
            for block in make_blocks(self.j.partitions(), self.b, self.rng):
                estimate_sq += self._step(block)
                stop = self._limit()
                if stop is not None:
                    break
            else:
                self.epochs += 1
            estimate = math.sqrt(estimate_sq) / self.ynorm
            value = self._heldout_due()
            heldout_stop = self._patience(value)
            if stop is None and heldout_stop is None and estimate > 3 * self.problem.rtol and self.epochs % CHECK_EVERY:
                self._report(None, value, estimate, None)
                continue
            residual = self._true_residual()  # also before any stop: the result's residual is its α's
            checks.append(residual)
            if residual <= self.problem.rtol:
                stop = "converged"
            elif stop is None and _stalled(checks):
                stop = (
                    f"stagnated: the best residual did not fall by a quarter in {STAGNATION_CHECKS} checks (from "
                    f"{min(checks[:-STAGNATION_CHECKS]):.3g} to {min(checks[-STAGNATION_CHECKS:]):.3g})"
                )
            elif stop is None:
                stop = heldout_stop
            self._report(residual, value, estimate, stop)
        return self._result(stop, checks[-1])

    def _step(self, ranges: list[tuple[int, int]]) -> float:
        """One block step (NOTE [parameter-space blocks]); returns the block's squared residual at the visit."""
        assert self.w is not None
        rows = _rows_of(ranges)
        b = rows.size
        g = self.y[rows] - self.lam * self.alpha[rows] - self.j.jvp(self.w, ranges)
        seen = float(np.sum(g * g))
        s = min(self.s, b)
        positions = np.sort(self.rng.choice(b, size=s, replace=False)) if s else np.zeros(0, dtype=np.int64)
        pre = block_preconditioner(self.j, ranges, rows[positions], positions, self.lam)
        delta = np.zeros_like(g)
        dw = np.zeros_like(self.w)
        r = g
        z = pre.apply(r)
        p, rz = z, float(np.sum(r * z))
        for t in range(self.inner):
            u = self.j.vjp(p, ranges)
            q = self.j.jvp(u, ranges) + self.lam * p
            pq = float(np.sum(p * q))
            if not pq > 0:  # the block's kernel plus λ is PD: only rounding gets here
                break
            a = rz / pq
            delta += a * p
            dw += a * u
            if t + 1 < self.inner:
                r = r - a * q
                z = pre.apply(r)
                rz_new = float(np.sum(r * z))
                p, rz = z + (rz_new / rz) * p, rz_new
        self.alpha[rows] += delta
        self.w += dw
        self.steps += 1
        self.passes += (1 + 2 * self.inner) * b / (2 * self.n_examples)
        return seen

    def _limit(self) -> str | None:
        elapsed = time.perf_counter() - self.start
        if self.options.max_seconds is not None and elapsed > self.options.max_seconds:
            return "time_limit"
        if self.options.max_passes is not None and self.passes >= self.options.max_passes:
            return "max_passes"
        return None

    def _true_residual(self) -> float:
        """w ← Jᵀα and ‖y − λα − J w‖ / ‖y‖: one pass (NOTE [parameter-space blocks])."""
        if not np.any(self.alpha):
            self.w = np.zeros(self.j.num_params)
            value = 1.0 if np.any(self.y) else 0.0
        else:
            self.w = self.j.vjp(self.alpha)
            r = self.y - self.lam * self.alpha - self.j.jvp(self.w)
            self.passes += 1.0
            value = float(np.linalg.norm(r)) / self.ynorm
        self.residual_curve.append((self.passes, value))
        return value

    def _patience(self, value: float | None) -> str | None:
        """The held-out stop (``HeldOut.patience``): a reason once the metric has not improved that many times."""
        heldout = self.heldout
        if value is None or heldout is None or heldout.patience is None:
            return None
        best = self.best_heldout
        better = best is None or (value > best if heldout.metric == "accuracy" else value < best)
        self.best_heldout, self.since_best = (value, 0) if better else (best, self.since_best + 1)
        if self.since_best >= heldout.patience:
            return f"heldout: no better {heldout.metric} in {self.since_best} evaluations"
        return None

    def _heldout_due(self) -> float | None:
        if self.heldout is None or self.epochs % self.heldout.every:
            return None
        return self._heldout()

    def _heldout(self) -> float | None:
        heldout, targets = self.heldout, self.heldout_targets
        if heldout is None or targets is None:
            return None
        predictions = _predict(heldout, self.alpha, self.w, self.k)
        value = heldout_metric(predictions, targets, heldout.metric)
        self.heldout_curve.append((self.passes, value))
        if self.best_heldout is None:
            self.best_heldout = value
        return value

    def _state(self, stop: str | None = None) -> SolverState:
        """A checkpoint (NOTE [exact resume]): everything the loop reads, ``stop`` when the run ends here."""
        assert self.w is not None
        extras: dict[str, Any] = {
            "rng": self.rng.bit_generator.state,
            "checks": list(self.checks),
            "residual_curve": [list(point) for point in self.residual_curve],
            "heldout_curve": [list(point) for point in self.heldout_curve],
            "best_heldout": self.best_heldout,
            "since_best": self.since_best,
            "stop": stop,
        }
        return SolverState(
            solver=self.name,
            solution=self.alpha.reshape(-1, 1).copy(),
            weights=self.w.copy(),
            steps=self.steps,
            epochs=self.epochs,
            passes=self.passes,
            extras=extras,
        )

    def _report(self, residual: float | None, heldout: float | None, estimate: float | None, stop: str | None) -> None:
        if self.progress is None:
            return
        self.progress(
            Progress(
                solver=self.name,
                steps=self.steps,
                epochs=self.epochs,
                passes=self.passes,
                residual=residual
                if residual is not None
                else (self.residual_curve[-1][1] if self.residual_curve else None),
                heldout=heldout,
                elapsed_s=time.perf_counter() - self.start,
                state=self._state(stop),
                estimate=estimate,
                checkpoint=True,
                heldout_curve=tuple(self.heldout_curve),
            )
        )

    def _result(self, stop: str, residual: float) -> SolverResult:
        return SolverResult(
            solution=self.alpha.reshape(-1, 1).copy(),
            residual=np.array([residual]),
            converged=residual <= self.problem.rtol,
            stop_reason="converged" if residual <= self.problem.rtol else stop,
            solver=self.name,
            rtol=self.problem.rtol,
            time_s=time.perf_counter() - self.start,
            steps=self.steps,
            epochs=self.epochs,
            passes=self.passes,
            products=round(self.passes),
            weights=None if self.w is None else self.w.copy(),
            memory_bytes=BlockSolver().memory_bytes(self.problem, self.options),
            peak_rss_bytes=peak_rss_bytes(),
            residual_curve=tuple(self.residual_curve),
            heldout_curve=tuple(self.heldout_curve),
            preconditioner=f"block nystrom (b={self.b}, s={min(self.s, self.b)}, inner={self.inner})",
            state=self._state(stop),
        )


def _predict(heldout: HeldOut, alpha: np.ndarray, w: np.ndarray | None, k: int) -> np.ndarray:
    """Held-out predictions (M, k): J(x_heldout) w for a Jacobian operator, else Θ(x_heldout, x) α."""
    if isinstance(heldout.kernel, JacobianOperator) and w is not None:
        return heldout.kernel.jvp(w)
    cross = kernel_operator(heldout.kernel, k=k, name="heldout.kernel", operation=_OPERATION, cols=alpha.shape[0])
    return cross.apply(alpha.reshape(-1, 1)).reshape(-1, k)
