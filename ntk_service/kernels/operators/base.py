"""The one base of every linear operator in the package: ``LinearOperator``, one hook ``_matmat``; and
``JacobianOperator``, a kernel Θ = J(x1) J(x2)ᵀ that can also apply its Jacobian by halves.

NOTE [one operator base]
    curvlinops' design: a subclass writes ``_matmat`` (V (cols, r) -> A V (rows, r) in its own dtype, flat
    layout) and says what it is (``shape``, ``dtype``, ``mode``, ``k``, ``is_symmetric``); the base gives the
    rest: the checked ``matmat``, ``matvec`` on a flat vector, ``@``, ``T`` and the SciPy view. The operators of
    the kernels (``ntk_operator`` in memory, ``dataset_operator`` over a data set read in chunks, the dense
    ``MatrixOperator``), of Ray (``ray_ntk_operator``), and the solvers' float64 view (``KernelOperator`` in
    ``analysis/solve/operators.py``) and the solver as an operator (``InverseOperator``) all derive from it, so
    the analyses ask ``isinstance(kernel, LinearOperator)`` and read its ``mode`` and ``k`` instead of probing for
    attributes. ``mode`` says how the matrix is laid out (NOTE [operator layout] in ``analysis/solve/operators.py``):
    FULL is (N·k, M·k) example-major, TRACE and PSEUDO are (N, M); None is a plain matrix whose shape decides.

NOTE [jacobian operator]
    A kernel that is J(x1) J(x2)ᵀ and knows its J can do what a matrix cannot: apply J (``jvp``: one JVP pass
    over the rows of x1 it is asked for) and Jᵀ (``vjp``: one VJP pass over rows of x2) on parts of the data, and
    build the exact kernel of a few examples with the structured engine (``kernel_block``). That is what the
    parameter-space solvers need (NOTE [parameter-space blocks] in ``analysis/solve/block.py``): a step on a block
    of examples costs passes over that block only. Parameter vectors are flat float64 numpy arrays of P numbers,
    in the order of ``parameter_names``; rows are given as ``Ranges``, sorted disjoint [start, stop) example
    ranges, and results come back in their order. ``partitions`` are the ranges that run in parallel (Ray's
    shards; one range in one process): a block made of one range per partition keeps every worker busy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ntk_service.errors import InvalidInput, NonFiniteInput, OptionalDependencyMissing, ShapeMismatch
from ntk_service.kernels.modes import DerivedMode, KernelMode

__all__ = [
    "JacobianOperator",
    "LinearOperator",
    "MatrixOperator",
    "Ranges",
    "check_cotangent",
    "check_ranges",
    "ranges_size",
]

Ranges = Sequence[tuple[int, int]]
"""Sorted, disjoint [start, stop) example ranges (NOTE [jacobian operator])."""


class LinearOperator(ABC):
    """A linear map A of ``shape`` (rows, cols) known through products (NOTE [one operator base]).

    Attributes (set by the subclass):
        shape: (rows, cols). dtype: the dtype products are computed in.
        mode: the kernel layout (FULL, TRACE, PSEUDO), or None for a plain matrix.
        k: outputs per example (1 for a plain matrix).
        is_symmetric: A = Aᵀ (a kernel of one data set): ``T`` is the operator itself.
    """

    shape: tuple[int, int]
    dtype: torch.dtype
    mode: KernelMode | DerivedMode | None
    k: int
    is_symmetric: bool

    @abstractmethod
    def _matmat(self, v: torch.Tensor) -> torch.Tensor:
        """The hook: V (cols, r) in ``dtype`` -> A V (rows, r), flat layout, never checked again."""

    def _transpose(self) -> LinearOperator:
        """Aᵀ; the base knows it only for a symmetric operator."""
        if self.is_symmetric:
            return self
        raise InvalidInput(f"{type(self).__name__}: this operator has no transpose; build the transposed kernel")

    def matmat(self, v: Any) -> torch.Tensor:
        """A V for V (cols, r): (rows, r) in ``dtype``.

        Raises:
            ShapeMismatch: V is not (cols, r). NonFiniteInput: V holds NaN or inf.
        """
        t = torch.as_tensor(v)
        if t.ndim != 2 or t.shape[0] != self.shape[1] or not t.is_floating_point():
            raise ShapeMismatch(
                f"{type(self).__name__}.matmat: V has shape {tuple(t.shape)} and dtype {t.dtype}; expected a float "
                f"tensor ({self.shape[1]}, r) for an operator of shape {self.shape}"
            )
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteInput(f"{type(self).__name__}.matmat: V holds NaN or inf")
        return self._matmat(t.to(self.dtype))

    def matvec(self, v: Any) -> torch.Tensor:
        """A v for a flat v (cols,): (rows,)."""
        t = torch.as_tensor(v)
        return self.matmat(t.reshape(-1, 1))[:, 0]

    def __matmul__(self, v: Any) -> torch.Tensor:
        """``matmat`` for V (cols, r), else ``matvec``."""
        t = torch.as_tensor(v)
        return self.matmat(t) if t.ndim == 2 and t.shape[0] == self.shape[1] else self.matvec(t)

    @property
    def T(self) -> LinearOperator:  # noqa: N802 (the matrix transpose, as torch and numpy spell it)
        """Aᵀ (raises InvalidInput where the operator cannot transpose)."""
        return self._transpose()

    def matmat_float64(self, v: np.ndarray) -> np.ndarray:
        """A V on float64 numpy blocks (the solvers' view): V (cols, r) -> (rows, r) float64."""
        out = self._matmat(torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)).to(self.dtype))
        return np.asarray(out.detach().cpu().double().numpy())

    def as_linear_operator(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` of ``shape`` on flat float64 vectors (Lanczos, ``eigsh``).

        Raises:
            OptionalDependencyMissing: SciPy is not installed (``pip install 'ntk-service[linalg]'``).
        """
        try:
            from scipy.sparse.linalg import LinearOperator as ScipyOperator
        except ImportError as exc:  # pragma: no cover - scipy is a dependency of the analyses
            raise OptionalDependencyMissing(
                f"{type(self).__name__}.as_linear_operator: needs SciPy; install it with "
                "pip install 'ntk-service[linalg]'"
            ) from exc

        def product(x: np.ndarray, op: LinearOperator) -> np.ndarray:
            block = np.asarray(x, dtype=np.float64).reshape(op.shape[1], -1)
            return op.matmat_float64(block).reshape((-1, *np.shape(x)[1:]))

        return ScipyOperator(
            shape=self.shape,
            dtype=np.float64,
            matvec=lambda x: product(x, self),
            rmatvec=lambda x: product(x, self.T),
            matmat=lambda x: product(x, self),
        )


class JacobianOperator(LinearOperator):
    """Θ = J(x1) J(x2)ᵀ with its Jacobian applied by halves (NOTE [jacobian operator]).

    Attributes (beside ``LinearOperator``'s): num_params: P. examples: (N, M), the examples of x1 and x2.
    estimate_bytes: the planned peak memory of one product in this process (what the solvers add to their own
    estimate); 0 where the products run elsewhere (Ray's shard actors).
    """

    num_params: int
    examples: tuple[int, int]
    estimate_bytes: int = 0

    def partitions(self) -> list[tuple[int, int]]:
        """The example ranges of x2 that run in parallel (one for an in-process operator). Default: [(0, M)]."""
        return [(0, self.examples[1])]

    @abstractmethod
    def jvp(self, u: np.ndarray, rows: Ranges | None = None) -> np.ndarray:
        """J(x1[rows]) u: u (P,) float64 -> (rows, k) float64; one JVP pass over those rows. Default rows: all."""

    @abstractmethod
    def vjp(self, c: np.ndarray, cols: Ranges | None = None) -> np.ndarray:
        """J(x2[cols])ᵀ c: c (cols, k) float64 -> (P,) float64, summed in float64; one VJP pass over those rows."""

    @abstractmethod
    def kernel_block(
        self, cols: Ranges, landmarks: np.ndarray | None, mode: KernelMode = KernelMode.FULL
    ) -> np.ndarray:
        """Θ(x2[cols], x2[landmarks]) by the structured engine, float64: (b, s, k, k) FULL, (b, s) TRACE; with
        ``landmarks`` None the symmetric Θ(x2[cols], x2[cols]) (computed once per pair); for
        ``KernelMode.EXAMPLE_DIAGONAL`` the (b, k, k) diagonal blocks of x2[cols] (landmarks ignored)."""


class MatrixOperator(LinearOperator):
    """A dense matrix held in memory as an operator (what an in-memory kernel is to the solvers).

    Args:
        matrix: (rows, cols) float tensor or array. mode, k: its kernel layout, if any. Default: None, 1.
        is_symmetric: A = Aᵀ. Default: False.
    """

    def __init__(
        self,
        matrix: Any,
        *,
        mode: KernelMode | DerivedMode | None = None,
        k: int = 1,
        is_symmetric: bool = False,
    ) -> None:
        t = torch.as_tensor(matrix)
        if t.ndim != 2 or not t.is_floating_point():
            raise ShapeMismatch(f"MatrixOperator: needs a 2-D float matrix, got shape {tuple(t.shape)} {t.dtype}")
        self.matrix = t
        self.shape = (int(t.shape[0]), int(t.shape[1]))
        self.dtype = t.dtype
        self.mode, self.k, self.is_symmetric = mode, k, is_symmetric

    def _matmat(self, v: torch.Tensor) -> torch.Tensor:
        return self.matrix @ v

    def _transpose(self) -> LinearOperator:
        if self.is_symmetric:
            return self
        return MatrixOperator(self.matrix.T, mode=self.mode, k=self.k)


def check_cotangent(c: Any, ranges: Ranges, k: int, *, operation: str) -> np.ndarray:
    """c as float64 (rows of ``ranges``, k), the cotangent of a ``vjp``.

    Raises:
        ShapeMismatch: another shape.
    """
    out = np.asarray(c, dtype=np.float64)
    if out.shape != (ranges_size(ranges), k):
        raise ShapeMismatch(
            f"{operation}: c has shape {out.shape}; expected ({ranges_size(ranges)}, {k}), one row per example of the "
            "ranges"
        )
    return out


def ranges_size(ranges: Ranges) -> int:
    """The examples ``ranges`` cover."""
    return sum(stop - start for start, stop in ranges)


def check_ranges(ranges: Ranges | None, size: int, *, operation: str) -> list[tuple[int, int]]:
    """``ranges`` as a list (all of [0, size) when None), checked sorted, disjoint and inside [0, size).

    Raises:
        InvalidInput: a range that is empty, reversed, overlapping or out of bounds.
    """
    if ranges is None:
        return [(0, size)]
    out, last = [], 0
    for start, stop in ranges:
        start, stop = int(start), int(stop)
        if not (last <= start < stop <= size):
            raise InvalidInput(
                f"{operation}: example ranges must be sorted, disjoint and inside [0, {size}), got {list(ranges)}"
            )
        out.append((start, stop))
        last = stop
    return out
