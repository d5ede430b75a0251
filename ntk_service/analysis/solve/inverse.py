"""A solver as an operator: (Θ + λI)⁻¹ as a ``LinearOperator`` whose product is a solve (curvlinops'
``CGInverseLinearOperator``, with any solver of the table).

    >>> inverse = InverseOperator(ntk_operator(model, x), ridge=1e-3)      # (N·k, N·k)           # doctest: +SKIP
    >>> alpha = inverse @ y.reshape(-1, 1)                                 # (N·k, 1): α          # doctest: +SKIP
    >>> inverse.last.solver, inverse.last.converged                        # "block", True        # doctest: +SKIP

Each product solves for its columns (one ``solve_kernel`` call per column: the block method takes one right-hand
side at a time, CG the block). A solve that does not converge raises rather than return a wrong product.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ntk_service.analysis.solve.problem import SolverOptions, SolverResult
from ntk_service.analysis.solve.table import check_ridge_positive, solve_kernel
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.operators.base import LinearOperator

__all__ = ["InverseOperator"]


class InverseOperator(LinearOperator):
    """(Θ + λI)⁻¹ of a square kernel, each product one solve (module docstring).

    Args:
        kernel: Θ(x, x), dense or an operator (FULL: rows N·k; TRACE: rows N, read as trace / k per column).
        ridge: λ > 0. options: how to solve (``SolverOptions``). Default: SolverOptions() (auto).

    Attributes:
        last: the ``SolverResult`` of the latest column solved, or None.

    Raises:
        InvalidInput: ridge ≤ 0 or NaN. ShapeMismatch: a kernel that is not square.
    """

    def __init__(self, kernel: Any, *, ridge: float, options: SolverOptions | None = None) -> None:
        self.kernel = kernel
        self.ridge = check_ridge_positive(ridge, operation="InverseOperator")
        self.options = options or SolverOptions()
        shape = tuple(int(s) for s in (kernel.shape if isinstance(kernel, LinearOperator) else np.shape(kernel)))
        if isinstance(kernel, LinearOperator):
            rows, cols = shape
            self.mode, self.k = kernel.mode, kernel.k
        elif len(shape) == 4:  # a dense FULL kernel (N, N, k, k)
            rows, cols = shape[0] * shape[2], shape[1] * shape[3]
            self.mode, self.k = KernelMode.FULL, shape[2]
        elif len(shape) == 2:
            rows, cols = shape
            self.mode, self.k = KernelMode.TRACE, 1
        else:
            raise ShapeMismatch(f"InverseOperator: a kernel of shape {shape} is neither FULL nor TRACE")
        if rows != cols:
            raise ShapeMismatch(f"InverseOperator: the kernel has shape {shape}; an inverse needs a square one")
        self.shape = (rows, cols)
        self.dtype = torch.float64
        self.is_symmetric = True
        self.last: SolverResult | None = None

    def _matmat(self, v: torch.Tensor) -> torch.Tensor:
        full = self.mode is KernelMode.FULL
        k = self.k if full else 1
        columns = []
        for j in range(v.shape[1]):
            y = v[:, j].double().numpy().reshape(-1, k)
            result = solve_kernel(self.kernel, y, ridge=self.ridge, options=self.options)
            if not result.converged:
                raise InvalidInput(
                    f"InverseOperator: the solve of column {j} did not converge ({result.stop_reason}, residual "
                    f"{float(result.residual.max()):.3g}); loosen options.rtol, raise the ridge or give it more time"
                )
            self.last = result
            columns.append(torch.from_numpy(result.solution.reshape(-1)))
        return torch.stack(columns, dim=1) if columns else torch.zeros(self.shape[0], 0, dtype=torch.float64)
