"""Attribution features of one checkpoint: the training side (computed once, stored) and the test side.

For each training example n the feature pass computes G'_n (D,), the projected gradient TRAK scores against: the
margin gradient Φ(x_n)ᵀ w_n for cross-entropy, the loss-gradient feature Σ_a (y − f)_a Φ_a(x_n) for mse; its loss
weight s_n (1 − p_y, or 1); and the Gram matrix F = Σ_rows g gᵀ of the Hessian rows (``targets.py``), in float64.
That is all scoring needs of the training set: a job writes the chunks' G' and s to its store and keeps F (D × D).
A test example's feature is Φ(x*)ᵀ u* (``target_features``), sketched with the same seed and D.

Features come from ``ntk_features`` (``FeatureKind.STRUCTURED`` / ``GAUSSIAN``, E[ΦΦᵀ] = Θ) through
``OutputFunction`` (k = 1: one sketched row per example, whatever the number of outputs) or ``AllOutputs`` (mse's
k rows), which share parameter names, so Φ_OF(x, w) = Σ_a w_a Φ_a(x) with the same draws (the sketch is linear in
J). ``FeatureKind.EXACT`` instead computes the training kernel K = G Gᵀ (N·c × N·c) with ``compute_ntk`` and
represents it exactly by its eigenvectors (``exact.py``, NOTE [exact features]).

Memory (``train_features_memory``): G' (N·D), the Gram matrix and one chunk's float64 rows (2·D² + rows·D floats), and
one chunk of Φ; exact: ``exact.exact_memory``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ntk_service.attribution.checkpoints import AllOutputs, OutputFunction, weighted_inputs
from ntk_service.attribution.exact import ExactBasis, exact_memory, exact_target, exact_train_side
from ntk_service.attribution.options import AttributionLoss, AttributionOptions, FeatureKind
from ntk_service.attribution.rows import (
    OPERATION,
    budget,
    cast,
    compute_dtype,
    engine_params,
    example_shape,
    in_dtype,
    model_outputs,
    output_shape,
    refuse,
    rows,
    size,
)
from ntk_service.attribution.targets import check_labels, measurement_weights, train_weights
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.sketch.features import ntk_features

__all__ = [
    "MAX_ROWS_PER_CHUNK",
    "FeatureChunk",
    "TrainFeatures",
    "feature_chunk_rows",
    "target_features",
    "train_feature_chunks",
    "train_features",
    "train_features_memory",
]

MAX_ROWS_PER_CHUNK = 4096
"""Training examples per chunk of the feature pass at most: one ``ntk_features`` call amortizes its capture over
the chunk, and a chunk's Φ stays in the tens of MB (4096 · D floats for cross-entropy)."""


@dataclass(frozen=True)
class FeatureChunk:
    """Training examples ``start:start + n`` of one checkpoint's feature pass.

    Attributes:
        start: the first example's index. features: (n, D) G'. loss_weights: (n,) float64 s.
        gram: (D, D) float64, this chunk's Σ g gᵀ over its Hessian rows. rows: its Hessian rows (n·c).
    """

    start: int
    features: np.ndarray
    loss_weights: np.ndarray
    gram: np.ndarray
    rows: int


@dataclass(frozen=True)
class TrainFeatures:
    """The training side of one checkpoint: everything scoring needs (module docstring).

    Attributes:
        loss: the loss. kind: the feature kind. seed: the sketch's seed (options.seed + checkpoint index).
        features: (N, D) G', float32 or float64, or any row-sliceable array (a memmap or zarr array a job stored).
        loss_weights: (N,) float64 s. gram: (D, D) float64 F. rows: the number of Hessian rows (N·c), for the
            relative ridge. exact: the exact path's basis, None for a sketch. input_shape: the per-example shape of
        the training inputs (None for a tuple or mapping of inputs), checked against test inputs.
    """

    loss: AttributionLoss
    kind: FeatureKind
    seed: int
    features: Any
    loss_weights: np.ndarray
    gram: np.ndarray
    rows: int
    exact: ExactBasis | None = None
    input_shape: tuple[int, ...] | None = None

    @property
    def n(self) -> int:
        """N, the training examples."""
        return int(self.features.shape[0])

    @property
    def dim(self) -> int:
        """D, the feature dimension (the rank r of the kernel for exact features)."""
        return int(self.features.shape[1])


def train_features_memory(n: int, k: int, dim: int, loss: AttributionLoss, *, chunk: int, itemsize: int = 4) -> int:
    """Bytes of ``train_features`` beside the model: G' (n, D), the Gram matrix and a chunk's float64 product
    operands, and one chunk's Φ (chunk, c, D) (c = 1 for cross-entropy, k for mse); ``ntk_features`` plans its own
    passes inside what is left."""
    c = 1 if loss is AttributionLoss.CROSS_ENTROPY else k
    return n * dim * itemsize + 2 * dim * dim * 8 + chunk * c * dim * (2 * itemsize + 8)


def feature_chunk_rows(n: int, k: int, options: AttributionOptions, itemsize: int, limit: int) -> int:
    """Examples per chunk of a feature pass over n examples with k outputs: ``options.rows_per_chunk``, else as many
    as a quarter of the budget ``limit`` holds for Φ and its copy, at most ``MAX_ROWS_PER_CHUNK`` (a job fixes it at
    submission, so every resumed chunk covers the same rows)."""
    if options.rows_per_chunk is not None:
        return min(n, options.rows_per_chunk)
    c = 1 if options.loss is AttributionLoss.CROSS_ENTROPY else k
    fits = limit // 4 // max(1, c * options.dim * (2 * itemsize + 8))  # a quarter of the budget for Φ and its copy
    return max(1, min(n, MAX_ROWS_PER_CHUNK, int(fits)))


def train_feature_chunks(
    model: nn.Module, x: Any, y: Any, *, options: AttributionOptions, index: int = 0
) -> Iterator[FeatureChunk]:
    """The sketched feature pass over the training set, one chunk of examples at a time (rows do not interact).

    Args:
        model (nn.Module): the model at one checkpoint (``load_checkpoint``), in eval semantics.
        x: training inputs (N, *input): a tensor, a tuple or mapping of tensors, or a sliceable array read by chunks.
        y: labels (N,) class indices (cross-entropy) or targets (N, *out) (mse).
        options (AttributionOptions): a sketch kind ("structured" or "gaussian"), D, seed, params, dtype, budget.
        index (int): the checkpoint's index: the sketch's seed is options.seed + index. Default: 0.

    Returns:
        Iterator of FeatureChunk, in order; summing their ``gram`` gives F.

    Raises:
        InvalidInput: exact features (use ``train_features``), labels of the wrong shape or kind
            (``check_labels``), a model that does not return a tensor; as ``ntk_features``.
        MemoryEstimateExceeded: G', F and one chunk over the budget (before any work).
    """
    if options.features is FeatureKind.EXACT:
        raise InvalidInput(f"{OPERATION}: features='exact' has no chunked pass; call train_features")
    dtype = compute_dtype(model, options)
    model = in_dtype(model, dtype)
    n = size(x)
    out_shape = output_shape(model, x, dtype, "x_train")
    k = math.prod(out_shape)
    labels = check_labels(y, n=n, out_shape=out_shape, loss=options.loss, name="y_train", operation=OPERATION)
    limit = budget(options)
    item = torch.finfo(dtype).bits // 8
    chunk = feature_chunk_rows(n, k, options, item, limit)
    needed = train_features_memory(n, k, options.dim, options.loss, chunk=chunk, itemsize=item)
    if needed > limit:
        raise refuse(f"features of N={n} examples at D={options.dim}", needed, limit, "use a smaller dim")
    for start in range(0, n, chunk):
        xb, yb = rows(x, start, start + chunk), labels[start : start + chunk]
        yield _sketch_chunk(model, xb, yb, start, dtype, options, seed=options.seed + index, limit=limit)


def _sketch_chunk(
    model: nn.Module,
    xb: Any,
    yb: torch.Tensor,
    start: int,
    dtype: torch.dtype,
    options: AttributionOptions,
    *,
    seed: int,
    limit: int,
) -> FeatureChunk:
    xb = cast(xb, dtype)
    weights = train_weights(model_outputs(model, xb, dtype), yb, options.loss)
    common: dict[str, Any] = {
        "dim": options.dim,
        "seed": seed,
        "params": engine_params(options),
        "dtype": dtype,
        "memory_budget_bytes": limit // 2,
        "sketch": options.features.value,
    }
    if weights.rows is not None:  # cross-entropy: the margin row, s = 1 − p_y
        g = ntk_features(OutputFunction(model), weighted_inputs(xb, weights.rows.to(dtype)), **common)[:, 0]
        s = weights.loss
        flat = g.double()
    else:  # mse: all k rows for F; G' = Σ_a (y − f)_a Φ_a, s = 1
        phi = ntk_features(AllOutputs(model), xb, **common)
        g = torch.einsum("na,nad->nd", weights.loss.to(dtype), phi)
        s = torch.ones(phi.shape[0], dtype=torch.float64)
        flat = phi.reshape(-1, phi.shape[-1]).double()
    return FeatureChunk(
        start=start,
        features=g.numpy(),
        loss_weights=s.numpy(),
        gram=(flat.T @ flat).numpy(),
        rows=int(flat.shape[0]),
    )


def train_features(
    model: nn.Module, x: Any, y: Any, *, options: AttributionOptions | None = None, index: int = 0
) -> TrainFeatures:
    """The training side of one checkpoint, in memory (module docstring).

    Example::

        >>> tf = train_features(model, x_train, y_train, options=AttributionOptions(dim=1024))  # doctest: +SKIP
        >>> tf.features.shape, tf.gram.shape                                  # (N, 1024), (1024, 1024)

    Args:
        model, x, y, index: as ``train_feature_chunks``.
        options (AttributionOptions, optional): Default: ``AttributionOptions()``.

    Returns:
        TrainFeatures: features (N, D) numpy in the compute dtype (exact: float64, D = the kernel's rank),
        loss_weights (N,), gram (D, D).

    Raises:
        InvalidInput, MemoryEstimateExceeded: as ``train_feature_chunks``; the exact kernel over the budget.
    """
    opts = AttributionOptions() if options is None else options
    if opts.features is FeatureKind.EXACT:
        return _exact_train_features(model, x, y, opts)
    chunks = list(train_feature_chunks(model, x, y, options=opts, index=index))
    gram = chunks[0].gram.copy()
    for c in chunks[1:]:
        gram += c.gram
    return TrainFeatures(
        loss=opts.loss,
        kind=opts.features,
        seed=opts.seed + index,
        features=np.concatenate([c.features for c in chunks]),
        loss_weights=np.concatenate([c.loss_weights for c in chunks]),
        gram=gram,
        rows=sum(c.rows for c in chunks),
        input_shape=example_shape(x),
    )


def _exact_train_features(model: nn.Module, x: Any, y: Any, options: AttributionOptions) -> TrainFeatures:
    n = size(x)
    x_all = cast(rows(x, 0, n), torch.float64)
    model64 = in_dtype(model, torch.float64)
    out_shape = output_shape(model64, x_all, torch.float64, "x_train")
    k = math.prod(out_shape)
    labels = check_labels(y, n=n, out_shape=out_shape, loss=options.loss, name="y_train", operation=OPERATION)
    limit = budget(options)
    needed = exact_memory(n, k, options.loss)
    if needed > limit:
        fix = "use a sketch (features='structured') for a training set this large"
        raise refuse(f"exact features of N={n} examples (k={k})", needed, limit, fix)
    weights = train_weights(model_outputs(model64, x_all, torch.float64), labels, options.loss)
    side = exact_train_side(model64, x_all, weights, options, limit)
    return TrainFeatures(
        loss=options.loss,
        kind=FeatureKind.EXACT,
        seed=options.seed,
        features=side.features,
        loss_weights=side.loss_weights,
        gram=np.diag(side.eigenvalues),
        rows=side.rows,
        exact=side.basis,
        input_shape=example_shape(x),
    )


def target_features(
    model: nn.Module,
    x: Any,
    y: Any | None = None,
    *,
    train: TrainFeatures,
    options: AttributionOptions | None = None,
) -> np.ndarray:
    """Features of test examples in the training side's basis: ∇m(x*) projected, (M, D).

    Args:
        model (nn.Module): the model at the same checkpoint as ``train``.
        x: test inputs (M, *input), of the kinds ``train_feature_chunks`` takes.
        y: test labels: class indices (M,) (cross-entropy; None measures the predicted class) or targets
            (M, *out) (mse, required). Default: None.
        train (TrainFeatures): this checkpoint's training side: its seed, D and kind are used.
        options (AttributionOptions, optional): the options ``train`` was computed with. Default:
            ``AttributionOptions()``.

    Returns:
        ndarray (M, D): float32 or float64 (the compute dtype) for a sketch, float64 for exact features.

    Raises:
        InvalidInput: options whose loss or feature kind differ from ``train``'s; labels of the wrong shape; mse
            without targets.
    """
    opts = AttributionOptions() if options is None else options
    if opts.loss is not train.loss or opts.features is not train.kind:
        raise InvalidInput(
            f"{OPERATION}: test features with loss={opts.loss.value!r}, features={opts.features.value!r} against a "
            f"training side computed with loss={train.loss.value!r}, features={train.kind.value!r}; use the same "
            "options for both"
        )
    dtype = torch.float64 if train.exact is not None else compute_dtype(model, opts)
    model = in_dtype(model, dtype)
    m = size(x)
    shape = example_shape(x)
    if train.input_shape is not None and shape is not None and shape != train.input_shape:
        raise ShapeMismatch(
            f"{OPERATION}: x_test has per-example shape {shape}, the training inputs {train.input_shape}; both must "
            "match"
        )
    out_shape = output_shape(model, x, dtype, "x_test")
    labels = (
        None
        if y is None
        else check_labels(y, n=m, out_shape=out_shape, loss=opts.loss, name="y_test", operation=OPERATION)
    )
    if train.exact is None and train.dim != opts.dim:
        raise ShapeMismatch(
            f"{OPERATION}: the training side has D={train.dim}, options.dim={opts.dim}; use the same dim"
        )
    limit = budget(opts)
    chunk = feature_chunk_rows(m, math.prod(out_shape), opts, torch.finfo(dtype).bits // 8, limit)
    parts = []
    for start in range(0, m, chunk):
        xb = cast(rows(x, start, start + chunk), dtype)
        u = measurement_weights(
            model_outputs(model, xb, dtype), None if labels is None else labels[start : start + chunk], opts.loss
        ).to(dtype)
        if train.exact is not None:
            parts.append(exact_target(model, xb, u, train.exact, opts, limit))
            continue
        phi = ntk_features(
            OutputFunction(model),
            weighted_inputs(xb, u),
            dim=opts.dim,
            seed=train.seed,
            params=engine_params(opts),
            dtype=dtype,
            memory_budget_bytes=limit // 2,
            sketch=opts.features.value,
        )
        parts.append(phi[:, 0].numpy())
    return np.concatenate(parts)
