"""One view of a kernel for the solvers: a float64 block product V ↦ A V on the layout of NOTE [layout].

A kernel reaches the solvers as a dense array (what ``compute_ntk`` returns), a ``LinearOperator`` of the package
(NOTE [one operator base] in ``kernels/operators/base.py``: ``ntk_operator``, ``dataset_operator``,
``ray_ntk_operator``, ``MatrixOperator``), a ``scipy.sparse.linalg.LinearOperator``, or any other object with
``shape`` and ``matvec`` on flat vectors (a stored kernel): ``as_operator`` is the one place such a foreign object is
taken in. ``kernel_operator`` turns each into a ``KernelOperator`` (itself a ``LinearOperator``) whose ``apply``
takes and returns float64 blocks, so CG, Lanczos, the preconditioners and the solvers never ask what they were
given; ``source`` keeps the ``JacobianOperator`` behind it, for what needs the model.

NOTE [operator layout]
    An operator of shape (N·k, M·k) is a FULL kernel in the example-major layout (row n·k + a), exactly
    ``as_matrix(theta)``; one of shape (N, M) with targets of width k is a TRACE kernel and is read, as a dense TRACE
    kernel is, as (trace / k) ⊗ I_k: ``apply`` divides by k and acts on each of the k target columns. For k = 1 the
    two readings coincide. A ``LinearOperator`` says its own mode (None: a plain matrix); for a foreign object
    the shape decides, and a shape that is neither is refused with both numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse.linalg
import torch

from ntk_service.analysis.layout import to_kernel_matrix
from ntk_service.errors import InvalidInput, NonFiniteInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.base import JacobianOperator, LinearOperator

__all__ = ["ForeignOperator", "KernelOperator", "as_operator", "check_ridge", "is_operator", "kernel_operator"]


def is_operator(kernel: Any) -> bool:
    """True for a ``LinearOperator`` of the package, a SciPy ``LinearOperator``, or a foreign object that
    ``as_operator`` takes in (``shape`` and ``matvec``, not an array); arrays go through the dense paths."""
    if isinstance(kernel, LinearOperator | scipy.sparse.linalg.LinearOperator):
        return True
    return _is_foreign_operator(kernel)


def _is_foreign_operator(kernel: Any) -> bool:
    """A foreign object with ``shape`` and ``matvec`` that is not an array: the boundary's one duck-typed check
    (NOTE [one operator base]; everything of the package is a ``LinearOperator``)."""
    return hasattr(kernel, "matvec") and hasattr(kernel, "shape") and not hasattr(kernel, "__array__")


class ForeignOperator(LinearOperator):
    """An operator from outside the package (a SciPy ``LinearOperator``, a stored kernel, any object with
    ``shape`` and ``matvec`` on flat vectors) as a ``LinearOperator``; mode None (its shape decides)."""

    def __init__(self, kernel: Any) -> None:
        shape = tuple(int(s) for s in kernel.shape)
        if len(shape) != 2:
            raise ShapeMismatch(f"as_operator: an operator is 2-D (rows, cols), got shape {shape}")
        self.kernel = kernel
        self.shape = (shape[0], shape[1])
        self.dtype = torch.float64
        self.mode, self.k, self.is_symmetric = None, 1, False

    def _matmat(self, v: torch.Tensor) -> torch.Tensor:
        columns = []
        for j in range(v.shape[1]):
            out = self.kernel.matvec(v[:, j].numpy())
            if isinstance(out, torch.Tensor):
                out = out.detach().cpu().double().numpy()
            column = np.asarray(out, dtype=np.float64).reshape(-1)
            if column.shape != (self.shape[0],):
                raise ShapeMismatch(
                    f"as_operator: {type(self.kernel).__name__}.matvec returned {column.shape[0]} entries; its shape "
                    f"says {self.shape[0]}"
                )
            columns.append(torch.from_numpy(column))
        return torch.stack(columns, dim=1) if columns else torch.zeros(self.shape[0], 0, dtype=torch.float64)


def as_operator(kernel: Any) -> LinearOperator:
    """``kernel`` as a ``LinearOperator``: itself if it is one, else wrapped (``ForeignOperator``).

    Raises:
        InvalidInput: an object that is not an operator (an array goes to the dense paths).
    """
    if isinstance(kernel, LinearOperator):
        return kernel
    if isinstance(kernel, scipy.sparse.linalg.LinearOperator) or _is_foreign_operator(kernel):
        return ForeignOperator(kernel)
    raise InvalidInput(f"as_operator: {type(kernel).__name__} is not an operator (no shape and matvec)")


@dataclass(frozen=True)
class KernelOperator(LinearOperator):
    """A kernel as a float64 block product (NOTE [operator layout]), itself a ``LinearOperator`` (float64).

    Attributes:
        apply: V (cols, r) -> A V (rows, r), float64, one product per column (the TRACE scaling 1 / k included).
        rows, cols: the sizes of the system (N·k and M·k for FULL; N and M for TRACE).
        n, m: examples on the row and column side. k: outputs per example (the targets' width for TRACE).
        mode: FULL or TRACE. matrix: the dense float64 matrix when one was given (None for an operator).
        passes_per_product: VJP + JVP passes over the data one column costs (k for an operator in TRACE mode,
            1 in FULL, 0 for a dense matrix): what the solvers' cost reports multiply by.
        source: the ``JacobianOperator`` behind it (an ``ntk_operator``, ``dataset_operator`` or
            ``ray_ntk_operator``), for what only the model gives: the parameter-space solvers (FULL) and kernel
            blocks by the structured engine (NOTE [jacobian operator]); None for a dense kernel or a foreign one.
        is_symmetric: a kernel of one data set. product_dtype: the dtype of the products (float32 products put a
            floor under a residual, NOTE [float32 floor] in ``solve/problem.py``).
    """

    apply: Callable[[np.ndarray], np.ndarray]
    rows: int
    cols: int
    n: int
    m: int
    k: int
    mode: KernelMode
    matrix: np.ndarray | None = None
    passes_per_product: int = 1
    source: JacobianOperator | None = None
    is_symmetric: bool = False
    product_dtype: torch.dtype = torch.float64
    dtype: torch.dtype = field(default=torch.float64, init=False)
    shape: tuple[int, int] = field(default=(0, 0), init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", (self.rows, self.cols))

    def _matmat(self, v: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.apply(v.double().numpy()))

    def matmat_float64(self, v: np.ndarray) -> np.ndarray:
        return self.apply(np.asarray(v, dtype=np.float64))


def kernel_operator(
    kernel: Any,
    *,
    k: int,
    name: str,
    operation: str,
    rows: int | None = None,
    cols: int | None = None,
    mode: KernelMode | str | None = None,
) -> KernelOperator:
    """``kernel`` (dense or an operator) as a ``KernelOperator`` for targets of width ``k``.

    Args:
        kernel: (N, M, k, k) FULL or (N, M) TRACE array (numpy / torch), or an operator (see the module docstring).
        k: the targets' width (outputs per example). name, operation: for messages.
        rows, cols: the examples expected on each side (None: any). mode: checked against what the kernel is.

    Returns:
        KernelOperator with the TRACE kernel divided by k (NOTE [operator layout]).

    Raises:
        ShapeMismatch: a shape that is neither (N·k, M·k) nor (N, M) for these targets, or that contradicts
            ``mode``, ``rows`` or ``cols``.
    """
    if isinstance(kernel, KernelOperator):
        result = kernel
    elif not is_operator(kernel):
        dense = to_kernel_matrix(kernel, name=name, operation=operation, mode=mode, trace_outputs=k)
        matrix = dense.matrix
        full = dense.mode is KernelMode.FULL
        if full and dense.k != k:
            raise ShapeMismatch(
                f"{operation}: {name} is a FULL kernel with k = {dense.k} outputs, the targets have {k} columns; "
                f"send targets of shape (N, {dense.k})"
            )
        result = KernelOperator(
            apply=lambda v: matrix @ v,
            rows=matrix.shape[0],
            cols=matrix.shape[1],
            n=dense.n,
            m=dense.m,
            k=k,
            mode=dense.mode,
            matrix=matrix,
            passes_per_product=0,
            is_symmetric=matrix.shape[0] == matrix.shape[1] and bool(np.array_equal(matrix, matrix.T)),
        )
    else:
        result = _wrap_operator(
            as_operator(kernel), k=k, name=name, operation=operation, mode=mode, rows=rows, cols=cols
        )
    for side, expected, got in (("rows", rows, result.n), ("columns", cols, result.m)):
        if expected is not None and got != expected:
            raise ShapeMismatch(
                f"{operation}: {name} (shape {result.shape}, read as {result.mode.value}) has {got} examples on its "
                f"{side}, the targets and the other kernel need {expected} (targets have {k} columns); pass the kernel "
                "of the matching sets"
            )
    return result


def _wrap_operator(
    kernel: LinearOperator,
    *,
    k: int,
    name: str,
    operation: str,
    mode: KernelMode | str | None,
    rows: int | None,
    cols: int | None,
) -> KernelOperator:
    shape = kernel.shape
    own = kernel.mode
    own_mode = None if own is None else (KernelMode.FULL if own is KernelMode.FULL else KernelMode.TRACE)
    wanted = None if mode is None else KernelMode(mode)
    if own_mode is not None and wanted is not None and own_mode is not wanted:
        raise ShapeMismatch(f"{operation}: {name} is a {own_mode.value} operator, but mode {wanted.value!r} was given")
    chosen = own_mode or wanted
    if own is KernelMode.FULL and kernel.k != k:
        raise ShapeMismatch(
            f"{operation}: {name} is a FULL operator with k = {kernel.k} outputs, the targets have {k} columns; "
            f"send targets of shape (N, {kernel.k})"
        )
    if chosen is None and k == 1:
        chosen = KernelMode.FULL
    if chosen is None:  # the examples expected on a side decide: N·k entries is FULL, N is TRACE
        for size, examples in ((shape[0], rows), (shape[1], cols)):
            if examples is not None and size in (examples, examples * k):
                chosen = KernelMode.FULL if size == examples * k else KernelMode.TRACE
                break
    if chosen is None:
        divisible = shape[0] % k == 0 and shape[1] % k == 0
        chosen = KernelMode.FULL if divisible else KernelMode.TRACE
    if chosen is KernelMode.FULL and (shape[0] % k or shape[1] % k):
        raise ShapeMismatch(
            f"{operation}: {name} has shape {shape}, not (N·k, M·k) for k = {k} target columns; pass an operator of "
            "the FULL kernel in the example-major layout, or targets with one column per output"
        )
    full = chosen is KernelMode.FULL
    scale = 1.0 if full else 1.0 / k
    rows_n, cols_n = shape

    def apply(v: np.ndarray) -> np.ndarray:
        if v.ndim != 2 or v.shape[0] != cols_n:
            raise ShapeMismatch(f"{operation}: a block of shape {v.shape} for {name} of shape {shape}")
        out = kernel.matmat_float64(v) if v.shape[1] else np.zeros((rows_n, 0))
        if out.shape != (rows_n, v.shape[1]):
            raise ShapeMismatch(f"{operation}: {name} returned a block of shape {out.shape}; its shape says {rows_n}")
        if not np.all(np.isfinite(out)):
            raise NonFiniteInput(
                f"{operation}: a product with {name} gave NaN or inf (the model's outputs overflow at these inputs, "
                "or the operator is broken); check the operator on a small vector"
            )
        return out * scale if scale != 1.0 else out

    passes = k if own is KernelMode.TRACE else 1
    per = k if full else 1
    source = kernel if isinstance(kernel, JacobianOperator) else None
    return KernelOperator(
        apply=apply,
        rows=rows_n,
        cols=cols_n,
        n=rows_n // per,
        m=cols_n // per,
        k=k,
        mode=chosen,
        passes_per_product=passes,
        source=source,
        is_symmetric=kernel.is_symmetric,
        product_dtype=kernel.dtype,
    )


def check_ridge(ridge: float, *, operation: str) -> float:
    """λ as a float.

    Raises:
        InvalidInput: a negative, NaN or infinite ridge.
    """
    value = float(ridge)
    if not np.isfinite(value) or value < 0:
        raise InvalidInput(f"{operation}: ridge must be a finite number ≥ 0, got {ridge}; pass e.g. ridge=1e-6")
    return value
