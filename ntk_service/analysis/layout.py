"""One layout for every analysis: a kernel as a float64 matrix, and targets as matching columns.

NOTE [layout]
    A FULL kernel (N, M, k, k) is the (N·k, M·k) matrix with row n·k + a and column m·k + b (example-major):
    ``theta.transpose(0, 2, 1, 3).reshape(N*k, M*k)``. A plain reshape is silently a different matrix.
    Targets (N, k) flatten the same way, row-major: ``y.reshape(N*k)``, entry n·k + a.

    A TRACE kernel (N, M) is our plain sum over the k outputs. Every analysis reads it as the full kernel
    (trace / k) ⊗ I_k, the mean-over-outputs approximation neural-tangents' trace uses (its trace is already the
    mean, so neural-tangents' trace kernel = ours / k). On targets (N, k) that Kronecker product acts as the
    (N, N) matrix trace / k applied to each of the k columns, so nothing of size N·k is ever built.

    Every analysis runs in float64 on Θ ← (Θ + Θᵀ)/2 where Θ must be symmetric (float32 and λmin < 0 are where
    most NaN reports against neural-tangents come from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ntk_service._tensors import is_torch_tensor
from ntk_service.errors import InvalidInput, NonFiniteInput, ShapeMismatch, operation_name
from ntk_service.kernels.modes import KernelMode

__all__ = ["KernelMatrix", "add_to_diagonal", "as_matrix", "infer_mode", "to_float64", "to_kernel_matrix", "to_targets"]


def to_float64(value: Any, *, name: str, operation: str | None = None) -> np.ndarray:
    """``value`` (numpy array, torch tensor on any device, nested list) as a float64 numpy array.

    Raises:
        InvalidInput: not numeric. NonFiniteInput: NaN or ±inf entries.
    """
    with operation_name(operation):
        if is_torch_tensor(value):
            value = value.detach().cpu().double().numpy()
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(detail=f"{name} must be a numeric array, got {type(value).__name__}") from exc
        if not np.all(np.isfinite(array)):
            raise NonFiniteInput(detail=f"{name} has NaN or infinite entries; fix the input (float64 kernels)")
        return array


def infer_mode(
    theta: np.ndarray, mode: KernelMode | str | None, *, name: str, operation: str | None = None
) -> KernelMode:
    """FULL for a 4-D (N, M, k, k) kernel, TRACE for a 2-D (N, M) one; a given ``mode`` must agree.

    Raises:
        ShapeMismatch: another rank, a FULL block whose last two axes differ, or a shape contradicting ``mode``.
    """
    with operation_name(operation):
        inferred = {4: KernelMode.FULL, 2: KernelMode.TRACE}.get(theta.ndim)
        if inferred is None:
            raise ShapeMismatch(
                detail=f"{name} has shape {theta.shape}; expected a FULL kernel (N, M, k, k) or a TRACE kernel "
                "(N, M) (diagonal modes do not hold enough of Θ for this analysis)"
            )
        if mode is not None and KernelMode(mode) is not inferred:
            raise ShapeMismatch(
                detail=f"{name} has shape {theta.shape}, which is a {inferred.value} kernel, but mode "
                f"{KernelMode(mode).value!r} was given"
            )
        if inferred is KernelMode.FULL and theta.shape[2] != theta.shape[3]:
            raise ShapeMismatch(detail=f"{name} has shape {theta.shape}; a FULL kernel's last two axes are (k, k)")
        return inferred


def as_matrix(theta: Any, mode: KernelMode | str | None = None) -> np.ndarray:
    """A kernel as a 2-D float64 matrix in the layout of NOTE [layout].

    Args:
        theta: (N, M, k, k) FULL or (N, M) TRACE, numpy or torch (what ``compute_ntk`` returns).
        mode (KernelMode | str | None): checked against the shape. Default: inferred from the rank.

    Returns:
        (N·k, M·k) with row n·k + a for FULL; the (N, M) kernel itself for TRACE (not divided by k).

    Raises:
        ShapeMismatch, NonFiniteInput: see ``infer_mode`` / ``to_float64``.

    Examples:
        >>> as_matrix(np.zeros((5, 4, 3, 3))).shape   # (N·k, M·k)
        (15, 12)
    """
    with operation_name("as_matrix"):
        array = to_float64(theta, name="theta")
        trace = infer_mode(array, mode, name="theta") is KernelMode.TRACE
    if trace:
        return array
    n, m, k, _ = array.shape
    return np.ascontiguousarray(array.transpose(0, 2, 1, 3)).reshape(n * k, m * k)


@dataclass(frozen=True)
class KernelMatrix:
    """A kernel ready for linear algebra.

    Attributes:
        matrix: (N·k, M·k) for FULL; (N, M) holding trace / k for TRACE (NOTE [layout]).
        mode: FULL or TRACE.
        n, m: examples on the row and column side.
        k: outputs per example; None for a TRACE kernel (any number of target columns fits it).
    """

    matrix: np.ndarray
    mode: KernelMode
    n: int
    m: int
    k: int | None


def add_to_diagonal(matrix: np.ndarray, value: float) -> np.ndarray:
    """``matrix + value·I`` as a new array, without building I (an n² temporary at n = 10⁴ is 800 MB)."""
    out = matrix.copy()
    if value:
        out[np.diag_indices_from(out)] += value
    return out


def to_kernel_matrix(
    theta: Any,
    *,
    name: str,
    operation: str | None = None,
    mode: KernelMode | str | None = None,
    square: bool = False,
    symmetrize: bool = False,
    trace_outputs: int | None = None,
) -> KernelMatrix:
    """``theta`` in the layout of NOTE [layout], with TRACE divided by k (``trace_outputs``; 1 if unknown).

    Args:
        square: require N = M (a kernel of a set with itself). symmetrize: also Θ ← (Θ + Θᵀ)/2.
        trace_outputs: k for a TRACE kernel, to build trace / k. Default: None (divide by 1).

    Raises:
        ShapeMismatch: a non-square kernel where one is required (with the shape), or see ``infer_mode``.
    """
    with operation_name(operation):
        array = to_float64(theta, name=name)
        kernel_mode = infer_mode(array, mode, name=name)
        n, m = array.shape[:2]
        if square and n != m:
            raise ShapeMismatch(
                detail=f"{name} has shape {array.shape}; it must be square (N, N{', k, k' * (array.ndim == 4)}), "
                "the kernel of one set of inputs with itself"
            )
        if kernel_mode is KernelMode.FULL:
            k = array.shape[2]
            matrix = np.ascontiguousarray(array.transpose(0, 2, 1, 3)).reshape(n * k, m * k)
            out_k: int | None = k
        else:
            matrix = array / float(trace_outputs or 1)
            out_k = None
        if symmetrize:
            matrix = matrix + matrix.T  # one new array (numpy buffers the overlapping transpose), halved in place
            matrix *= 0.5
        return KernelMatrix(matrix=matrix, mode=kernel_mode, n=n, m=m, k=out_k)


def to_targets(y: Any, *, n: int, k: int | None, name: str, operation: str | None = None) -> np.ndarray:
    """Targets as a float64 (N, k) array (a 1-D y is one output per example).

    Args:
        n: examples expected. k: outputs expected (FULL kernels); None accepts any number of columns.

    Raises:
        ShapeMismatch: wrong length or width, naming both.
    """
    with operation_name(operation):
        array = to_float64(y, name=name)
        if array.ndim == 1:
            array = array[:, None]
        if array.ndim != 2 or array.shape[0] != n:
            raise ShapeMismatch(
                detail=f"{name} has shape {array.shape}; expected ({n}, k), one row per example of the kernel"
            )
        if k is not None and array.shape[1] != k:
            raise ShapeMismatch(
                detail=f"{name} has {array.shape[1]} columns, the FULL kernel has k = {k} outputs; "
                f"send targets of shape ({n}, {k})"
            )
        return array
