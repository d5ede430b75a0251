"""The spectrum of a kernel: eigenvalues (dense or Lanczos), condition number and effective ranks.

A FULL kernel's spectrum is that of its (N·k, N·k) matrix (NOTE [layout] in ``layout.py``); if Θ ≈ T ⊗ I_k every
eigenvalue of T appears k times. A TRACE kernel's spectrum is that of the (N, N) kernel as given (our plain sum
over outputs, not divided by k: ranks are scale-invariant, and the eigenvalues are what was computed).

``method="lanczos"`` (``scipy.sparse.linalg.eigsh``) needs only products Θv, so it runs on a dense kernel, a
``scipy.sparse.linalg.LinearOperator``, any object with ``shape`` and ``matvec`` (a matrix-free NTK operator),
or a kernel stored on disk (a zarr array, read by row blocks through ``stored_kernel_operator``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import scipy.sparse.linalg

from ntk_service.analysis.blas_guard import large_matrix_blas
from ntk_service.analysis.layout import to_kernel_matrix
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.operators.base import LinearOperator

__all__ = [
    "DENSE_MAX_SIZE",
    "SPECTRUM_COPIES",
    "Method",
    "Spectrum",
    "lanczos_vectors",
    "spectrum",
    "spectrum_memory_bytes",
    "stored_kernel_operator",
]

Method = Literal["auto", "eigh", "lanczos"]

DENSE_MAX_SIZE = 4096
"""With ``method="auto"`` and ``top`` given, matrices larger than this use Lanczos: a dense eigh of n = 4096
float64 takes ~3·n² floats (400 MB) and O(n³) time, while top-k Lanczos needs a few dozen products."""

SPECTRUM_COPIES = {"eigh": 3, "lanczos": 2}
"""n×n float64 arrays alive while ``spectrum`` runs on a dense kernel: the caller's kernel and the symmetrized
matrix, plus eigvalsh's copy for eigh."""

_STORED_BLOCK_ROWS = 256
"""Rows of a stored kernel read per block in ``stored_kernel_operator`` (memory: rows · N · k² floats)."""

_OPERATION = "spectrum"


def lanczos_vectors(top: int, size: int) -> int:
    """Vectors of length n ARPACK's ``eigsh`` holds for ``top`` eigenvalues (ncv = max(2·top + 1, 20), capped at
    n) plus its workspace, about as many again."""
    return 2 * min(size, max(2 * top + 1, 20))


def spectrum_memory_bytes(
    size: int, *, top: int | None = None, method: Method | str = "auto", operator: bool = False
) -> int:
    """Peak float64 bytes of ``spectrum`` for an n = ``size`` kernel: with a dense kernel, ``SPECTRUM_COPIES`` of
    it (the caller's included) for the method ``spectrum`` will take; with a matrix-free operator, its Lanczos
    basis only (each product's own memory is the operator's, checked when it is built).

    Args:
        size (int): n, the kernel's side (N·k FULL, N TRACE).
        top (int | None): as ``spectrum``; required with ``operator``. method (str): as ``spectrum``.
        operator (bool): the kernel is an operator, never formed. Default: False.

    Returns:
        int: bytes.
    """
    if operator:
        if top is None:
            raise InvalidInput(f"{_OPERATION}: an operator's spectrum is its top eigenvalues; give top")
        return 8 * lanczos_vectors(top, size) * size
    dense = top is None or top >= size or method == "eigh" or (method == "auto" and size <= DENSE_MAX_SIZE)
    return 8 * SPECTRUM_COPIES["eigh" if dense else "lanczos"] * size * size


@dataclass(frozen=True)
class Spectrum:
    """Eigenvalues of a symmetric kernel and what they say.

    Attributes:
        eigenvalues: (r,) descending, signed; all n of them, or the ``top`` r largest.
        eigenvectors: (n, r), column i for eigenvalue i; None unless asked for.
        n: the matrix size (N·k FULL, N TRACE). method: "eigh" or "lanczos". is_complete: r = n.
        lambda_max: the largest eigenvalue. lambda_min: the smallest (signed); None for a partial spectrum.
        condition_number: λmax / λmin; ``inf`` when λmin ≤ tol · λmax (tol = n·eps); None if partial.
        entropy: exp(−Σ p log p), p = λ / Σλ over λ > 0 (None if partial).
        participation_ratio: tr(K)² / ‖K‖_F² (needs the matrix: None for an operator).
        stable_rank: tr(K) / λmax (None for an operator).
        numerical_rank: #{|λ| > max|λ| · n · eps} (numpy's ``matrix_rank`` tolerance; None if partial).
    """

    eigenvalues: np.ndarray
    eigenvectors: np.ndarray | None
    n: int
    method: str
    lambda_max: float
    lambda_min: float | None
    condition_number: float | None
    entropy: float | None
    participation_ratio: float | None
    stable_rank: float | None
    numerical_rank: int | None
    _trace: float | None = field(default=None, repr=False)

    @property
    def is_complete(self) -> bool:
        return bool(self.eigenvalues.size == self.n)

    def effective_dof(self, ridge: float) -> float:
        """Effective degrees of freedom tr(K(K + λI)⁻¹) = Σ λ_i / (λ_i + λ) over λ_i > 0.

        Raises:
            InvalidInput: ridge ≤ 0, or a partial spectrum (the sum needs every eigenvalue).
        """
        if not ridge > 0:
            raise InvalidInput(f"effective_dof: ridge must be > 0, got {ridge}")
        if not self.is_complete:
            raise InvalidInput(
                f"effective_dof: needs every eigenvalue, this spectrum has the top {self.eigenvalues.size} of "
                f"{self.n}; compute it with top=None"
            )
        positive = self.eigenvalues[self.eigenvalues > 0]
        return float(np.sum(positive / (positive + ridge)))


def _as_operator(kernel: Any) -> Any:
    """A LinearOperator for operator-like inputs; None for arrays (handled densely)."""
    if isinstance(kernel, scipy.sparse.linalg.LinearOperator):
        return kernel
    if isinstance(kernel, LinearOperator):  # every operator of the package: its own SciPy view (float64)
        return kernel.as_linear_operator()
    if hasattr(kernel, "matvec") and hasattr(kernel, "shape") and not hasattr(kernel, "__array__"):
        return scipy.sparse.linalg.aslinearoperator(kernel)
    return None


def _ranks_from(eigenvalues: np.ndarray, n: int) -> tuple[float | None, float | None, int]:
    """Condition number, entropy rank and numerical rank from a complete spectrum (descending)."""
    eps = float(np.finfo(np.float64).eps)
    lam_max, lam_min = float(eigenvalues[0]), float(eigenvalues[-1])
    tol = n * eps * lam_max
    condition = math.inf if lam_max <= 0 or lam_min <= tol else lam_max / lam_min
    positive = eigenvalues[eigenvalues > 0]
    entropy = None
    if positive.size:
        p = positive / positive.sum()
        entropy = float(np.exp(-np.sum(p * np.log(p))))
    abs_max = float(np.max(np.abs(eigenvalues)))
    numerical_rank = int(np.count_nonzero(np.abs(eigenvalues) > abs_max * n * eps))
    return condition, entropy, numerical_rank


def spectrum(
    kernel: Any,
    *,
    top: int | None = None,
    method: Method | str = "auto",
    eigenvectors: bool = False,
    mode: str | None = None,
    bottom: int | None = None,
) -> Spectrum:
    """Eigenvalues (descending, signed) of a symmetric kernel, its condition number and effective ranks.

    Args:
        kernel: (N, N, k, k) FULL or (N, N) TRACE kernel (numpy / torch), a ``LinearOperator``, or an object
            with ``shape`` and ``matvec`` (see ``stored_kernel_operator`` for a kernel on disk).
        top (int | None): only the ``top`` largest eigenvalues. Default: None (all).
        method (str): "eigh" (dense, all), "lanczos" (``eigsh``, top only) or "auto" (eigh unless ``top`` is
            given and n > ``DENSE_MAX_SIZE``, or the kernel is an operator). Default: "auto".
        eigenvectors (bool): also return the eigenvectors (n, r). Default: False.
        mode: checked against the shape of an array kernel. Default: inferred.
        bottom (int | None): also the ``bottom`` smallest eigenvalues, by Lanczos (``eigsh``, which="SA"),
            appended after the top ones (descending); λmax then comes from ``top`` or one more Lanczos run,
            ``lambda_min`` is the smallest found and ``condition_number`` λmax / λmin. Small eigenvalues of a kernel
            converge slowly: expect many more products than for the top. Default: None.

    Returns:
        Spectrum (see its attributes); ranks that need what a partial spectrum or an operator lacks are None.

    Raises:
        ShapeMismatch: a non-square kernel. InvalidInput: an unknown method, top < 1, eigh on an operator,
        Lanczos without ``top`` or with top ≥ n.

    Cost: eigh O(n³) time, ~3·n² floats; Lanczos O(top) to a few·top products plus O(n·top) floats.

        >>> s = spectrum(theta)                         # theta (N, N, k, k) -> N·k eigenvalues  # doctest: +SKIP
        >>> s.eigenvalues.shape, s.condition_number, s.effective_dof(1e-3)                     # doctest: +SKIP
    """
    if method not in ("auto", "eigh", "lanczos"):
        raise InvalidInput(f"{_OPERATION}: unknown method {method!r}; expected 'auto', 'eigh' or 'lanczos'")
    if top is not None and top < 1:
        raise InvalidInput(f"{_OPERATION}: top must be ≥ 1 (or None for all eigenvalues), got {top}")
    if bottom is not None:
        return _extremes(kernel, top=top, bottom=bottom, eigenvectors=eigenvectors, mode=mode)
    operator = _as_operator(kernel)
    matrix = None
    if operator is None:
        matrix = to_kernel_matrix(
            kernel, name="kernel", operation=_OPERATION, mode=mode, square=True, symmetrize=True
        ).matrix
        n = matrix.shape[0]
    else:
        if len(operator.shape) != 2 or operator.shape[0] != operator.shape[1]:
            raise ShapeMismatch(f"{_OPERATION}: the operator has shape {operator.shape}; it must be square (n, n)")
        n = int(operator.shape[0])
    chosen = method
    if method == "auto":
        chosen = "lanczos" if top is not None and (operator is not None or n > DENSE_MAX_SIZE) and top < n else "eigh"
    if chosen == "eigh":
        if matrix is None:
            raise InvalidInput(f"{_OPERATION}: method 'eigh' needs a dense kernel; use method='lanczos' with top=")
        with large_matrix_blas(matrix.shape[0]):  # NOTE [large blas]
            values, vectors = np.linalg.eigh(matrix) if eigenvectors else (np.linalg.eigvalsh(matrix), None)
        values = values[::-1]
        vectors = None if vectors is None else vectors[:, ::-1]
        if top is not None:
            values = values[:top]
            vectors = None if vectors is None else vectors[:, :top]
    else:
        if top is None or top >= n:
            raise InvalidInput(
                f"{_OPERATION}: Lanczos computes the top eigenvalues of an n = {n} kernel: give 1 ≤ top < {n} "
                "(or method='eigh' for all of them)"
            )
        linear = operator if operator is not None else scipy.sparse.linalg.aslinearoperator(matrix)
        values, vectors = scipy.sparse.linalg.eigsh(linear, k=top, which="LA", return_eigenvectors=True)
        order = np.argsort(values)[::-1]
        values, vectors = values[order], vectors[:, order]
        if not eigenvectors:
            vectors = None
    values = np.asarray(values, dtype=np.float64)
    complete = values.size == n
    condition, entropy, numerical_rank = _ranks_from(values, n) if complete else (None, None, None)
    trace = fro2 = None
    if matrix is not None:
        trace, fro2 = float(np.trace(matrix)), float(np.sum(matrix * matrix))
    return Spectrum(
        eigenvalues=values,
        eigenvectors=vectors,
        n=n,
        method=chosen,
        lambda_max=float(values[0]),
        lambda_min=float(values[-1]) if complete else None,
        condition_number=condition,
        entropy=entropy,
        participation_ratio=None if trace is None or not fro2 else trace * trace / fro2,
        stable_rank=None if trace is None or values[0] <= 0 else trace / float(values[0]),
        numerical_rank=numerical_rank,
        _trace=trace,
    )


def _extremes(kernel: Any, *, top: int | None, bottom: int, eigenvectors: bool, mode: str | None) -> Spectrum:
    """The top and bottom eigenvalues by Lanczos (``spectrum(bottom=...)``)."""
    operator = _as_operator(kernel)
    if operator is None:
        matrix = to_kernel_matrix(kernel, name="kernel", operation=_OPERATION, mode=mode, square=True, symmetrize=True)
        operator = scipy.sparse.linalg.aslinearoperator(matrix.matrix)
    if len(operator.shape) != 2 or operator.shape[0] != operator.shape[1]:
        raise ShapeMismatch(f"{_OPERATION}: the operator has shape {operator.shape}; it must be square (n, n)")
    n = int(operator.shape[0])
    if bottom < 1 or (top or 0) + bottom >= n:
        raise InvalidInput(
            f"{_OPERATION}: Lanczos computes a few extreme eigenvalues of an n = {n} kernel: give 1 ≤ bottom and "
            f"top + bottom < {n} (got top={top}, bottom={bottom}); use method='eigh' on a dense kernel for all of them"
        )
    values, vectors = [], []
    for which, count in (("LA", top or 1), ("SA", bottom)):
        try:
            found, basis = scipy.sparse.linalg.eigsh(operator, k=count, which=which, return_eigenvectors=True)
        except scipy.sparse.linalg.ArpackNoConvergence as exc:
            raise InvalidInput(
                f"{_OPERATION}: Lanczos did not converge to the {'top' if which == 'LA' else 'bottom'} {count} "
                f"eigenvalue(s) of this n = {n} kernel ({len(exc.eigenvalues)} converged); the smallest eigenvalues "
                "of a kernel are clustered and converge slowly: ask for fewer, add a ridge, or use method='eigh' on "
                "a dense kernel"
            ) from exc
        order = np.argsort(found)[::-1]
        values.append(found[order])
        vectors.append(basis[:, order])
    top_values = values[0] if top else values[0][:0]
    top_vectors = vectors[0] if top else vectors[0][:, :0]
    all_values = np.concatenate([top_values, values[1]]).astype(np.float64)
    lam_max, lam_min = float(values[0][0]), float(values[1][-1])
    tiny = lam_max <= 0 or lam_min <= n * float(np.finfo(np.float64).eps) * lam_max
    return Spectrum(
        eigenvalues=all_values,
        eigenvectors=np.concatenate([top_vectors, vectors[1]], axis=1) if eigenvectors else None,
        n=n,
        method="lanczos",
        lambda_max=lam_max,
        lambda_min=lam_min,
        condition_number=math.inf if tiny else lam_max / lam_min,
        entropy=None,
        participation_ratio=None,
        stable_rank=None,
        numerical_rank=None,
    )


class _StoredKernel:
    """Θv by row blocks of a stored FULL (N, N, k, k) or TRACE (N, N) kernel; see ``stored_kernel_operator``."""

    def __init__(self, array: Any, block_rows: int) -> None:
        self.array = array
        self.block_rows = block_rows
        shape: Sequence[int] = array.shape
        if len(shape) not in (2, 4) or shape[0] != shape[1] or (len(shape) == 4 and shape[2] != shape[3]):
            raise ShapeMismatch(
                f"stored_kernel_operator: the array has shape {tuple(shape)}; expected a square FULL kernel "
                "(N, N, k, k) or TRACE kernel (N, N)"
            )
        self.k = int(shape[2]) if len(shape) == 4 else 1
        self.n = int(shape[0])
        self.shape = (self.n * self.k, self.n * self.k)
        self.dtype = np.dtype(np.float64)

    def matvec(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, dtype=np.float64).reshape(-1)
        out = np.empty(self.shape[0])
        k = self.k
        for start in range(0, self.n, self.block_rows):
            stop = min(start + self.block_rows, self.n)
            block = np.asarray(self.array[start:stop], dtype=np.float64)
            if k > 1 or block.ndim == 4:
                block = block.transpose(0, 2, 1, 3).reshape((stop - start) * k, self.n * k)
            out[start * k : stop * k] = block @ v
        return out


def stored_kernel_operator(array: Any, *, block_rows: int = _STORED_BLOCK_ROWS) -> scipy.sparse.linalg.LinearOperator:
    """A LinearOperator Θv for a kernel held in any sliceable array (zarr, numpy memmap, h5py), read by rows.

    Args:
        array: (N, N, k, k) FULL or (N, N) TRACE, supporting ``array[i:j]`` (only ``block_rows`` rows are read
            at a time, so memory stays at block_rows · N · k² floats).
        block_rows (int): rows per read. Default: 256.

    Returns:
        The (N·k, N·k) operator in the layout of NOTE [layout] (``layout.py``), for ``spectrum(method="lanczos")``.

    Raises:
        ShapeMismatch: not a square kernel.
    """
    return scipy.sparse.linalg.aslinearoperator(_StoredKernel(array, block_rows))
