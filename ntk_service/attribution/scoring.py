"""Scores from features: the ridge solve per checkpoint, then τ in tiles, combined over checkpoints.

Per checkpoint c: τ_c(x*, n) = m̃*ᵀ G'_n · s_n with m̃* = (F + λI)⁻¹ m*, F the Gram matrix of the Hessian rows and
λ = ridge × tr(F) / rows (NOTE [ridge choice] in options.py). The solve is one Cholesky factorization of the D × D
matrix F + λI in float64 (D³/3 multiply-adds, done once per checkpoint and ridge), applied to the test features;
ridge 0 (TRAK's default) takes the eigen pseudo-inverse over modes above rcond·λmax instead. The scores themselves
are float32 products (T, D) × (D, n) per tile. All of it runs in torch, whose OpenMP threads sleep while they wait
(``OMP_WAIT_POLICY=PASSIVE``): numpy's OpenBLAS pool spins instead, and on the shared 2-core host a 2048 × 2048
Cholesky took 1.9-2.3 s through SciPy against 0.35-0.65 s through torch (0.33 s with one OpenBLAS thread).

Ensembles (``Ensemble``): "trak" averages the unweighted scores m̃*ᵀ G'_n over checkpoints and multiplies by the
mean loss weight s̄_n (TRAK's eq. 17); "mean" averages each checkpoint's weighted τ_c.

Bounded memory (``plan_score_tiles``): scores of N training × M test examples are produced in tiles, training rows
outer, so each checkpoint's features G'_c are read once (a job reads them from its store), and the solved test
features (C · M · D floats) are kept: memory C·D·(train_rows + M)·4 bytes + 2 tiles (test_rows × train_rows float32).
At N = 10⁵, M = 10⁴, D = 2048, C = 10 and a 4 GB budget: tiles of 12,500 training rows against the whole test set,
2.8 GB (the dense float32 scores alone would be 4 GB).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ntk_service.attribution.features import TrainFeatures
from ntk_service.attribution.options import DEFAULT_RIDGE, Ensemble
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch, format_bytes

__all__ = [
    "FittedCheckpoint",
    "ScoreTile",
    "TilePlan",
    "fit_checkpoint",
    "iter_score_tiles",
    "plan_score_tiles",
    "score_memory",
    "score_train_rows",
    "self_influence_scores",
    "solve_targets",
    "total_influence_scores",
]

_OPERATION = "attribution"


@dataclass(frozen=True)
class FittedCheckpoint:
    """One checkpoint's training side with its ridge solve.

    Attributes:
        train: the training side. ridge: λ relative to the mean diagonal. lam: the absolute λ added to F.
        method: "cholesky" or "eigh (pseudo-inverse, r of D modes)".
    """

    train: TrainFeatures
    ridge: float
    lam: float
    method: str
    _factor: Any

    def solve(self, m: np.ndarray | torch.Tensor) -> torch.Tensor:
        """(F + λI)⁻¹ applied to the rows of m (M, D): (M, D) float64 tensor."""
        rhs = _as_tensor(m).to(torch.float64).T
        if self.method == "cholesky":
            out = torch.cholesky_solve(rhs, self._factor)
        else:
            vec, inv = self._factor
            out = vec @ (inv[:, None] * (vec.T @ rhs))
        return out.T


def fit_checkpoint(train: TrainFeatures, ridge: float = DEFAULT_RIDGE) -> FittedCheckpoint:
    """Factor F + λI for one checkpoint (module docstring).

    Args:
        train (TrainFeatures): the checkpoint's training side.
        ridge (float): λ relative to the mean diagonal of the training kernel, ≥ 0. Default: ``DEFAULT_RIDGE``.

    Returns:
        FittedCheckpoint.

    Raises:
        InvalidInput: a negative or non-finite ridge; a Gram matrix that is not finite.
    """
    if isinstance(ridge, bool) or not math.isfinite(ridge) or ridge < 0:
        raise InvalidInput(f"{_OPERATION}: ridge must be a finite number ≥ 0, got {ridge!r}")
    gram = _as_tensor(train.gram).to(torch.float64)
    if not bool(torch.isfinite(gram).all()):
        raise InvalidInput(f"{_OPERATION}: the Gram matrix of the training features is not finite")
    lam = float(ridge) * float(gram.trace()) / max(train.rows, 1)
    if lam > 0:
        a = gram + lam * torch.eye(gram.shape[0], dtype=torch.float64)
        factor, info = torch.linalg.cholesky_ex(a)
        if int(info) == 0:
            return FittedCheckpoint(train, float(ridge), lam, "cholesky", factor)
        # rounding left F + λI indefinite (λ tiny against λmax): the pseudo-inverse below
    w, vec = torch.linalg.eigh((gram + gram.T) / 2)
    tol = w.shape[0] * torch.finfo(torch.float64).eps * max(float(w[-1]), 0.0)
    keep = w + lam > tol
    inv = 1.0 / (w[keep] + lam)
    method = f"eigh (pseudo-inverse, {int(keep.sum())} of {w.shape[0]} modes)"
    return FittedCheckpoint(train, float(ridge), lam, method, (vec[:, keep], inv))


class ScoreTile(NamedTuple):
    """Scores of test rows ``test_start:test_start + R`` against training rows ``train_start:train_start + C``:
    ``block`` (R, C) float32."""

    test_start: int
    train_start: int
    block: np.ndarray


class TilePlan(NamedTuple):
    """Rows per tile: ``train_rows`` training and ``test_rows`` test examples; ``bytes`` the peak estimate."""

    train_rows: int
    test_rows: int
    bytes: int


def score_memory(n_train_rows: int, n_test: int, test_rows: int, dim: int, checkpoints: int) -> int:
    """Peak bytes of ``iter_score_tiles``: the solved test features (C·M·D float32), one training tile of every
    checkpoint (C·train_rows·D float32) and two score tiles (the block and one product)."""
    return 4 * (checkpoints * dim * (n_test + n_train_rows) + 2 * test_rows * n_train_rows)


def plan_score_tiles(n_train: int, n_test: int, dim: int, checkpoints: int, budget_bytes: int) -> TilePlan:
    """The largest tiles that fit ``budget_bytes``: the whole test set per tile when it fits, training rows halved
    from N until the estimate fits, then test rows halved.

    Raises:
        MemoryEstimateExceeded: even 1 × 1 tiles need more (the solved test features alone do not fit).
    """
    train_rows, test_rows = max(1, n_train), max(1, n_test)
    while score_memory(train_rows, n_test, test_rows, dim, checkpoints) > budget_bytes:
        if train_rows > 1024 or test_rows == 1:
            if train_rows == 1:
                needed = score_memory(1, n_test, 1, dim, checkpoints)
                raise MemoryEstimateExceeded(
                    f"{_OPERATION}: scoring M={n_test} test examples at D={dim} over {checkpoints} checkpoint(s) needs "
                    f"at least {format_bytes(needed)} (the solved test features), over the memory budget of "
                    f"{format_bytes(budget_bytes)}; score the test set in parts or use a smaller dim",
                    estimate_bytes=needed,
                    budget_bytes=budget_bytes,
                )
            train_rows = max(1, train_rows // 2)
        else:
            test_rows = max(1, test_rows // 2)
    return TilePlan(train_rows, test_rows, score_memory(train_rows, n_test, test_rows, dim, checkpoints))


def _check(fitted: Sequence[FittedCheckpoint], tests: Sequence[np.ndarray] | None) -> None:
    if not fitted:
        raise InvalidInput(f"{_OPERATION}: no checkpoints to score")
    n = fitted[0].train.n
    for c, f in enumerate(fitted):
        if f.train.n != n:
            raise ShapeMismatch(
                f"{_OPERATION}: checkpoint {c} has features of N={f.train.n} training examples, checkpoint 0 of N={n}"
            )
    if tests is None:
        return
    if len(tests) != len(fitted):
        raise InvalidInput(f"{_OPERATION}: {len(tests)} test feature sets for {len(fitted)} checkpoints")
    m = tests[0].shape[0]
    for c, (f, t) in enumerate(zip(fitted, tests, strict=True)):
        if t.ndim != 2 or t.shape != (m, f.train.dim):
            raise ShapeMismatch(
                f"{_OPERATION}: test features of checkpoint {c} have shape {tuple(t.shape)}, expected ({m}, "
                f"{f.train.dim}) (M, D) from target_features with that checkpoint's training side"
            )


def _as_tensor(a: Any) -> torch.Tensor:
    """A tensor view of an array (no copy for a writable numpy array or a tensor), else a copy of it: a read-only
    memmap or a zarr slice."""
    if isinstance(a, torch.Tensor):
        return a
    array = np.asarray(a)
    return torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)


def _mean_loss_weights(fitted: Sequence[FittedCheckpoint], start: int, stop: int) -> torch.Tensor:
    return torch.stack([_as_tensor(f.train.loss_weights[start:stop]).to(torch.float64) for f in fitted]).mean(dim=0)


def solve_targets(fitted: Sequence[FittedCheckpoint], tests: Sequence[Any]) -> list[torch.Tensor]:
    """(F + λI)⁻¹ m* for the test features of every checkpoint: what every score tile multiplies.

    Args:
        fitted (sequence of FittedCheckpoint): one per checkpoint, all of the same N.
        tests (sequence of arrays): the test features (M, D_c) of each checkpoint (``target_features``); any array
            numpy reads (a memmap or zarr array a job stored).

    Returns:
        list of (M, D_c) float32 tensors, one per checkpoint.

    Raises:
        InvalidInput: no checkpoints. ShapeMismatch: features that do not fit together.
    """
    _check(fitted, tests)
    return [f.solve(t).to(torch.float32) for f, t in zip(fitted, tests, strict=True)]


def score_train_rows(
    fitted: Sequence[FittedCheckpoint],
    solved: Sequence[torch.Tensor],
    train: tuple[int, int],
    *,
    ensemble: Ensemble | str = Ensemble.TRAK,
    test_rows: int | None = None,
) -> Iterator[ScoreTile]:
    """The score tiles of training rows ``train = (j0, j1)`` against every test row: each checkpoint's features of
    those rows are read once, then one tile per ``test_rows`` test rows (a job records a training block as a unit).

    Args:
        fitted (sequence of FittedCheckpoint): one per checkpoint. solved: ``solve_targets(fitted, tests)``.
        train (tuple of int): the training rows [j0, j1).
        ensemble (Ensemble or str): "trak" or "mean" (module docstring). Default: "trak".
        test_rows (int, optional): test rows per tile. Default: all.

    Returns:
        Iterator of ScoreTile, float32 blocks (rows, j1 − j0).

    Raises:
        InvalidInput: an unknown ensemble.
    """
    rule = _ensemble(ensemble)
    j0, j1 = train
    m = int(solved[0].shape[0])
    te = m if test_rows is None else max(1, int(test_rows))
    cols = [_as_tensor(f.train.features[j0:j1]).to(torch.float32) for f in fitted]
    weights = [_as_tensor(f.train.loss_weights[j0:j1]).to(torch.float32) for f in fitted]
    mean_s = torch.stack(weights).mean(dim=0)
    for i0 in range(0, m, te):
        block = torch.zeros(min(m, i0 + te) - i0, j1 - j0, dtype=torch.float32)
        for s_c, g_c, w_c in zip(solved, cols, weights, strict=True):
            if rule is Ensemble.TRAK:
                block.addmm_(s_c[i0 : i0 + te], g_c.T)
            else:
                block.addmm_(s_c[i0 : i0 + te], (g_c * w_c[:, None]).T)
        block /= len(fitted)
        if rule is Ensemble.TRAK:
            block *= mean_s
        yield ScoreTile(i0, j0, block.numpy())


def iter_score_tiles(
    fitted: Sequence[FittedCheckpoint],
    tests: Sequence[np.ndarray],
    *,
    ensemble: Ensemble | str = Ensemble.TRAK,
    train_rows: int | None = None,
    test_rows: int | None = None,
) -> Iterator[ScoreTile]:
    """τ(x*, n) for every test and training example, tile by tile (training rows outer), combined over checkpoints:
    ``solve_targets`` once, then ``score_train_rows`` for each block of training rows.

    Args:
        fitted (sequence of FittedCheckpoint): one per checkpoint, all of the same N.
        tests (sequence of ndarray): the test features (M, D_c) of each checkpoint (``target_features``).
        ensemble (Ensemble or str): "trak" or "mean" (module docstring). Default: "trak".
        train_rows, test_rows (int, optional): rows per tile (``plan_score_tiles``). Default: all.

    Returns:
        Iterator of ScoreTile: every (test, train) pair once; blocks are float32.

    Raises:
        InvalidInput: no checkpoints, an unknown ensemble. ShapeMismatch: features that do not fit together.
    """
    _ensemble(ensemble)
    solved = solve_targets(fitted, tests)
    n = fitted[0].train.n
    tr = n if train_rows is None else max(1, int(train_rows))
    for j0 in range(0, n, tr):
        yield from score_train_rows(fitted, solved, (j0, min(n, j0 + tr)), ensemble=ensemble, test_rows=test_rows)


def _ensemble(value: Ensemble | str) -> Ensemble:
    try:
        return Ensemble(value)
    except ValueError:
        raise InvalidInput(
            f"{_OPERATION}: ensemble must be one of {[e.value for e in Ensemble]}, got {value!r}"
        ) from None


def self_influence_scores(
    fitted: Sequence[FittedCheckpoint], *, ensemble: Ensemble | str = Ensemble.TRAK, train_rows: int = 4096
) -> np.ndarray:
    """τ(x_n, x_n): each training example's score on its own measurement (its margin at its label, or its loss),
    G'_n (F + λI)⁻¹ G'_nᵀ · s_n combined over checkpoints; high values flag examples the model fits only by
    memorizing them, such as mislabeled ones. (N,) float64.

    Raises:
        InvalidInput: no checkpoints, an unknown ensemble. ShapeMismatch: checkpoints of different N.
    """
    rule = _ensemble(ensemble)
    _check(fitted, None)
    n = fitted[0].train.n
    out = torch.zeros(n, dtype=torch.float64)
    for j0 in range(0, n, train_rows):
        j1 = min(n, j0 + train_rows)
        total = torch.zeros(j1 - j0, dtype=torch.float64)
        for f in fitted:
            g = _as_tensor(f.train.features[j0:j1]).to(torch.float64)
            q = (f.solve(g) * g).sum(dim=1)
            total += q if rule is Ensemble.TRAK else q * _as_tensor(f.train.loss_weights[j0:j1])
        total /= len(fitted)
        out[j0:j1] = total * _mean_loss_weights(fitted, j0, j1) if rule is Ensemble.TRAK else total
    return out.numpy()


def total_influence_scores(
    fitted: Sequence[FittedCheckpoint],
    tests: Sequence[np.ndarray],
    *,
    ensemble: Ensemble | str = Ensemble.TRAK,
    train_rows: int = 4096,
) -> np.ndarray:
    """Σ_j τ(x*_j, n) over the test examples, for each training example n: (N,) float64. Scores are linear in the
    test feature, so this is one solve of Σ_j m*_j per checkpoint, never the (M, N) matrix.

    Raises:
        InvalidInput, ShapeMismatch: as ``iter_score_tiles``.
    """
    rule = _ensemble(ensemble)
    _check(fitted, tests)
    summed = [
        f.solve(_as_tensor(t).to(torch.float64).sum(dim=0, keepdim=True))[0] for f, t in zip(fitted, tests, strict=True)
    ]
    n = fitted[0].train.n
    out = torch.zeros(n, dtype=torch.float64)
    for j0 in range(0, n, train_rows):
        j1 = min(n, j0 + train_rows)
        total = torch.zeros(j1 - j0, dtype=torch.float64)
        for f, v in zip(fitted, summed, strict=True):
            t = _as_tensor(f.train.features[j0:j1]).to(torch.float64) @ v
            total += t if rule is Ensemble.TRAK else t * _as_tensor(f.train.loss_weights[j0:j1])
        total /= len(fitted)
        out[j0:j1] = total * _mean_loss_weights(fitted, j0, j1) if rule is Ensemble.TRAK else total
    return out.numpy()
