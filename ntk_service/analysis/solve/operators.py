"""One view of a kernel for the solvers: a float64 block product V ↦ A V on the layout of NOTE [layout].

A kernel reaches the solvers as a dense array (what ``compute_ntk`` returns), an ``NtkOperator``
(``kernels/operators/linear_operator.py``), a ``scipy.sparse.linalg.LinearOperator`` or any object with ``shape`` and
``matvec`` on flat vectors (a stored kernel, an operator over a data set). ``kernel_operator`` turns each into a
``KernelOperator`` whose ``apply`` takes and returns float64 blocks, so CG, Lanczos and the preconditioners never
ask what they were given.

NOTE [operator layout]
    An operator of shape (N·k, M·k) is a FULL kernel in the example-major layout (row n·k + a), exactly
    ``as_matrix(theta)``; one of shape (N, M) with targets of width k is a TRACE kernel and is read, as a dense TRACE
    kernel is, as (trace / k) ⊗ I_k: ``apply`` divides by k and acts on each of the k target columns. For k = 1 the
    two readings coincide. An ``NtkOperator`` says its own mode, as does any operator with ``k`` and a ``mode``
    that is a ``KernelMode`` / ``DerivedMode`` (``RayNtkOperator``); for any other object the shape decides, and a
    shape that is neither is refused with both numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse.linalg
import torch

from ntk_service.analysis.layout import to_kernel_matrix
from ntk_service.errors import InvalidInput, NonFiniteInput, ShapeMismatch
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.operators.linear_operator import NtkOperator

__all__ = ["KernelOperator", "check_ridge", "is_operator", "kernel_operator"]


def is_operator(kernel: Any) -> bool:
    """True for an ``NtkOperator``, a SciPy ``LinearOperator`` or any object with ``shape`` and ``matvec`` that is not
    an array (arrays go through the dense paths)."""
    if isinstance(kernel, NtkOperator | scipy.sparse.linalg.LinearOperator):
        return True
    return hasattr(kernel, "matvec") and hasattr(kernel, "shape") and not hasattr(kernel, "__array__")


@dataclass(frozen=True)
class KernelOperator:
    """A kernel as a float64 block product (NOTE [operator layout]).

    Attributes:
        apply: V (cols, r) -> A V (rows, r), float64, one product per column (the TRACE scaling 1 / k included).
        rows, cols: the sizes of the system (N·k and M·k for FULL; N and M for TRACE).
        n, m: examples on the row and column side. k: outputs per example (the targets' width for TRACE).
        mode: FULL or TRACE. matrix: the dense float64 matrix when one was given (None for an operator).
        passes_per_product: VJP + JVP passes over the data one column costs (k for an NtkOperator in TRACE mode,
            1 in FULL, 0 for a dense matrix): what the solvers' cost reports multiply by.
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

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


def _flat_product(kernel: Any) -> Callable[[np.ndarray], np.ndarray]:
    """x (cols,) -> A x (rows,) in float64, through the operator's own matvec (torch for an NtkOperator)."""
    if isinstance(kernel, NtkOperator):

        def ntk(x: np.ndarray) -> np.ndarray:
            out = kernel.matvec(torch.from_numpy(np.ascontiguousarray(x)).reshape(-1))
            return np.asarray(out.detach().cpu().double().numpy()).reshape(-1)

        return ntk

    def generic(x: np.ndarray) -> np.ndarray:
        out = kernel.matvec(x)
        if hasattr(out, "detach") and hasattr(out, "cpu"):  # a torch tensor
            out = out.detach().cpu().double().numpy()
        return np.asarray(out, dtype=np.float64).reshape(-1)

    return generic


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
    if not is_operator(kernel):
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
        )
    else:
        result = _wrap_operator(kernel, k=k, name=name, operation=operation, mode=mode, rows=rows, cols=cols)
    for side, expected, got in (("rows", rows, result.n), ("columns", cols, result.m)):
        if expected is not None and got != expected:
            raise ShapeMismatch(
                f"{operation}: {name} (shape {result.shape}, read as {result.mode.value}) has {got} examples on its "
                f"{side}, the targets and the other kernel need {expected} (targets have {k} columns); pass the kernel "
                "of the matching sets"
            )
    return result


def _wrap_operator(
    kernel: Any,
    *,
    k: int,
    name: str,
    operation: str,
    mode: KernelMode | str | None,
    rows: int | None,
    cols: int | None,
) -> KernelOperator:
    shape = tuple(int(s) for s in kernel.shape)
    if len(shape) != 2:
        raise ShapeMismatch(f"{operation}: {name} has shape {shape}; an operator is 2-D (rows, cols)")
    own = _declared_mode(kernel)
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
    flat = _flat_product(kernel)
    full = chosen is KernelMode.FULL
    scale = 1.0 if full else 1.0 / k
    rows_n, cols_n = shape

    def apply(v: np.ndarray) -> np.ndarray:
        if v.ndim != 2 or v.shape[0] != cols_n:
            raise ShapeMismatch(f"{operation}: a block of shape {v.shape} for {name} of shape {shape}")
        out = np.empty((rows_n, v.shape[1]))
        for j in range(v.shape[1]):
            column = flat(v[:, j])
            if column.shape != (rows_n,):
                raise ShapeMismatch(
                    f"{operation}: {name}.matvec returned {column.shape[0]} entries; its shape says {rows_n}"
                )
            out[:, j] = column
        if not np.all(np.isfinite(out)):
            raise NonFiniteInput(
                f"{operation}: a product with {name} gave NaN or inf (the model's outputs overflow at these inputs, "
                "or the operator is broken); check the operator on a small vector"
            )
        return out * scale if scale != 1.0 else out

    passes = k if own is KernelMode.TRACE else 1
    per = k if full else 1
    return KernelOperator(
        apply=apply,
        rows=rows_n,
        cols=cols_n,
        n=rows_n // per,
        m=cols_n // per,
        k=k,
        mode=chosen,
        passes_per_product=passes,
    )


def _declared_mode(kernel: Any) -> KernelMode | DerivedMode | None:
    """The mode an operator says it has: an ``NtkOperator``'s, or that of any operator whose ``mode`` is a kernel
    mode and which has ``k`` (``RayNtkOperator``); None for the rest (SciPy operators, plain objects)."""
    mode = getattr(kernel, "mode", None)
    if isinstance(mode, KernelMode | DerivedMode) and (isinstance(kernel, NtkOperator) or hasattr(kernel, "k")):
        return mode
    return None


def check_ridge(ridge: float, *, operation: str) -> float:
    """λ as a float.

    Raises:
        InvalidInput: a negative, NaN or infinite ridge.
    """
    value = float(ridge)
    if not np.isfinite(value) or value < 0:
        raise InvalidInput(f"{operation}: ridge must be a finite number ≥ 0, got {ridge}; pass e.g. ridge=1e-6")
    return value
