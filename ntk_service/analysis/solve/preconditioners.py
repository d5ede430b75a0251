"""Nyström preconditioners for (A + μI) x = b on a kernel A that is only seen through products.

NOTE [nystrom preconditioner]
    m landmark columns C = A[:, S] (each one product with a unit vector, or given) give the Nyström
    approximation Â = C A[S, S]⁺ Cᵀ = F Fᵀ, F (n, m'), or a pivoted Cholesky gives Â = F Fᵀ directly. With the
    thin SVD F = U Σ Vᵀ (from the eigenpairs of FᵀF) and Λ = Σ², the preconditioner of Frangella, Tropp and
    Udell (2023, "Randomized Nyström preconditioning") is P⁻¹ = (λ_min(Λ) + μ) U (Λ + μI)⁻¹ Uᵀ + (I − U Uᵀ): it
    maps the top m' modes of A + μI to about λ_min(Λ) + μ and leaves the rest, so CG's condition number drops
    from (λ_1 + μ)/(λ_n + μ) to about (λ_{m'+1} + μ)/(λ_n + μ). NTK spectra fall fast (the top k modes of an
    MLP are the class-mean directions, orders of magnitude above the bulk), so a few dozen landmarks remove most
    of the conditioning.

    ``DEFAULT_LANDMARKS`` = 100 columns: building costs m products, i.e. about m CG iterations, so m should be
    well below the iterations it saves; at m = 100 the factorization is O(n·m²) flops and n·m floats of memory
    (800 MB at n = 10⁶), and benchmarks/bench_solvers.py prints iterations with and without it. CG builds it by
    default only from n = 50,000 rows (NOTE [cg default] in ``cg.py``: below that, on an MLP's NTK, it did not pay).

    Landmarks are "uniform" (m indices drawn without replacement from a seeded generator: what an operator
    allows, since its diagonal is unknown), "pivoted_cholesky" (greedy on the largest remaining diagonal, as
    GPyTorch's BBMM does; needs the diagonal, known for a dense kernel or passed in), or "gaussian" (Y = A Ω for
    an orthonormalized Gaussian Ω (n, m), the randomized Nyström of Frangella et al.; same m products, no
    landmark indices). On the tests' spectra the three needed iterations within 15 % of each other.

NOTE [shared nystrom]
    A FULL kernel of n = N·k rows needs a basis covering k times the modes of its scalar part, and the basis of
    m columns costs m products and n·m floats (8 GB at n = 10⁶, m = 1000). The NTK of a network whose outputs
    come from one last layer is close to (Θ_trace / k) ⊗ I_k (the outputs differ only in the last layer's rows),
    so ``shared_nystrom_preconditioner`` builds the Nyström preconditioner of the N × N scalar kernel
    Θ_s = Θ_trace / k from m landmark *examples* (its columns Θ_trace(x, x[S]), one ``compute_ntk(model, x,
    x[S], mode="trace")`` call, far cheaper than m·k products) and applies it to every output at once
    (P_s ⊗ I_k in the example-major layout): N·m floats for m·k of the FULL kernel's directions. With m above
    the input dimension it removes the input-linear part of an MLP's spectrum, whose modes grow with N
    (benchmarks/bench_solvers.py --section scale; docs/benchmarks.md, issue 26).

    Memory is accounted before anything is built: the columns, the factor and its basis take about
    ``_BASIS_COPIES`` × N·m float64s, refused over ``memory_budget_bytes`` with the estimate and the m that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ntk_service.analysis.solve.operators import KernelOperator
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch, format_bytes
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.runtime.device import default_memory_budget

__all__ = [
    "DEFAULT_LANDMARKS",
    "LandmarkMethod",
    "NystromPreconditioner",
    "nystrom_basis",
    "nystrom_preconditioner",
    "shared_nystrom_preconditioner",
]

DEFAULT_LANDMARKS = 100
"""Landmark columns of the default Nyström preconditioner, capped at n (NOTE [nystrom preconditioner])."""

LandmarkMethod = Literal["gaussian", "uniform", "pivoted_cholesky"]
"""How landmark columns are chosen (NOTE [nystrom preconditioner])."""

_OPERATION = "nystrom_preconditioner"

_APPLY_ROWS = 8192
"""Rows of a float32 basis upcast at once in ``apply`` (64 MB at m = 1000)."""

_BASIS_COPIES = 3
"""float64 (rows, m) arrays alive at once while a preconditioner is built: the columns, the factor and the
basis U (``nystrom_basis`` never forms an SVD's workspace) (NOTE [shared nystrom])."""


@dataclass(frozen=True)
class NystromPreconditioner:
    """P⁻¹ of NOTE [nystrom preconditioner] for A + μI.

    Attributes:
        basis: U (n, m'), orthonormal columns. eigenvalues: Λ (m',) descending, the Nyström eigenvalues of A.
        shift: μ (the ridge). landmarks: (m,) the column indices used. method: how they were chosen.
        products: operator products spent building it. outputs: k when the basis is over examples and shared by
            the k outputs of a FULL kernel (NOTE [shared nystrom]; basis (N, m'), applied as P_s ⊗ I_k), else 1.
        build_seconds: wall time of the build when the builder measured it (the streamed one), else 0.
        column_passes: passes of trace columns over the N examples spent instead of products (the streamed
            builder's two, NOTE [streamed nystrom] in ``streamed_nystrom.py``), else 0.
    """

    basis: np.ndarray
    eigenvalues: np.ndarray
    shift: float
    landmarks: np.ndarray
    method: str
    products: int
    outputs: int = 1
    build_seconds: float = 0.0
    column_passes: int = 0

    @property
    def name(self) -> str:
        shared = f", shared by {self.outputs} outputs" if self.outputs > 1 else ""
        columns = "s" if self.column_passes else "m"  # the streamed builder keeps m modes of s columns
        return f"nystrom({self.method}, {columns}={self.landmarks.size}, rank={self.eigenvalues.size}{shared})"

    def apply(self, r: np.ndarray) -> np.ndarray:
        """P⁻¹ R for R (n, r): (n, r)."""
        if self.eigenvalues.size == 0:
            return r.copy()
        if self.outputs > 1:  # rows n·k + a: the examples' basis acts on every (output, column) pair at once
            n, width = r.shape
            return self._apply(r.reshape(n // self.outputs, self.outputs * width)).reshape(n, width)
        return self._apply(r)

    def _apply(self, r: np.ndarray) -> np.ndarray:
        u = self.basis
        floor = float(self.eigenvalues[-1]) + self.shift
        factor = (floor / (self.eigenvalues + self.shift) - 1.0)[:, None]
        if u.dtype == np.float64:
            out: np.ndarray = r + u @ (factor * (u.T @ r))
            return out
        # a float32 basis in float64 row blocks: numpy would otherwise upcast a whole (n, m) copy per product
        blocks = range(0, u.shape[0], _APPLY_ROWS)
        coeffs = np.zeros((u.shape[1], r.shape[1]))
        for i in blocks:
            coeffs += u[i : i + _APPLY_ROWS].astype(np.float64).T @ r[i : i + _APPLY_ROWS]
        delta = factor * coeffs
        out = r.copy()
        for i in blocks:
            out[i : i + _APPLY_ROWS] += u[i : i + _APPLY_ROWS].astype(np.float64) @ delta
        return out


def _pivoted_cholesky(op: KernelOperator, diagonal: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Greedy pivoted Cholesky: F (n, m') with A ≈ F Fᵀ, the pivots, and the products spent (one per pivot)."""
    n = op.rows
    residual = diagonal.astype(np.float64).copy()
    factor = np.zeros((n, m))
    pivots: list[int] = []
    stop = float(np.max(residual)) * n * np.finfo(np.float64).eps if n else 0.0
    for j in range(m):
        i = int(np.argmax(residual))
        if residual[i] <= stop:
            break
        unit = np.zeros((n, 1))
        unit[i, 0] = 1.0
        column = op.apply(unit)[:, 0]
        column -= factor[:, :j] @ factor[i, :j]
        factor[:, j] = column / np.sqrt(residual[i])
        residual -= factor[:, j] ** 2
        residual[i] = 0.0
        pivots.append(i)
    return factor[:, : len(pivots)], np.asarray(pivots, dtype=np.int64), len(pivots)


def _nystrom_factor(columns: np.ndarray, landmarks: np.ndarray) -> np.ndarray:
    """F (n, m') with C W⁺ Cᵀ = F Fᵀ, W = C[S] symmetrized; modes of W below n·eps·‖W‖ are dropped."""
    w = columns[landmarks]
    w = (w + w.T) / 2
    values, vectors = np.linalg.eigh(w)
    keep = values > max(float(values[-1]), 0.0) * w.shape[0] * np.finfo(np.float64).eps * 10
    if not np.any(keep):
        return np.zeros((columns.shape[0], 0))
    factor: np.ndarray = columns @ (vectors[:, keep] / np.sqrt(values[keep]))
    return factor


def _sketch_factor(omega: np.ndarray, sketch: np.ndarray) -> np.ndarray:
    """F with Y (Ωᵀ Y)⁺ Yᵀ = F Fᵀ for Y = A Ω, shifted by ν = n·eps·‖Y‖ for stability (Frangella et al.,
    Algorithm 2.1; the shift is taken back off the eigenvalues in ``nystrom_preconditioner``'s SVD step)."""
    nu = omega.shape[0] * np.finfo(np.float64).eps * float(np.linalg.norm(sketch))
    shifted = sketch + nu * omega
    core = omega.T @ shifted
    values, vectors = np.linalg.eigh((core + core.T) / 2)
    keep = values > max(float(values[-1]), 0.0) * core.shape[0] * np.finfo(np.float64).eps * 10
    factor: np.ndarray = shifted @ (vectors[:, keep] / np.sqrt(values[keep]))
    return factor


def nystrom_basis(factor: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """U and Λ = Σ² of the thin SVD of F, without the modes below √(n·eps) of the largest: from the eigenpairs
    of the m × m Gram matrix FᵀF (U = F V Σ⁻¹), so only F and U are ever (n, m). Squaring the singular values
    loses nothing here: the modes kept have Σ² ≥ n·eps·Σ₀², far above the Gram matrix's rounding (eps·Σ₀²)."""
    if factor.shape[1] == 0:
        return np.zeros((n, 0)), np.zeros(0)
    values, vectors = np.linalg.eigh(factor.T @ factor)
    order = np.argsort(values)[::-1]
    values, vectors = values[order], vectors[:, order]
    keep = values > max(float(values[0]), 0.0) * n * np.finfo(np.float64).eps
    basis: np.ndarray = factor @ (vectors[:, keep] / np.sqrt(values[keep]))
    return basis, values[keep]


def nystrom_preconditioner(
    op: KernelOperator,
    *,
    ridge: float,
    landmarks: int | None = None,
    method: LandmarkMethod | str = "uniform",
    seed: int = 0,
    diagonal: np.ndarray | None = None,
    columns: np.ndarray | None = None,
    landmark_indices: np.ndarray | None = None,
    memory_budget_bytes: int | None = None,
) -> NystromPreconditioner:
    """A Nyström preconditioner for op + ridge·I (NOTE [nystrom preconditioner]).

    Args:
        op: the square kernel (``kernel_operator``). ridge: μ ≥ 0.
        landmarks: m. Default: min(n, ``DEFAULT_LANDMARKS``).
        method: "uniform", "pivoted_cholesky" or "gaussian". Default: "uniform".
        seed: the generator of uniform landmarks. Default: 0.
        diagonal: (n,) A's diagonal, for "pivoted_cholesky" on an operator (a dense kernel has its own).
        columns, landmark_indices: A[:, S] (n, m) and S (m,), computed elsewhere (e.g. ``compute_ntk(model, x,
            x[S])``, far cheaper than m operator products); then no product is spent.

    Returns:
        NystromPreconditioner.

    Raises:
        InvalidInput: m < 1, an unknown method, "pivoted_cholesky" on an operator without ``diagonal``.
        ShapeMismatch: columns or indices that do not fit the operator.
        MemoryEstimateExceeded: the n × m basis would not fit (the message gives the estimate and the m that fits).
    """
    n = op.rows
    if op.rows != op.cols:
        raise ShapeMismatch(f"{_OPERATION}: the kernel has shape {op.shape}; a preconditioner needs a square one")
    if columns is not None:
        cols = np.asarray(columns, dtype=np.float64)
        idx = np.asarray(landmark_indices, dtype=np.int64).reshape(-1) if landmark_indices is not None else None
        if idx is None or cols.ndim != 2 or cols.shape != (n, idx.size) or np.any(idx < 0) or np.any(idx >= n):
            raise ShapeMismatch(
                f"{_OPERATION}: columns has shape {cols.shape} with {None if idx is None else idx.size} landmark "
                f"indices; expected A[:, S] of shape ({n}, m) and m indices S in [0, {n})"
            )
        factor, products, chosen = _nystrom_factor(cols, idx), 0, idx
        method = "given"
    else:
        m = min(n, DEFAULT_LANDMARKS) if landmarks is None else int(landmarks)
        if m < 1 or m > n:
            raise InvalidInput(f"{_OPERATION}: landmarks must be in [1, n = {n}], got {landmarks}")
        _check_basis_memory(n, m, memory_budget_bytes, _OPERATION)
        if method == "uniform":
            chosen = np.sort(np.random.default_rng(seed).choice(n, size=m, replace=False))
            unit = np.zeros((n, m))
            unit[chosen, np.arange(m)] = 1.0
            cols = op.apply(unit)
            factor, products = _nystrom_factor(cols, chosen), m
        elif method == "gaussian":
            omega, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, m)))
            factor, products, chosen = _sketch_factor(omega, op.apply(omega)), m, np.arange(0)
        elif method == "pivoted_cholesky":
            diag = np.diag(op.matrix) if op.matrix is not None and diagonal is None else diagonal
            if diag is None:
                raise InvalidInput(
                    f"{_OPERATION}: method 'pivoted_cholesky' needs the kernel's diagonal, which an operator does not "
                    "know; pass diagonal= (e.g. from compute_ntk(mode='example_diagonal')) or use method='uniform'"
                )
            diag = np.asarray(diag, dtype=np.float64).reshape(-1)
            if diag.shape != (n,):
                raise ShapeMismatch(f"{_OPERATION}: diagonal has shape {diag.shape}; expected ({n},)")
            factor, chosen, products = _pivoted_cholesky(op, diag, m)
        else:
            raise InvalidInput(
                f"{_OPERATION}: unknown method {method!r}; expected 'uniform', 'pivoted_cholesky' or 'gaussian'"
            )
    basis, eigenvalues = nystrom_basis(factor, n)
    return NystromPreconditioner(
        basis=basis,
        eigenvalues=eigenvalues,
        shift=float(ridge),
        landmarks=np.asarray(chosen),
        method=str(method),
        products=products,
    )


def _check_basis_memory(rows: int, m: int, budget: int | None, operation: str) -> None:
    limit = default_memory_budget() if budget is None else int(budget)
    needed = _BASIS_COPIES * rows * m * 8
    if needed > limit:
        fits = max(0, limit // (_BASIS_COPIES * rows * 8))
        raise MemoryEstimateExceeded(
            f"{operation}: a basis of m = {m} columns over {rows} rows needs about {format_bytes(needed)} while it is "
            f"built ({_BASIS_COPIES} float64 copies), over the memory budget of {format_bytes(limit)}; use at most "
            f"m = {fits} landmarks or a larger budget",
            estimate_bytes=needed,
            budget_bytes=limit,
        )


def shared_nystrom_preconditioner(
    op: KernelOperator,
    *,
    ridge: float,
    trace_columns: Any,
    landmark_indices: Any,
    memory_budget_bytes: int | None = None,
) -> NystromPreconditioner:
    """The Nyström preconditioner of a FULL kernel's scalar part Θ_trace / k, shared by its k outputs
    (NOTE [shared nystrom]).

    Args:
        op: the square FULL kernel (``kernel_operator``), N·k rows in the example-major layout. ridge: μ ≥ 0.
        trace_columns: (N, m) Θ_trace(x, x[S]), the TRACE kernel (the plain sum over outputs) of all N training
            examples against the m landmark examples, e.g. ``compute_ntk(model, x, x[S], mode="trace").theta``.
        landmark_indices: (m,) S, the landmark examples' rows in x.
        memory_budget_bytes: the limit for building the basis. Default: ``default_memory_budget()``.

    Returns:
        NystromPreconditioner with ``outputs = k`` and basis (N, m'); ``products`` 0 (the columns came from
        elsewhere).

    Raises:
        InvalidInput: a kernel that is not FULL. ShapeMismatch: columns or indices that do not fit the operator.
        MemoryEstimateExceeded: the basis would not fit (the message gives the estimate and the m that fits).
    """
    operation = "shared_nystrom_preconditioner"
    if op.rows != op.cols or op.mode is not KernelMode.FULL:
        raise InvalidInput(
            f"{operation}: needs a square FULL kernel (N·k rows, example-major), got a {op.mode.value} kernel of "
            f"shape {op.shape}; for a TRACE kernel use nystrom_preconditioner(columns=...) on its own columns"
        )
    n, k = op.n, op.k
    raw = trace_columns.detach().cpu().numpy() if hasattr(trace_columns, "detach") else trace_columns
    shape = tuple(np.shape(raw))
    idx = np.asarray(landmark_indices, dtype=np.int64).reshape(-1)
    if len(shape) != 2 or shape != (n, idx.size) or idx.size == 0 or np.any(idx < 0) or np.any(idx >= n):
        raise ShapeMismatch(
            f"{operation}: trace_columns has shape {shape} with {idx.size} landmark indices; expected "
            f"Θ_trace(x, x[S]) of shape ({n}, m) and m ≥ 1 indices S in [0, {n}) for this kernel of {n} examples"
        )
    _check_basis_memory(n, idx.size, memory_budget_bytes, operation)
    # (C / k)(W / k)⁺(C / k)ᵀ = C W⁺ Cᵀ / k: scale the factor, not a copy of the columns (float64 columns are used
    # as they are, without a second (N, m) array)
    factor = _nystrom_factor(np.asarray(raw, dtype=np.float64), idx)
    factor /= np.sqrt(k)
    basis, eigenvalues = nystrom_basis(factor, n)
    del factor
    return NystromPreconditioner(
        basis=basis,
        eigenvalues=eigenvalues,
        shift=float(ridge),
        landmarks=idx,
        method="shared",
        products=0,
        outputs=k,
    )
