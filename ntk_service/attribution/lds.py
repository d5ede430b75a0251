"""The linear datamodeling score (LDS; Park et al. 2023, def. 5): how well summed scores rank retrained models.

For random subsets S_1 … S_s of the training set (masks), models retrained on each give a measurement f_j(x*)
(TRAK: the margin of the test label). Attribution scores τ predict it by the additive datamodel
g_j(x*) = Σ_{n ∈ S_j} τ(x*, n); the LDS of a test example is the Spearman rank correlation over j of g_j(x*) and
f_j(x*), and the LDS of a method is its mean over test examples. Use it to choose the ridge
(docs/attribution.md, "Choosing the ridge").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ntk_service.errors import InvalidInput, ShapeMismatch

__all__ = ["LdsResult", "linear_datamodeling_score"]


@dataclass(frozen=True)
class LdsResult:
    """Attributes: mean: the LDS (mean over test examples with a defined correlation). per_example: (M,) Spearman
    correlation per test example (NaN where the scores or the measurements are constant over the subsets)."""

    mean: float
    per_example: np.ndarray


def _ranks(a: np.ndarray) -> np.ndarray:
    """Ranks along axis 0, ties averaged (scipy's ``rankdata(method='average')``)."""
    order = np.argsort(a, axis=0, kind="stable")
    ranks = np.empty_like(a, dtype=np.float64)
    n = a.shape[0]
    np.put_along_axis(ranks, order, np.arange(n, dtype=np.float64)[:, None].repeat(a.shape[1], 1), axis=0)
    for j in range(a.shape[1]):  # average the ranks of ties (rare for float scores)
        col = a[order[:, j], j]
        if np.unique(col).shape[0] == n:
            continue
        _, first, counts = np.unique(col, return_index=True, return_counts=True)
        for f, c in zip(first, counts, strict=True):
            if c > 1:
                ranks[order[f : f + c, j], j] = f + (c - 1) / 2
    return ranks


def linear_datamodeling_score(scores: Any, masks: Any, outputs: Any) -> LdsResult:
    """LDS of attribution scores against models retrained on subsets (module docstring).

    Args:
        scores: (M, N) τ(x*_i, x_n).
        masks: (S, N) booleans (or 0/1): training example n was in subset j.
        outputs: (S, M) the measurement of test example i by the model retrained on subset j.

    Returns:
        LdsResult: mean and per-example Spearman correlations.

    Raises:
        ShapeMismatch: shapes that do not fit together. InvalidInput: fewer than 3 subsets, non-finite values.
    """
    tau = np.asarray(scores, dtype=np.float64)
    mask = np.asarray(masks).astype(np.float64)
    out = np.asarray(outputs, dtype=np.float64)
    if tau.ndim != 2 or mask.ndim != 2 or out.ndim != 2:
        raise ShapeMismatch(
            f"linear_datamodeling_score: expected scores (M, N), masks (S, N), outputs (S, M); got "
            f"{tau.shape}, {mask.shape}, {out.shape}"
        )
    (m, n), s = tau.shape, mask.shape[0]
    if mask.shape[1] != n or out.shape != (s, m):
        raise ShapeMismatch(
            f"linear_datamodeling_score: scores {tau.shape} (M, N), masks {mask.shape} (S, N) and outputs "
            f"{out.shape} (S, M) do not fit together"
        )
    if s < 3:
        raise InvalidInput(f"linear_datamodeling_score: a rank correlation needs at least 3 subsets, got {s}")
    if not (np.isfinite(tau).all() and np.isfinite(out).all()):
        raise InvalidInput("linear_datamodeling_score: scores and outputs must be finite")
    predicted = mask @ tau.T  # (S, M): Σ_{n ∈ S_j} τ(x*_i, n)
    rp, ro = _ranks(predicted), _ranks(out)
    rp -= rp.mean(axis=0)
    ro -= ro.mean(axis=0)
    denominator = np.sqrt((rp * rp).sum(axis=0) * (ro * ro).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = np.where(denominator > 0, (rp * ro).sum(axis=0) / np.where(denominator > 0, denominator, 1), np.nan)
    valid = np.isfinite(rho)
    return LdsResult(mean=float(rho[valid].mean()) if valid.any() else float("nan"), per_example=rho)
