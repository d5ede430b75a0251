"""The ridge conventions, named: "absolute" adds λI, "relative" adds λ · (mean diagonal entry) · I.

Other libraries differ: neural-tangents' ``diag_reg`` is relative by default (λ · trace(A) / dim(A)), nngeometry
uses λ·N, laplace-torch's posterior precision gives σ²δ. Both ours are stated per call.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from ntk_service.errors import InvalidInput

__all__ = ["RidgeScale", "ridge_value"]

RidgeScale = Literal["absolute", "relative"]
"""How ``ridge`` is scaled before it is added to the kernel's diagonal."""


def ridge_value(matrix: np.ndarray, ridge: float, scale: RidgeScale | str, *, operation: str) -> float:
    """The λ actually added to the diagonal of the square ``matrix``.

    Raises:
        InvalidInput: a negative or non-finite ridge, or an unknown scale.
    """
    if not math.isfinite(ridge) or ridge < 0:
        raise InvalidInput(f"{operation}: ridge must be a finite number ≥ 0, got {ridge}")
    if scale == "absolute":
        return float(ridge)
    if scale == "relative":
        return float(ridge) * float(np.mean(np.diag(matrix))) if matrix.size else 0.0
    raise InvalidInput(f"{operation}: unknown ridge_scale {scale!r}; expected 'absolute' or 'relative'")
