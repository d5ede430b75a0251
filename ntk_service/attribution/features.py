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
represents it exactly by its eigenvectors (NOTE [exact features]).

NOTE [exact features]: with K = V Λ Vᵀ (modes λ > rcond·λmax kept), training rows get the features V Λ^½ (whose Gram
matrix is Λ: F is diagonal) and a test example with cross-kernel row κ* = ∇m(x*)ᵀ Gᵀ gets κ* V Λ^-½. Then
m*ᵀ(F + λI)⁻¹G'ᵀ = κ*(K + λI)⁻¹ exactly (the push-through identity), so the exact path is TRAK with infinite D and
shares the scoring code with the sketch. Dropped modes are the null space of K, which κ* cannot see (it is a
combination of the rows of G); ridge 0 then gives the pseudo-inverse.

Memory (``train_features_memory``): G' (N·D), the Gram matrix and one chunk's float64 rows (2·D² + rows·D floats), and
one chunk of Φ; exact: about four (N·c)² float64 arrays (the kernel, its copy, the eigenvectors, eigh's workspace).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ntk_service.attribution.checkpoints import AllOutputs, OutputFunction, weighted_inputs
from ntk_service.attribution.options import AttributionLoss, AttributionOptions, FeatureKind
from ntk_service.attribution.targets import check_labels, measurement_weights, train_weights
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch, format_bytes
from ntk_service.kernels.api import compute_ntk
from ntk_service.kernels.planning import default_memory_budget
from ntk_service.kernels.problem.batch import batch_size, is_batch, take
from ntk_service.kernels.sketch.features import ntk_features

__all__ = [
    "MAX_ROWS_PER_CHUNK",
    "ExactBasis",
    "FeatureChunk",
    "TrainFeatures",
    "exact_memory",
    "target_features",
    "train_feature_chunks",
    "train_features",
    "train_features_memory",
]

MAX_ROWS_PER_CHUNK = 4096
"""Training examples per chunk of the feature pass at most: one ``ntk_features`` call amortizes its capture over
the chunk, and a chunk's Φ stays in the tens of MB (4096 · D floats for cross-entropy)."""

_OPERATION = "attribution"


@dataclass(frozen=True)
class ExactBasis:
    """What places test examples in the exact features (NOTE [exact features]).

    Attributes:
        x_train: the training inputs (the cross-kernel's second side). rows: (N, k) float64 output weights of the
            training rows (cross-entropy), or None (mse: all k outputs). kernel_map: (N·c, r) float64, V Λ^-½.
    """

    x_train: Any
    rows: torch.Tensor | None
    kernel_map: np.ndarray


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


def _size(x: Any) -> int:
    if is_batch(x):
        return batch_size(x)
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 1:
        raise InvalidInput(
            f"{_OPERATION}: inputs must be a tensor, a tuple or mapping of tensors, or a sliceable array (N, *input); "
            f"got {type(x).__name__}"
        )
    return int(shape[0])


def _rows(x: Any, start: int, stop: int) -> Any:
    if is_batch(x):
        return take(x, start, stop)
    block = x[start:stop]
    return block if isinstance(block, torch.Tensor) else torch.as_tensor(np.asarray(block))


def _dtype(model: nn.Module, options: AttributionOptions) -> torch.dtype:
    if options.dtype is not None:
        return torch.float64 if options.dtype == "float64" else torch.float32
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model with floating parameters and buffers in ``dtype`` (a copy when they are not already)."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
        return model
    return copy.deepcopy(model).to(dtype)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    if isinstance(x, Mapping):
        return {name: leaf(t) for name, t in x.items()}
    if isinstance(x, tuple | list):
        return tuple(leaf(t) for t in x)
    return leaf(torch.as_tensor(x))


def model_outputs(model: nn.Module, x: Any, dtype: torch.dtype) -> torch.Tensor:
    """The model's outputs on x, flattened per example: (n, k)."""
    xb = _cast(x, dtype)
    with torch.no_grad():
        if isinstance(xb, Mapping):
            out = model(**xb)
        elif isinstance(xb, tuple):
            out = model(*xb)
        else:
            out = model(xb)
    if not isinstance(out, torch.Tensor):
        raise InvalidInput(
            f"{_OPERATION}: the model returns a {type(out).__name__}; attribution needs a tensor (N, *out) of outputs "
            "(wrap the model so that forward returns e.g. the logits)"
        )
    return out.reshape(out.shape[0], -1)


def _example_shape(x: Any) -> tuple[int, ...] | None:
    """The per-example input shape of a single input (None for a tuple or mapping of inputs)."""
    return None if is_batch(x) else tuple(int(s) for s in x.shape[1:])


def _out_shape(model: nn.Module, x: Any, dtype: torch.dtype, name: str) -> tuple[int, ...]:
    """The model's per-example output shape, from one example of x; a model that fails on it is bad input."""
    xb = _cast(_rows(x, 0, 1), dtype)
    try:
        with torch.no_grad():
            out = model(**xb) if isinstance(xb, Mapping) else model(*xb) if isinstance(xb, tuple) else model(xb)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ShapeMismatch(
            f"{_OPERATION}: the model fails on the first example of {name} ({type(exc).__name__}: {first}); pass "
            "inputs of the shape and kind the model takes"
        ) from exc
    if not isinstance(out, torch.Tensor):
        raise InvalidInput(
            f"{_OPERATION}: the model returns a {type(out).__name__}; attribution needs a tensor (N, *out) of outputs "
            "(wrap the model so that forward returns e.g. the logits)"
        )
    return tuple(out.shape[1:])


def _as_matrix(theta: torch.Tensor) -> torch.Tensor:
    """A FULL kernel (N, N, k, k) as the symmetric (N·k, N·k) matrix, row n·k + a."""
    n, k = theta.shape[0], theta.shape[2]
    matrix = theta.permute(0, 2, 1, 3).reshape(n * k, n * k)
    return (matrix + matrix.T) / 2


def _params(options: AttributionOptions) -> list[str] | None:
    return None if options.params is None else [f"model.{g}" for g in options.params]


def _budget(options: AttributionOptions) -> int:
    return default_memory_budget() if options.memory_budget_bytes is None else options.memory_budget_bytes


def train_features_memory(n: int, k: int, dim: int, loss: AttributionLoss, *, chunk: int, itemsize: int = 4) -> int:
    """Bytes of ``train_features`` beside the model: G' (n, D), the Gram matrix and a chunk's float64 product
    operands, and one chunk's Φ (chunk, c, D) (c = 1 for cross-entropy, k for mse); ``ntk_features`` plans its own
    passes inside what is left."""
    c = 1 if loss is AttributionLoss.CROSS_ENTROPY else k
    return n * dim * itemsize + 2 * dim * dim * 8 + chunk * c * dim * (2 * itemsize + 8)


def exact_memory(n: int, k: int, loss: AttributionLoss) -> int:
    """Bytes of the exact path's training side: about four (N·c)² float64 arrays (kernel, copy, eigenvectors, eigh
    workspace); mse's (N, N, k, k) kernel is the same size as its (N·k)² matrix."""
    rows = n * (1 if loss is AttributionLoss.CROSS_ENTROPY else k)
    return 4 * rows * rows * 8


def _chunk_rows(n: int, k: int, options: AttributionOptions, itemsize: int, budget: int) -> int:
    if options.rows_per_chunk is not None:
        return min(n, options.rows_per_chunk)
    c = 1 if options.loss is AttributionLoss.CROSS_ENTROPY else k
    fits = budget // 4 // max(1, c * options.dim * (2 * itemsize + 8))  # a quarter of the budget for Φ and its copy
    return max(1, min(n, MAX_ROWS_PER_CHUNK, int(fits)))


def _refuse(what: str, needed: int, budget: int, fix: str) -> MemoryEstimateExceeded:
    return MemoryEstimateExceeded(
        f"{_OPERATION}: {what} need about {format_bytes(needed)}, over the memory budget of {format_bytes(budget)}; "
        f"{fix}",
        estimate_bytes=needed,
        budget_bytes=budget,
    )


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
        raise InvalidInput(f"{_OPERATION}: features='exact' has no chunked pass; call train_features")
    dtype = _dtype(model, options)
    model = _in_dtype(model, dtype)
    n = _size(x)
    out_shape = _out_shape(model, x, dtype, "x_train")
    k = math.prod(out_shape)
    labels = check_labels(y, n=n, out_shape=out_shape, loss=options.loss, name="y_train", operation=_OPERATION)
    budget = _budget(options)
    item = torch.finfo(dtype).bits // 8
    chunk = _chunk_rows(n, k, options, item, budget)
    needed = train_features_memory(n, k, options.dim, options.loss, chunk=chunk, itemsize=item)
    if needed > budget:
        raise _refuse(f"features of N={n} examples at D={options.dim}", needed, budget, "use a smaller dim")
    for start in range(0, n, chunk):
        yield _sketch_chunk(
            model,
            _rows(x, start, start + chunk),
            labels[start : start + chunk],
            start,
            dtype,
            options,
            seed=options.seed + index,
            budget=budget,
        )


def _sketch_chunk(
    model: nn.Module,
    xb: Any,
    yb: torch.Tensor,
    start: int,
    dtype: torch.dtype,
    options: AttributionOptions,
    *,
    seed: int,
    budget: int,
) -> FeatureChunk:
    xb = _cast(xb, dtype)
    weights = train_weights(model_outputs(model, xb, dtype), yb, options.loss)
    common: dict[str, Any] = {
        "dim": options.dim,
        "seed": seed,
        "params": _params(options),
        "dtype": dtype,
        "memory_budget_bytes": budget // 2,
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
        return _exact_train(model, x, y, opts)
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
        input_shape=_example_shape(x),
    )


def _exact_train(model: nn.Module, x: Any, y: Any, options: AttributionOptions) -> TrainFeatures:
    n = _size(x)
    x_all = _cast(_rows(x, 0, n), torch.float64)
    model64 = _in_dtype(model, torch.float64)
    out_shape = _out_shape(model64, x_all, torch.float64, "x_train")
    k = math.prod(out_shape)
    labels = check_labels(y, n=n, out_shape=out_shape, loss=options.loss, name="y_train", operation=_OPERATION)
    budget = _budget(options)
    needed = exact_memory(n, k, options.loss)
    if needed > budget:
        raise _refuse(
            f"exact features of N={n} examples (k={k})",
            needed,
            budget,
            "use a sketch (features='structured') for a training set this large",
        )
    weights = train_weights(model_outputs(model64, x_all, torch.float64), labels, options.loss)
    common: dict[str, Any] = {"params": _params(options), "dtype": torch.float64, "memory_budget_bytes": budget}
    if weights.rows is not None:
        theta = compute_ntk(OutputFunction(model64), weighted_inputs(x_all, weights.rows), mode="trace", **common).theta
    else:
        theta = compute_ntk(AllOutputs(model64), x_all, mode="full", **common).theta  # (N, N, k, k)
    kernel = (theta + theta.T) / 2 if weights.rows is not None else _as_matrix(theta)
    del theta
    lam, vec = torch.linalg.eigh(kernel)  # torch: its threads sleep while waiting (NOTE in scoring.py)
    del kernel
    tol = lam.shape[0] * torch.finfo(torch.float64).eps * max(float(lam[-1]), 0.0)
    keep = lam > tol
    lam, vec = lam[keep], vec[:, keep]
    rows_features = (vec * lam.sqrt()).numpy()
    if weights.rows is not None:
        g, s = rows_features, weights.loss.numpy()
    else:
        g = np.einsum("na,nar->nr", weights.loss.numpy(), rows_features.reshape(n, k, -1))
        s = np.ones(n)
    return TrainFeatures(
        loss=options.loss,
        kind=FeatureKind.EXACT,
        seed=options.seed,
        features=g,
        loss_weights=s,
        gram=torch.diag(lam).numpy(),
        rows=n * (1 if weights.rows is not None else k),
        exact=ExactBasis(x_train=x_all, rows=weights.rows, kernel_map=(vec / lam.sqrt()).numpy()),
        input_shape=_example_shape(x),
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
            f"{_OPERATION}: test features with loss={opts.loss.value!r}, features={opts.features.value!r} against a "
            f"training side computed with loss={train.loss.value!r}, features={train.kind.value!r}; use the same "
            "options for both"
        )
    dtype = torch.float64 if train.exact is not None else _dtype(model, opts)
    model = _in_dtype(model, dtype)
    m = _size(x)
    shape = _example_shape(x)
    if train.input_shape is not None and shape is not None and shape != train.input_shape:
        raise ShapeMismatch(
            f"{_OPERATION}: x_test has per-example shape {shape}, the training inputs {train.input_shape}; both must "
            "match"
        )
    out_shape = _out_shape(model, x, dtype, "x_test")
    labels = (
        None
        if y is None
        else check_labels(y, n=m, out_shape=out_shape, loss=opts.loss, name="y_test", operation=_OPERATION)
    )
    budget = _budget(opts)
    chunk = _chunk_rows(m, math.prod(out_shape), opts, torch.finfo(dtype).bits // 8, budget)
    parts = []
    for start in range(0, m, chunk):
        xb = _cast(_rows(x, start, start + chunk), dtype)
        u = measurement_weights(
            model_outputs(model, xb, dtype), None if labels is None else labels[start : start + chunk], opts.loss
        ).to(dtype)
        if train.exact is not None:
            cross = _exact_cross(model, xb, u, train.exact, opts, budget)
            parts.append((cross @ torch.from_numpy(train.exact.kernel_map)).numpy())
            continue
        if train.dim != opts.dim:
            raise ShapeMismatch(
                f"{_OPERATION}: the training side has D={train.dim}, options.dim={opts.dim}; use the same dim"
            )
        phi = ntk_features(
            OutputFunction(model),
            weighted_inputs(xb, u),
            dim=opts.dim,
            seed=train.seed,
            params=_params(opts),
            dtype=dtype,
            memory_budget_bytes=budget // 2,
            sketch=opts.features.value,
        )
        parts.append(phi[:, 0].numpy())
    return np.concatenate(parts)


def _exact_cross(
    model: nn.Module, xb: Any, u: torch.Tensor, basis: ExactBasis, options: AttributionOptions, budget: int
) -> torch.Tensor:
    """κ* (m, N·c): the test measurement's kernel against the training rows, float64."""
    common: dict[str, Any] = {"params": _params(options), "dtype": torch.float64, "memory_budget_bytes": budget}
    if basis.rows is not None:
        return compute_ntk(
            OutputFunction(model),
            weighted_inputs(xb, u),
            weighted_inputs(basis.x_train, basis.rows),
            mode="trace",
            **common,
        ).theta
    theta = compute_ntk(AllOutputs(model), xb, basis.x_train, mode="full", **common).theta  # (m, N, k, k)
    return torch.einsum("ma,mnab->mnb", u, theta).reshape(theta.shape[0], -1)
