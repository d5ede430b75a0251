"""Data attribution from the eNTK: which training examples drove a prediction, and by how much (TRAK-style).

τ(x*, x_n) = ∇m(x*)ᵀ (GᵀG + λI)⁻¹ (−∇ℓ_n), the first-order change in the test measurement m (the margin, or minus
the squared error) from training on x_n, with the gradients sketched by ``ntk_features`` (D columns, J never
formed) or taken exactly from ``compute_ntk`` where the training kernel fits, and averaged over checkpoints. The
files, in the order the data flows through them:

- ``options``: ``AttributionOptions`` (loss, features, D, ridge, ensemble; plain values a job can store);
- ``targets``: the output function and loss-gradient weights per loss (the table of the math);
- ``checkpoints``: state dicts checked against the model (``IncompatibleCheckpoint``) and loaded;
- ``rows``: inputs read by rows, the compute dtype, the model's outputs (the shared input checks);
- ``features``: the training side of a checkpoint (computed once, in chunks) and the test side;
- ``exact``: the exact kernel's eigenvectors as features (NOTE [exact features]);
- ``scoring``: the ridge solve, score tiles in bounded memory, self-influence, total influence;
- ``answers``: top-k proponents and opponents from tiles;
- ``attributor``: ``fit_attributor``, the two steps in one process;
- ``lds``: the linear datamodeling score, to evaluate and to choose the ridge.

No HTTP, no SQL: the service's jobs (``jobs/kinds/attribution_features.py``, ``jobs/kinds/attribution.py``) call
``train_feature_chunks`` per checkpoint, then ``solve_targets`` and ``score_train_rows`` per test set, merging the
tiles into a ``RunningTop`` they can save and resume (docs/attribution.md).

    >>> attributor = fit_attributor(model, x_train, y_train, checkpoints=states)      # doctest: +SKIP
    >>> attributor.top_influences(x_test, y_test, k=5).proponents                    # (M, 5) indices
    >>> attributor.self_influence().argsort()[::-1][:20]                             # suspects for label noise
"""

from __future__ import annotations

from ntk_service.attribution.answers import RunningTop, TopInfluences, top_influences
from ntk_service.attribution.attributor import Attributor, fit_attributor
from ntk_service.attribution.checkpoints import load_checkpoint
from ntk_service.attribution.exact import exact_memory
from ntk_service.attribution.features import (
    FeatureChunk,
    TrainFeatures,
    feature_chunk_rows,
    target_features,
    train_feature_chunks,
    train_features,
    train_features_memory,
)
from ntk_service.attribution.lds import LdsResult, linear_datamodeling_score
from ntk_service.attribution.options import (
    DEFAULT_DIM,
    DEFAULT_RIDGE,
    AttributionLoss,
    AttributionOptions,
    Ensemble,
    FeatureKind,
)
from ntk_service.attribution.scoring import (
    FittedCheckpoint,
    ScoreTile,
    TilePlan,
    fit_checkpoint,
    iter_score_tiles,
    plan_score_tiles,
    score_memory,
    score_train_rows,
    self_influence_scores,
    solve_targets,
    total_influence_scores,
)

__all__ = [
    "DEFAULT_DIM",
    "DEFAULT_RIDGE",
    "AttributionLoss",
    "AttributionOptions",
    "Attributor",
    "Ensemble",
    "FeatureChunk",
    "FeatureKind",
    "FittedCheckpoint",
    "LdsResult",
    "RunningTop",
    "ScoreTile",
    "TilePlan",
    "TopInfluences",
    "TrainFeatures",
    "exact_memory",
    "feature_chunk_rows",
    "fit_attributor",
    "fit_checkpoint",
    "iter_score_tiles",
    "linear_datamodeling_score",
    "load_checkpoint",
    "plan_score_tiles",
    "score_memory",
    "score_train_rows",
    "self_influence_scores",
    "solve_targets",
    "target_features",
    "top_influences",
    "total_influence_scores",
    "train_feature_chunks",
    "train_features",
    "train_features_memory",
]
