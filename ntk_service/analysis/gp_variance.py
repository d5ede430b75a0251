"""The NTK-GP predictive variance by CG, for kernels seen through products (``gp_inference(solver="cg")``).

NOTE [gp variance by cg]
    Σ* = Θ** − Θ*ₓ (Θ + λI)⁻¹ Θₓ* needs, of the prior test kernel, only its example diagonal for the variances:
    FULL, each test example's k × k block (``compute_ntk(model, x_test, mode="example_diagonal")``, (M, k, k));
    TRACE, read as (trace / k) ⊗ I_k (NOTE [layout]), the (M,) diagonal of the trace kernel, or that same
    example diagonal (its trace is taken). The M·k columns B = Θ(x, x*) (M for TRACE) of the right-hand side are
    the transpose of ``k_test_train``: read off a dense one, or products of its transpose (``NtkOperator.T``,
    or ``rmatvec``) with unit vectors, one product per column. One CG solve Z = (Θ + λI)⁻¹ B (block CG shares its
    Krylov space across the columns, NOTE [block cg]) then gives every block at no further product:
    Σ*[m]_ab = Θ**[m]_ab − Σ_i B[i, m·k + a] Z[i, m·k + b]. Given the dense Θ** the whole covariance
    Θ** − Bᵀ Z comes the same way. B, Z and CG's vectors are n × M·k float64s each: the estimate is checked
    against the budget before B is built (``check_cg_memory``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ntk_service.analysis.layout import to_float64, to_kernel_matrix
from ntk_service.analysis.solve import KernelOperator, is_operator, kernel_operator
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.base import LinearOperator

__all__ = ["PriorAtTest", "cross_columns", "posterior_blocks", "prior_at_test"]

_COLUMNS_PER_CALL = 64
"""Unit vectors sent to the transposed cross operator at once (the identity block is never built whole)."""


class PriorAtTest:
    """Θ** as the variance needs it: ``blocks`` (M, k, k) FULL / (M,) TRACE (÷ k), and ``matrix`` (M·k, M·k) or
    (M, M) (÷ k) when the dense kernel was given, else None."""

    def __init__(self, blocks: np.ndarray, matrix: np.ndarray | None) -> None:
        self.blocks, self.matrix = blocks, matrix


def prior_at_test(k_test_test: Any, *, m: int, k: int, mode: KernelMode, operation: str) -> PriorAtTest:
    """Θ** from what the user has: its example diagonal, the TRACE diagonal, or the dense kernel.

    Raises:
        InvalidInput: an operator (its diagonal is not known). ShapeMismatch: any other shape than
            (M, k, k) or (M, M, k, k) for FULL, (M,), (M, j, j) or (M, M) for TRACE.
    """
    if is_operator(k_test_test):
        raise InvalidInput(
            f"{operation}: k_test_test is an operator, whose diagonal is not known; pass the example diagonal "
            "compute_ntk(model, x_test, mode='example_diagonal').theta (M, k, k), or the dense Θ(x_test, x_test)"
        )
    t = to_float64(k_test_test, name="k_test_test", operation=operation)
    full = mode is KernelMode.FULL
    if full and k == 1 and t.ndim in (1, 2):  # one output: FULL and TRACE are the same kernel
        t = t.reshape((m, 1, 1) if t.ndim == 1 else (*t.shape, 1, 1))
    if t.ndim == (4 if full else 2):  # the dense kernel
        test = to_kernel_matrix(
            t, name="k_test_test", operation=operation, mode=mode, square=True, symmetrize=True, trace_outputs=k
        )
        if test.n != m or (full and test.k != k):
            raise ShapeMismatch(
                f"{operation}: k_test_test has {test.n} examples (k = {test.k}), k_test_train has {m} (k = {k}); "
                "pass Θ(x_test, x_test)"
            )
        matrix = test.matrix
        if full:
            blocks = np.stack([matrix[i * k : (i + 1) * k, i * k : (i + 1) * k] for i in range(m)])
        else:
            blocks = np.diag(matrix).copy()
        return PriorAtTest(blocks.reshape((m, k, k) if full else (m,)), matrix)
    if full and t.shape == (m, k, k):
        return PriorAtTest((t + t.transpose(0, 2, 1)) / 2, None)
    if not full and t.shape == (m,):
        return PriorAtTest(t / k, None)
    if not full and t.ndim == 3 and t.shape[0] == m and t.shape[1] == t.shape[2]:
        return PriorAtTest(np.trace(t, axis1=1, axis2=2) / k, None)
    expected = f"({m}, {k}, {k}) or ({m}, {m}, {k}, {k})" if full else f"({m},), ({m}, k, k) or ({m}, {m})"
    raise ShapeMismatch(
        f"{operation}: k_test_test has shape {t.shape}; for a {mode.value} solve over {m} test examples pass "
        f"{expected}: compute_ntk(model, x_test, mode='example_diagonal').theta for the variance, or the dense "
        "Θ(x_test, x_test) for the covariance"
    )


class _Transposed:
    """Θ(x, x*) from an operator of Θ(x*, x) that has ``rmatvec``."""

    def __init__(self, kernel: Any) -> None:
        self.shape = (int(kernel.shape[1]), int(kernel.shape[0]))
        self.matvec = kernel.rmatvec


def cross_columns(k_test_train: Any, cross: KernelOperator, *, k: int, operation: str) -> np.ndarray:
    """B = Θ(x, x*) (rows of the train kernel, ``cross.rows`` columns) in the solver's layout (TRACE ÷ k): the
    dense transpose, or one product of the transposed operator per column (NOTE [gp variance by cg]).

    Raises:
        InvalidInput: an operator that is neither one of the package's (``LinearOperator``: its ``.T``) nor has
            ``rmatvec``.
    """
    if cross.matrix is not None:
        return np.array(cross.matrix.T)
    if isinstance(k_test_train, LinearOperator):
        transposed: Any = k_test_train.T  # the package's operators transpose (an NtkOperator, a Ray one)
    elif hasattr(k_test_train, "rmatvec"):
        transposed = _Transposed(k_test_train)
    else:
        raise InvalidInput(
            f"{operation}: the variance by CG needs Θ(x_train, x_test), the transpose of k_test_train, which has no "
            "rmatvec; pass an NtkOperator, an object with rmatvec, or the dense k_test_train"
        )
    op = kernel_operator(transposed, k=k, name="k_test_train.T", operation=operation, mode=cross.mode)
    out = np.empty((op.rows, cross.rows))
    for start in range(0, cross.rows, _COLUMNS_PER_CALL):
        stop = min(start + _COLUMNS_PER_CALL, cross.rows)
        units = np.zeros((cross.rows, stop - start))
        units[np.arange(start, stop), np.arange(stop - start)] = 1.0
        out[:, start:stop] = op.apply(units)
    return out


def posterior_blocks(prior: PriorAtTest, b: np.ndarray, z: np.ndarray, *, m: int, k: int, full: bool) -> np.ndarray:
    """Σ* blocks: (M, k, k) FULL, (M,) TRACE, from B, Z = (Θ + λI)⁻¹ B (n, M·k) or (n, M)."""
    if full:
        quad = np.einsum("ima,imb->mab", b.reshape(-1, m, k), z.reshape(-1, m, k))
        return np.asarray(prior.blocks - (quad + quad.transpose(0, 2, 1)) / 2)
    return np.asarray(prior.blocks - np.sum(b * z, axis=0))
