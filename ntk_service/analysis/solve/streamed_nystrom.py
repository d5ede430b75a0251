"""The shared Nyström preconditioner built from the model and x directly: oversampled landmarks, streamed columns.

NOTE [streamed nystrom]
    ``shared_nystrom_preconditioner`` (NOTE [shared nystrom]) takes the (N, m) block C = Θ_trace(x, x[S]) whole
    and keeps rank m. Uniform landmarks lose to the exact top-m eigenvectors of Θ_s = Θ_trace / k (twice the CG
    iterations at N = 8000, m = 800), and taking s = oversample·m columns and keeping the top m of their Nyström
    approximation recovers most of that at the same basis memory (docs/benchmarks.md, issue 26). But s columns of
    N rows are N·s floats (3.2 GB at N = 100,000, s = 4000), so here they are never held:

    - pass 1 computes C in row chunks, ``compute_ntk(model, x[i:j], x[S], mode="trace")``, accumulates the s × s
      Gram matrix G = CᵀC in float64 and keeps the rows of the landmarks themselves, W = C[S];
    - with W = Q diag(w) Qᵀ (modes below s·eps·‖W‖ dropped), Â = C W⁺ Cᵀ / k = F Fᵀ for F = C Q w^{-1/2} / √k, and
      FᵀF = w^{-1/2} Qᵀ G Q w^{-1/2} / k is s × s: its top m eigenpairs (V, Λ) are the top m of Â, and
      U = F V Λ^{-1/2} = C R with R = Q w^{-1/2} V Λ^{-1/2} / √k (s, m);
    - pass 2 recomputes the chunks (the same inputs give the same float64 rows) and writes U[i:j] = C[i:j] R.

    So the columns cost two trace passes over N × s (the products CG never spends) and the memory is the basis
    U (N, m) plus one chunk (rows, s) and a few s × s matrices, whatever s. A pass that kept C instead would
    spend N·s floats to save one pass; a randomized range finder on Θ_s would need products with the N × N trace
    kernel, which an operator does not give. The basis may be stored in float32 (``basis_dtype``): half the
    memory, so m can double within the same budget; it is applied in row blocks in float64 (``_apply``), and its
    columns are orthonormal to float32 rounding only (≈ 1e-7), far below the preconditioner's floor / λ_1.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ntk_service.analysis.solve.preconditioners import NystromPreconditioner
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, format_bytes
from ntk_service.kernels.api import compute_ntk
from ntk_service.kernels.runtime.device import default_memory_budget

__all__ = ["DEFAULT_OVERSAMPLE", "StreamedNystromPlan", "plan_streamed_nystrom", "streamed_nystrom_preconditioner"]

DEFAULT_OVERSAMPLE = 4.0
"""Landmark columns per kept mode: 4m -> m took 23 -> 14 iterations against 11 for the exact top m at N = 8000,
m = 800 (benchmarks/bench_nystrom_landmarks.py); each column is two trace passes over N examples."""

_CHUNK_BYTES = 256 * 2**20
"""Bound on one chunk of trace columns (rows × s float64, plus compute_ntk's float32 result): 5,600 rows at
s = 4000, so the pass's memory stays far below the basis's at N = 100,000."""

_SQUARE_COPIES = 5
"""float64 s × s arrays alive at once: G, W and its eigenvectors, FᵀF and its eigenvectors."""

_OPERATION = "streamed_nystrom_preconditioner"


@dataclass(frozen=True)
class StreamedNystromPlan:
    """What ``streamed_nystrom_preconditioner`` will build, decided before anything is computed.

    Attributes:
        examples: N. outputs: k. rank: m, the modes kept. columns: s = min(N, round(oversample·m)), the landmark
            examples. rows_per_chunk: rows of C computed at once. basis_dtype: of U (N, m).
        estimate_bytes: the basis, one chunk (float64 and float32) and ``_SQUARE_COPIES`` s × s float64 arrays;
            not ``compute_ntk``'s own workspace for a chunk, which its memory budget bounds (the N = 10,000,
            s = 4000 build peaked at 2.3 GB: docs/benchmarks.md, issue 26).
    """

    examples: int
    outputs: int
    rank: int
    columns: int
    rows_per_chunk: int
    basis_dtype: np.dtype
    estimate_bytes: int


def plan_streamed_nystrom(
    examples: int,
    *,
    outputs: int,
    landmarks: int,
    oversample: float = DEFAULT_OVERSAMPLE,
    rows_per_chunk: int | None = None,
    basis_dtype: str = "float64",
    memory_budget_bytes: int | None = None,
) -> StreamedNystromPlan:
    """Check the arguments and the memory of a streamed preconditioner (NOTE [streamed nystrom]).

    Args:
        examples: N ≥ 1. outputs: k ≥ 1. landmarks: m, the rank kept, 1 ≤ m ≤ N.
        oversample: ≥ 1; s = min(N, round(oversample·m)) landmark columns. Default: ``DEFAULT_OVERSAMPLE``.
        rows_per_chunk: rows of C per ``compute_ntk`` call. Default: as many as fit ``_CHUNK_BYTES``.
        basis_dtype: "float64" or "float32", the basis U's storage. Default: "float64".
        memory_budget_bytes: the limit. Default: ``default_memory_budget()``.

    Returns:
        StreamedNystromPlan.

    Raises:
        InvalidInput: m outside [1, N], oversample < 1 (or not finite), rows_per_chunk < 1, an unknown dtype.
        MemoryEstimateExceeded: the estimate is over the budget (the message gives it and the m that fits).
    """
    if examples < 1 or outputs < 1:
        raise InvalidInput(f"{_OPERATION}: needs N ≥ 1 examples and k ≥ 1 outputs, got N = {examples}, k = {outputs}")
    if not 1 <= landmarks <= examples:
        raise InvalidInput(f"{_OPERATION}: landmarks (the rank m kept) must be in [1, N = {examples}], got {landmarks}")
    if not (math.isfinite(oversample) and oversample >= 1):
        raise InvalidInput(
            f"{_OPERATION}: oversample must be ≥ 1 (s = oversample·m landmark columns, of which the top m modes are "
            f"kept), got {oversample}; use 1 for plain uniform landmarks"
        )
    if basis_dtype not in ("float64", "float32"):
        raise InvalidInput(f"{_OPERATION}: basis_dtype must be 'float64' or 'float32', got {basis_dtype!r}")
    s = min(examples, round(oversample * landmarks))
    rows = max(1, _CHUNK_BYTES // (s * 12)) if rows_per_chunk is None else int(rows_per_chunk)
    if rows < 1:
        raise InvalidInput(f"{_OPERATION}: rows_per_chunk must be ≥ 1, got {rows_per_chunk}")
    rows = min(rows, examples)
    dtype = np.dtype(basis_dtype)
    fixed = min(rows, examples) * s * 12 + _SQUARE_COPIES * s * s * 8
    needed = examples * landmarks * dtype.itemsize + fixed
    limit = default_memory_budget() if memory_budget_bytes is None else int(memory_budget_bytes)
    if needed > limit:
        fits = max(0, (limit - fixed) // (examples * dtype.itemsize))
        raise MemoryEstimateExceeded(
            f"{_OPERATION}: a {basis_dtype} basis of m = {landmarks} modes over {examples} examples, from s = {s} "
            f"landmark columns in chunks of {rows} rows, needs about {format_bytes(needed)}, over the memory budget "
            f"of {format_bytes(limit)}; use at most m = {fits} at this s, basis_dtype='float32', a smaller "
            "oversample or a larger budget",
            estimate_bytes=needed,
            budget_bytes=limit,
        )
    return StreamedNystromPlan(examples, outputs, landmarks, s, rows, dtype, needed)


def streamed_nystrom_preconditioner(
    model: nn.Module,
    x: torch.Tensor,
    *,
    ridge: float,
    outputs: int,
    landmarks: int,
    oversample: float = DEFAULT_OVERSAMPLE,
    seed: int = 0,
    rows_per_chunk: int | None = None,
    basis_dtype: str = "float64",
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
) -> NystromPreconditioner:
    """The shared Nyström preconditioner of Θ_trace / k (NOTE [shared nystrom]) from s = oversample·m uniform
    landmark examples, top m modes kept, the trace columns streamed in row chunks (NOTE [streamed nystrom]).

    Time: two ``compute_ntk(model, x[i:j], x[S], mode="trace")`` passes over all N rows (N·s trace entries each),
    plus N·s² + N·s·m + O(s³) flops. Memory: ``plan_streamed_nystrom``'s estimate, checked before anything runs.

    Example::

        pre = streamed_nystrom_preconditioner(model, x, ridge=1e-3, outputs=10, landmarks=100)
        pre.basis.shape  # (N, 100)
        conjugate_gradients(ntk_operator(model, x), y, ridge=1e-3, options=CgOptions(preconditioner=pre))

    Args:
        model: the network (as for ``compute_ntk``). x: (N, *input) tensor, the training inputs.
        ridge: μ ≥ 0 of Θ + μI. outputs: k, the model's outputs per example (Θ_trace / k is the shared part).
        landmarks: m, the modes kept (the basis's columns). oversample: s = min(N, round(oversample·m)) columns.
            Default: ``DEFAULT_OVERSAMPLE``. seed: the generator of the s uniform landmark examples. Default: 0.
        rows_per_chunk: rows per trace call. Default: the plan's (``_CHUNK_BYTES``); the result does not depend
            on it beyond rounding.
        basis_dtype: "float64" or "float32" storage of U. Default: "float64".
        dtype: ``compute_ntk``'s dtype for the columns (accumulated in float64 either way). Default: the model's.
        memory_budget_bytes: the limit for this build (and each ``compute_ntk`` call). Default:
            ``default_memory_budget()``.

    Returns:
        NystromPreconditioner with ``outputs = k``, basis (N, m') (m' ≤ m: modes below N·eps of the largest are
        dropped), eigenvalues (m',) of Â descending, ``landmarks`` the s example indices, method
        "streamed 4x, float64 basis" (the oversampling and the dtype), ``products`` 0, ``build_seconds``,
        ``column_passes`` 2.

    Raises:
        InvalidInput: m outside [1, N], oversample < 1, bad rows_per_chunk or basis_dtype (``plan_streamed_nystrom``).
        MemoryEstimateExceeded: the plan's estimate is over the budget, before anything is computed.
    """
    start = time.perf_counter()
    n = int(x.shape[0])
    plan = plan_streamed_nystrom(
        n,
        outputs=outputs,
        landmarks=landmarks,
        oversample=oversample,
        rows_per_chunk=rows_per_chunk,
        basis_dtype=basis_dtype,
        memory_budget_bytes=memory_budget_bytes,
    )
    chosen = np.sort(np.random.default_rng(seed).choice(n, size=plan.columns, replace=False))
    x_landmarks = x[torch.as_tensor(chosen)]

    def chunks() -> list[tuple[int, int]]:
        return [(i, min(i + plan.rows_per_chunk, n)) for i in range(0, n, plan.rows_per_chunk)]

    def columns(i: int, j: int) -> np.ndarray:
        theta = compute_ntk(
            model, x[i:j], x_landmarks, mode="trace", dtype=dtype, memory_budget_bytes=memory_budget_bytes
        ).theta
        return theta.detach().cpu().double().numpy()

    gram = np.zeros((plan.columns, plan.columns))
    w = np.empty((plan.columns, plan.columns))
    for i, j in chunks():  # pass 1: G = CᵀC and W = C[S]
        c = columns(i, j)
        gram += c.T @ c
        lo, hi = np.searchsorted(chosen, [i, j])
        w[lo:hi] = c[chosen[lo:hi] - i]
    projection, eigenvalues = _projection(gram, w, outputs, landmarks, n)
    del gram, w
    basis = np.empty((n, eigenvalues.size), dtype=plan.basis_dtype)
    if eigenvalues.size:
        for i, j in chunks():  # pass 2: U = C R
            basis[i:j] = columns(i, j) @ projection
    scale = f"{plan.columns / landmarks:g}x" if plan.columns != landmarks else "1x"
    return NystromPreconditioner(
        basis=basis,
        eigenvalues=eigenvalues,
        shift=float(ridge),
        landmarks=chosen,
        method=f"streamed {scale}, {plan.basis_dtype.name} basis",
        products=0,
        outputs=outputs,
        build_seconds=time.perf_counter() - start,
        column_passes=2,
    )


def _projection(gram: np.ndarray, w: np.ndarray, k: int, m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """R (s, m') and Λ (m',) descending with U = C R the top m' ≤ m eigenvectors of C W⁺ Cᵀ / k, from G = CᵀC and
    W = C[S]; modes of W below s·eps·‖W‖, and of Â below n·eps of its largest, are dropped (as ``nystrom_basis``
    does)."""
    w = (w + w.T) / 2
    values, vectors = np.linalg.eigh(w)
    keep = values > max(float(values[-1]), 0.0) * w.shape[0] * np.finfo(np.float64).eps * 10
    if not np.any(keep):
        return np.zeros((w.shape[0], 0)), np.zeros(0)
    whiten = vectors[:, keep] / np.sqrt(values[keep] * k)  # F = C · whiten
    core = whiten.T @ gram @ whiten  # FᵀF
    lam, v = np.linalg.eigh((core + core.T) / 2)
    lam, v = lam[::-1][:m], v[:, ::-1][:, :m]
    top = lam > max(float(lam[0]), 0.0) * n * np.finfo(np.float64).eps
    projection: np.ndarray = whiten @ (v[:, top] / np.sqrt(lam[top]))
    return projection, lam[top]
