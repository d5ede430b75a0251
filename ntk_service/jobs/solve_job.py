"""Solve jobs: kernel ridge, GP mean or linearized predictions at t = ∞ on stored data sets, by operator CG.

A solve job never forms a kernel. The train kernel is ``dataset_operator`` over the train rows (read in chunks from
the data set's memory map), CG (``conjugate_gradients``) solves (Θ + λI) α = y − f0 on it, and the test predictions
are f0* + Θ(test, train) α, one more streamed product per target column. Memory is O(P + chunk) plus the N·k
numbers of each CG vector, whatever N is.

    kernel_ridge   α = (Θ + λI)⁻¹ y,                predictions = Θ* α
    gp_mean        the same system: the NTK-GP posterior mean with noise variance λ (zero prior mean)
    linearized     α = (Θ + λI)⁻¹ (y − f0),         predictions = f0* + Θ* α: the linearized network trained to
                   t = ∞ by gradient flow on the MSE from its initial outputs f0 (Lee et al. 2019; λ = 0 for the
                   unregularized limit, as ``linearized_predictions(times=[inf])``)

A TRACE job reads the kernel as (Θ_trace / k) ⊗ I_k, as ``gp_inference`` does (NOTE [operator layout] in
``analysis/solve/operators.py``).

NOTE [solve progress]
    ``conjugate_gradients`` reports its residual only when it returns, so a job runs CG in segments of
    ``progress_every`` iterations, each warm-started from the previous solution (``x0``) with the same
    preconditioner (built once): after every segment the job's progress holds the true relative residual and the
    iterations so far. A restart drops the Krylov space, so a segmented solve can take a few more iterations
    than one long run; ``progress_every`` large (or ≥ max_iterations) gives the single run. Products, passes and
    elapsed time move with every operator product, and cancellation is checked before each product, so a cancel
    takes effect within one product.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from ntk_service.kernels.operators.streaming_operator import DEFAULT_EXAMPLES_PER_CHUNK, dataset_operator

__all__ = [
    "DEFAULT_PROGRESS_EVERY",
    "SOLVE_KINDS",
    "SolveCancelled",
    "SolveOptions",
    "SolveOutcome",
    "SolveSpec",
    "check_targets",
    "run_solve",
]

SOLVE_KINDS = ("kernel_ridge", "gp_mean", "linearized")
"""What a solve job computes (module docstring)."""

SOLVE_MODES = ("full", "trace")
"""The kernel modes a solve runs on (the operator modes)."""

PRECONDITIONERS = ("auto", "nystrom", "none")
"""As ``CgOptions.preconditioner``."""

DEFAULT_PROGRESS_EVERY = 200
"""CG iterations per segment (NOTE [solve progress]). Restarts cost convergence on an ill-conditioned kernel: on
a tiny tanh MLP (N = 20, k = 3, FULL, ridge 1e-3, condition ≈ 4·10⁴) one CG run converged in 191 iterations, while
segments of 5 had not reached a residual below 0.9 after 600; 200 keeps the benchmark solves (50-250 iterations)
at one or two segments while a long solve still shows its residual."""

_OPERATION = "solve job"


class SolveCancelled(Exception):
    """Raised inside a running solve when its job was cancelled (never leaves the job engine)."""


@dataclass(frozen=True, slots=True)
class SolveOptions:
    """What a solve computes and how, whatever its rows come from (a job's data sets, an inline request).

    Attributes:
        kind: one of ``SOLVE_KINDS``. mode: "full" or "trace". dtype: the products' dtype ("float32" / "float64").
        params: parameter-name globs, None = all. ridge: λ ≥ 0 (absolute).
        rtol, max_iterations, preconditioner, landmarks: as ``CgOptions``.
        progress_every: CG iterations per segment (NOTE [solve progress]).
        examples_per_chunk: rows per read (``dataset_operator``). memory_budget_bytes: per product, None = default.
    """

    kind: str
    mode: str = "full"
    dtype: str = "float64"
    params: list[str] | None = None
    ridge: float = 0.0
    rtol: float = 1e-8
    max_iterations: int | None = None
    preconditioner: str = "auto"
    landmarks: int | None = None
    progress_every: int = DEFAULT_PROGRESS_EVERY
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK
    memory_budget_bytes: int | None = None


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

    @property
    def kind(self) -> str:
        return self.options.kind

    def to_dict(self) -> dict[str, Any]:
        """The rows and the options in one flat mapping (the stored and public form)."""
        rows = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        return {**rows, **dataclasses.asdict(self.options)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SolveSpec:
        names = {f.name for f in dataclasses.fields(SolveOptions)}
        options = SolveOptions(**{key: value for key, value in data.items() if key in names})
        return cls(**{key: value for key, value in data.items() if key not in names}, options=options)


@dataclass(frozen=True, slots=True)
class SolveOutcome:
    """A finished solve: alpha (n, k) float64, predictions (m, k) float64 or None, and the CG report."""

    alpha: np.ndarray
    predictions: np.ndarray | None
    converged: bool
    stop_reason: str
    iterations: int
    residual: list[float]
    products: int
    passes: int
    time_s: float
    preconditioner: str

    def summary(self) -> dict[str, Any]:
        """The JSON-able fields (everything but the arrays)."""
        return {
            "converged": self.converged,
            "stop_reason": self.stop_reason,
            "iterations": self.iterations,
            "residual": self.residual,
            "products": self.products,
            "passes": self.passes,
            "time_s": round(self.time_s, 6),
            "preconditioner": self.preconditioner,
            "alpha_shape": list(self.alpha.shape),
            "predictions_shape": None if self.predictions is None else list(self.predictions.shape),
        }


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


def _watched(op: KernelOperator, on_product: Callable[[int], None]) -> KernelOperator:
    """``op`` whose ``apply`` first calls ``on_product(columns)`` (progress, cancellation)."""

    def apply(v: np.ndarray) -> np.ndarray:
        on_product(int(v.shape[1]))
        return op.apply(v)

    return dataclasses.replace(op, apply=apply)


def run_solve(
    spec: SolveOptions,
    module: nn.Module,
    train: Any,
    targets: np.ndarray,
    test: Any,
    *,
    k: int,
    should_stop: Callable[[], bool] = lambda: False,
    report: Callable[[dict[str, Any]], None] = lambda progress: None,
) -> SolveOutcome:
    """Run one solve (module docstring): a job's, or an inline request's.

    Args:
        spec: the options. module: the model (read only). train: (n, *input) rows (a memmap, an array).
        targets: (n, k) or (n,). test: (m, *input) rows or None. k: outputs per example.
        should_stop: True once the job is cancelled (checked before each product). Default: never.
        report: called with the progress dict {iterations, residual, products, passes, elapsed_s}. Default: none.

    Returns:
        SolveOutcome: alpha (n, k), predictions (m, k) or None, converged and the cost.

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
    progress: dict[str, Any] = {"iterations": 0, "residual": None, "products": 0, "passes": 0, "elapsed_s": 0.0}

    def on_product(columns: int) -> None:
        if should_stop():
            raise SolveCancelled
        progress["products"] += columns
        progress["passes"] += columns * passes_per_product
        progress["elapsed_s"] = round(time.perf_counter() - start, 3)
        report(dict(progress))

    train_op = kernel_operator(
        dataset_operator(module, train, **common), k=k, name="the train kernel", operation=_OPERATION, rows=n, cols=n
    )
    passes_per_product = train_op.passes_per_product
    watched = _watched(train_op, on_product)
    f0 = _outputs(module, train, dtype, spec.examples_per_chunk) if spec.kind == "linearized" else np.zeros_like(y)
    rhs = y - f0
    full = train_op.mode.value == "full"
    b = rhs.reshape(n * k, 1) if full else rhs
    choice = spec.preconditioner
    if choice == "auto":
        choice = "nystrom" if train_op.rows >= AUTO_NYSTROM_MIN_SIZE else "none"
    pre: Any = "none"
    if choice == "nystrom":
        pre = nystrom_preconditioner(watched, ridge=ridge, landmarks=spec.landmarks)
    cap = spec.max_iterations if spec.max_iterations is not None else min(10 * train_op.rows, 2000)
    x, iterations, result = None, 0, None
    while True:
        segment = min(spec.progress_every, cap - iterations)
        options = CgOptions(rtol=spec.rtol, max_iterations=segment, preconditioner=pre)
        result = conjugate_gradients(watched, b, ridge=ridge, options=options, x0=x)
        x, iterations = result.solution, iterations + result.iterations
        progress["iterations"] = iterations
        progress["residual"] = float(np.max(result.residual))
        report(dict(progress))
        if result.converged or iterations >= cap or result.stop_reason.startswith("breakdown") or segment == 0:
            break
        if result.iterations == 0:  # CG made no step (it cannot), stop rather than loop
            break
    alpha = x.reshape(n, k)
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
        moved = _watched(test_op, on_product).apply(x).reshape(m, k)
        f0_test = _outputs(module, test, dtype, spec.examples_per_chunk) if spec.kind == "linearized" else 0.0
        predictions = f0_test + moved
    return SolveOutcome(
        alpha=alpha,
        predictions=predictions,
        converged=bool(result.converged),
        stop_reason=result.stop_reason,
        iterations=iterations,
        residual=[float(r) for r in result.residual],
        products=int(progress["products"]),
        passes=int(progress["passes"]),
        time_s=time.perf_counter() - start,
        preconditioner=result.preconditioner,
    )


def check_choice(value: str, allowed: tuple[str, ...], what: str) -> str:
    """``value`` if allowed, else InvalidInput naming the choices (for callers that bypass the HTTP schema)."""
    if value not in allowed:
        raise InvalidInput(f"{_OPERATION}: unknown {what} {value!r}; expected one of {', '.join(allowed)}")
    return value
