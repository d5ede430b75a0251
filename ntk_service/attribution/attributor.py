"""``fit_attributor``: TRAK-style attribution over checkpoints in one process, for data that fits in memory.

It runs the two steps a job runs separately (``features.py``: the training side once per checkpoint;
``scoring.py``: the ridge solve and the scores) and keeps the checkpoints' models for the test side. The answers
stream where they can: ``top_influences`` through score tiles, ``self_influence`` and ``total_influence`` without
any (M, N) matrix; only ``scores`` returns the dense matrix, refused up front when it would not fit the budget.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn

from ntk_service.attribution.answers import TopInfluences, top_influences
from ntk_service.attribution.checkpoints import load_checkpoint
from ntk_service.attribution.features import TrainFeatures, target_features, train_features
from ntk_service.attribution.options import AttributionOptions
from ntk_service.attribution.scoring import (
    FittedCheckpoint,
    ScoreTile,
    fit_checkpoint,
    iter_score_tiles,
    plan_score_tiles,
    self_influence_scores,
    total_influence_scores,
)
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, format_bytes
from ntk_service.kernels.runtime.device import default_memory_budget

__all__ = ["Attributor", "fit_attributor"]

_OPERATION = "attribution"


class Attributor:
    """Attribution scores τ(x*, x_n) of one training set over an ensemble of checkpoints (``fit_attributor``).

    Attributes:
        models: each checkpoint's model (eval-mode copies). train: the training side of each checkpoint.
        options: the options it was fitted with. fitted: each checkpoint's ridge solve. n_train: N.
    """

    def __init__(
        self, models: Sequence[nn.Module], train: Sequence[TrainFeatures], options: AttributionOptions
    ) -> None:
        self.models = list(models)
        self.train = list(train)
        self.options = options
        self.fitted: list[FittedCheckpoint] = [fit_checkpoint(t, options.ridge) for t in self.train]

    @property
    def n_train(self) -> int:
        """N, the training examples."""
        return self.train[0].n

    def with_ridge(self, ridge: float) -> Attributor:
        """The same features under another ridge (one D × D factorization per checkpoint, no new features).

        Raises:
            InvalidInput: a negative or non-finite ridge.
        """
        return Attributor(self.models, self.train, self.options.replace(ridge=ridge))

    def target_features(self, x: Any, y: Any | None = None) -> list[np.ndarray]:
        """Each checkpoint's test features (M, D) (``features.target_features``); pass them to the answers below
        to score one test set under several ridges or answers without recomputing them."""
        return [
            target_features(m, x, y, train=t, options=self.options)
            for m, t in zip(self.models, self.train, strict=True)
        ]

    def _tests(self, x: Any, y: Any | None, features: Sequence[np.ndarray] | None) -> Sequence[np.ndarray]:
        if features is not None:
            return features
        if x is None:
            raise InvalidInput(f"{_OPERATION}: pass test inputs x (or their target_features)")
        return self.target_features(x, y)

    def tiles(
        self,
        x: Any = None,
        y: Any | None = None,
        *,
        features: Sequence[np.ndarray] | None = None,
        train_rows: int | None = None,
        test_rows: int | None = None,
    ) -> Iterator[ScoreTile]:
        """The scores as tiles (``scoring.iter_score_tiles``), sized to the memory budget unless given.

        Args:
            x: test inputs (M, *input). y: test labels (class indices (M,) or targets (M, *out)); None measures
                the predicted class (cross-entropy). features: precomputed ``target_features`` instead of x, y.
            train_rows, test_rows (int, optional): rows per tile. Default: ``plan_score_tiles`` for the budget.

        Raises:
            MemoryEstimateExceeded: the solved test features alone exceed the budget.
        """
        tests = self._tests(x, y, features)
        if train_rows is None or test_rows is None:
            plan = plan_score_tiles(
                self.n_train, tests[0].shape[0], max(t.dim for t in self.train), len(self.train), self._budget()
            )
            train_rows = plan.train_rows if train_rows is None else train_rows
            test_rows = plan.test_rows if test_rows is None else test_rows
        return iter_score_tiles(
            self.fitted, tests, ensemble=self.options.ensemble, train_rows=train_rows, test_rows=test_rows
        )

    def scores(
        self, x: Any = None, y: Any | None = None, *, features: Sequence[np.ndarray] | None = None
    ) -> np.ndarray:
        """τ(x*, x_n) for every test and training example: (M, N) float32, positive for proponents.

        Raises:
            MemoryEstimateExceeded: the (M, N) matrix would exceed the budget: use ``top_influences`` or
                ``tiles`` instead.
        """
        tests = self._tests(x, y, features)
        m = tests[0].shape[0]
        needed, budget = 4 * m * self.n_train, self._budget()
        if needed > budget // 2:
            raise MemoryEstimateExceeded(
                f"{_OPERATION}: the dense scores of M={m} test × N={self.n_train} training examples take "
                f"{format_bytes(needed)}, over half the memory budget of {format_bytes(budget)}; use top_influences or "
                "tiles (bounded memory) instead",
                estimate_bytes=needed,
                budget_bytes=budget,
            )
        out = np.empty((m, self.n_train), dtype=np.float32)
        for tile in self.tiles(features=tests):
            out[
                tile.test_start : tile.test_start + tile.block.shape[0],
                tile.train_start : tile.train_start + tile.block.shape[1],
            ] = tile.block
        return out

    def top_influences(
        self, x: Any = None, y: Any | None = None, *, k: int = 10, features: Sequence[np.ndarray] | None = None
    ) -> TopInfluences:
        """The k strongest proponents and opponents of each test example (``answers.top_influences``), from tiles.

        Example::

            >>> top = attributor.top_influences(x_test[:5], y_test[:5], k=3)     # doctest: +SKIP
            >>> top.proponents.shape, top.opponent_scores.shape                  # (5, 3), (5, 3)
        """
        tests = self._tests(x, y, features)
        return top_influences(self.tiles(features=tests), n_test=tests[0].shape[0], n_train=self.n_train, k=k)

    def self_influence(self) -> np.ndarray:
        """τ(x_n, x_n) for every training example (``scoring.self_influence_scores``): (N,) float64; the highest
        are the first to inspect for label noise (docs/attribution.md's recipe)."""
        return self_influence_scores(self.fitted, ensemble=self.options.ensemble)

    def total_influence(
        self, x: Any = None, y: Any | None = None, *, features: Sequence[np.ndarray] | None = None
    ) -> np.ndarray:
        """Σ over the test set of τ(x*, x_n), for every training example: (N,) float64 (positive: it helped the
        test set's margins, or lowered its loss, as a whole)."""
        return total_influence_scores(self.fitted, self._tests(x, y, features), ensemble=self.options.ensemble)

    def _budget(self) -> int:
        opts = self.options
        return default_memory_budget() if opts.memory_budget_bytes is None else opts.memory_budget_bytes


def fit_attributor(
    model: nn.Module,
    x_train: Any,
    y_train: Any,
    *,
    checkpoints: Sequence[Mapping[str, Any]] | None = None,
    options: AttributionOptions | None = None,
) -> Attributor:
    """TRAK-style attribution of ``model``'s predictions to its training examples, over an ensemble of checkpoints.

    Example::

        >>> attributor = fit_attributor(model, x_train, y_train, checkpoints=[m.state_dict() for m in runs])
        ... # doctest: +SKIP
        >>> attributor.scores(x_test, y_test).shape                         # (M, N)
        >>> attributor.top_influences(x_test, y_test, k=5).proponents       # (M, 5) training indices
        >>> attributor.self_influence().shape                               # (N,)

    Args:
        model (nn.Module): the architecture (and, without ``checkpoints``, the weights); never modified.
        x_train: training inputs (N, *input): a tensor, a tuple or mapping of tensors, or a sliceable array.
        y_train: class indices (N,) for cross-entropy, targets (N, *out) for mse.
        checkpoints (sequence of state dicts, optional): the ensemble: trained copies of the model (other seeds,
            or checkpoints along one run). Default: None, the model's own weights as the one checkpoint.
        options (AttributionOptions, optional): loss, features, D, ridge, ensemble, seed, ... Default:
            ``AttributionOptions()``.

    Returns:
        Attributor: the fitted training side; its methods answer for test sets.

    Raises:
        InvalidInput: an empty list of checkpoints; IncompatibleCheckpoint for a checkpoint of another architecture;
            labels of the wrong shape or kind (ShapeMismatch); as ``ntk_features`` / ``compute_ntk``.
        MemoryEstimateExceeded: a checkpoint's features over the budget (before computing them).
    """
    opts = AttributionOptions() if options is None else options
    states: list[Mapping[str, Any] | None] = [None] if checkpoints is None else list(checkpoints)
    if not states:
        raise InvalidInput(f"{_OPERATION}: checkpoints is empty; pass at least one state dict, or None")
    models = [load_checkpoint(model, state, index=c, operation=_OPERATION) for c, state in enumerate(states)]
    train = [train_features(m, x_train, y_train, options=opts, index=c) for c, m in enumerate(models)]
    return Attributor(models, train, opts)
