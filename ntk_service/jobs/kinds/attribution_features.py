"""The attribution features job: the training side of one checkpoint (a model version) for data attribution
(``ntk_service.attribution``), computed once and stored, so that attribution jobs (``kinds/attribution.py``) score
any number of test sets against it. Its folder, ``<results_dir>/attribution/<id>/``, holds ``train.zarr`` (the
group of G' (N, D), the features TRAK scores against, and the loss weights s (N,)) and ``gram.npy`` (F, D × D
float64, the Gram matrix of the Hessian rows); exact features also ``eigenvalues.npy``, ``kernel_map.npy`` and
``rows.npy`` (NOTE [exact features] in attribution/exact.py).

- **plan**: build ``AttributionOptions`` (loss, features, D, seed, params, dtype; the memory budget fixed now),
  resolve the rows of the inputs and the labels, run the model on the first row, check every label
  (``check_labels``: class indices in range, targets of the output's shape), and refuse up front what would not fit
  the memory budget (``train_features_memory`` per chunk, ``exact_memory`` for exact features).
- **run**: each chunk of training rows is a tile: one ``train_feature_chunks`` pass, its rows of G' and s written,
  then the Gram matrix with this chunk added (NOTE [gram resume]), then the tile recorded. Exact features are one
  tile (``train_features``).
- **result**: ``open_train_side`` gives the stored ``TrainFeatures`` (G' read lazily from the store).

NOTE [gram resume]
    F is the sum of the chunks' Gram matrices in chunk order. After each chunk the run writes the sum so far with
    the ids of the chunks in it (``gram_state.npz``, a new file renamed over the old: never half written), and
    records the chunk only then. A resumed run reads that state: a chunk in it but not recorded (the server died in
    between) is recorded without computing it again (its rows were written before the state), and the next chunk
    is added to the same partial sum, so F is bitwise the uninterrupted run's. Chunks go in id order, so the state
    always holds a prefix of them.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import torch
import zarr
from torch import nn

from ntk_service.attribution import (
    DEFAULT_DIM,
    AttributionOptions,
    FeatureChunk,
    FeatureKind,
    TrainFeatures,
    exact_memory,
    feature_chunk_rows,
    load_checkpoint,
    train_feature_chunks,
    train_features,
    train_features_memory,
)
from ntk_service.attribution.exact import ExactBasis
from ntk_service.attribution.rows import budget, compute_dtype, in_dtype, output_shape, refuse
from ntk_service.attribution.targets import check_labels
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.jobs.features_job import RowChunks
from ntk_service.jobs.kinds.base import DatasetSource, JobKind, JobStopped, Layout, ModelSource, PlanContext, RunContext
from ntk_service.jobs.kinds.features import FeaturesProgress
from ntk_service.jobs.kinds.rows import DataRows, resolve_rows
from ntk_service.jobs.records import JobRecord
from ntk_service.registry import NamedDatasetRecord

__all__ = [
    "ATTRIBUTION_FEATURES_KIND",
    "AttributionFeaturesKind",
    "AttributionFeaturesRequest",
    "AttributionFeaturesSpec",
    "AttributionFeaturesSummary",
    "checkpoint_model",
    "example_shape_of",
    "load_labels",
    "open_train_side",
    "read_inputs",
]

_OPERATION = "attribution features job"
_TRAIN = "train.zarr"
_GRAM = "gram.npy"
_STATE = "gram_state.npz"
_SUMMARY = "summary.json"

_OPTION_FIELDS = ("loss", "features", "dim", "seed", "params", "dtype", "memory_budget_bytes", "rows_per_chunk")
"""The ``AttributionOptions`` fields of the training side (the ridge and the ensemble are the scoring job's)."""


@dataclass(frozen=True, slots=True)
class AttributionFeaturesRequest:
    """An attribution features job as asked for.

    Attributes:
        model, version: the registered model and the checkpoint (None: the latest version).
        train: the training inputs (N examples). labels: their labels, aligned with ``train``: class indices (N,)
            for cross-entropy, targets (N, *out) for mse.
        loss, features, dim, seed, params, dtype: as ``AttributionOptions`` (the sketch of this checkpoint uses
            ``seed``: give each checkpoint of an ensemble its own). rows_per_chunk: training rows per tile (None:
            as many as a quarter of the memory budget holds, at most 4096).
    """

    model: str
    train: DataRows
    labels: DataRows
    version: int | None = None
    loss: str = "cross_entropy"
    features: str = "structured"
    dim: int = DEFAULT_DIM
    seed: int = 0
    params: Sequence[str] | None = None
    dtype: str | None = None
    rows_per_chunk: int | None = None


@dataclass(frozen=True, slots=True)
class AttributionFeaturesSpec(RowChunks):
    """What an attribution features job computes, resolved at submission.

    Attributes:
        model, version, weights_sha256: the checkpoint (a model version and the hash of its weights).
        train_dataset, train_start, n: the training inputs, rows ``[train_start, train_start + n)``.
        labels_dataset, labels_start: their labels, the same number of rows.
        k: outputs per example. example_shape: one training input's shape (a single array), or None (named arrays).
        loss, features, dim, seed, params, dtype, memory_budget_bytes, rows_per_chunk: ``AttributionOptions``
            fields (``options``); rows_per_chunk is each tile's rows (all N for exact features).
    """

    model: str
    version: int
    weights_sha256: str
    train_dataset: str
    train_start: int
    n: int
    labels_dataset: str
    labels_start: int
    k: int
    example_shape: tuple[int, ...] | None
    loss: str
    features: str
    dim: int
    seed: int
    params: tuple[str, ...] | None
    dtype: str | None
    memory_budget_bytes: int | None
    rows_per_chunk: int

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "params", None if self.params is None else tuple(self.params))
        set_field(self, "example_shape", None if self.example_shape is None else tuple(self.example_shape))

    @property
    def options(self) -> AttributionOptions:
        """The training side's options (the default ridge and ensemble: the scoring job sets those)."""
        return AttributionOptions(**{name: getattr(self, name) for name in _OPTION_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["params"] = None if self.params is None else list(self.params)
        data["example_shape"] = None if self.example_shape is None else list(self.example_shape)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttributionFeaturesSpec:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class AttributionFeaturesSummary:
    """A finished features job: G' (n, dim), the Hessian rows (for the relative ridge) and tr F."""

    n: int
    dim: int
    rows: int
    gram_trace: float

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "dim": self.dim, "rows": self.rows, "gram_trace": self.gram_trace}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttributionFeaturesSummary:
        return cls(n=int(data["n"]), dim=int(data["dim"]), rows=int(data["rows"]), gram_trace=float(data["gram_trace"]))


FeaturesJob = JobRecord[AttributionFeaturesSpec, FeaturesProgress, AttributionFeaturesSummary]


def example_shape_of(record: Any) -> tuple[int, ...] | None:
    """One example's shape of a single-array data set; None for named arrays (checked by name, ``input_layout``)."""
    return None if isinstance(record, NamedDatasetRecord) else tuple(int(s) for s in record.shape[1:])


def input_layout(record: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Each input's name and one example's shape ("" for a single array): test inputs must have the training's."""
    if isinstance(record, NamedDatasetRecord):
        return [(a.name, tuple(int(s) for s in a.shape[1:])) for a in record.arrays]
    return [("", tuple(int(s) for s in record.shape[1:]))]


def read_inputs(datasets: DatasetSource, dataset: str, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` of a data set as the model takes them: a tensor, or a dict of tensors (named arrays)."""
    rows = datasets.load(dataset, lo, hi)
    if isinstance(rows, dict):
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in rows.items()}
    return torch.from_numpy(np.ascontiguousarray(rows))


def load_labels(datasets: DatasetSource, dataset: str, lo: int, hi: int, *, what: str, operation: str) -> np.ndarray:
    """Label rows ``[lo, hi)``: one array (a data set of named arrays is refused).

    Raises:
        InvalidInput: a data set of named arrays.
    """
    rows = datasets.load(dataset, lo, hi)
    if isinstance(rows, dict):
        raise InvalidInput(
            f"{operation}: {what} {dataset!r} holds named arrays {list(rows)}; upload the labels as one array: class "
            "indices (N,) int64 for cross_entropy, targets (N, *out) for mse"
        )
    return rows


def checkpoint_model(models: ModelSource, model: str, version: int, options: AttributionOptions) -> nn.Module:
    """A private eval-mode copy of a model version in the options' compute dtype (the registry's module is shared
    and never changed)."""
    _, module = models.load_module(model, version)
    private = load_checkpoint(module, None, index=0, operation=_OPERATION)
    return in_dtype(private, compute_dtype(private, options))


class AttributionFeaturesKind(
    JobKind[AttributionFeaturesRequest, AttributionFeaturesSpec, FeaturesProgress, AttributionFeaturesSummary]
):
    """Attribution features jobs (module docstring)."""

    name: ClassVar[str] = "attribution-features"
    noun: ClassVar[str] = "attribution features job"
    operation: ClassVar[str] = _OPERATION
    route: ClassVar[str] = "/v1/attribution-features"
    folder: ClassVar[str] = "attribution"

    def layout(self, spec: AttributionFeaturesSpec) -> Layout:
        item = 8 if spec.features == FeatureKind.EXACT or spec.dtype == "float64" else 4
        if spec.features == FeatureKind.EXACT:  # rank r ≤ N·c features, and the (N·c, r) map to place test examples
            rows = spec.n * (1 if spec.loss == "cross_entropy" else spec.k)
            size, what = spec.n * rows * 8 + rows * rows * 8 + spec.n * spec.k * 8, f"exact features of N={spec.n}"
        else:
            size, what = spec.n * spec.dim * item + spec.dim * spec.dim * 8, f"G' ({spec.n}, {spec.dim}) and F"
        return Layout(
            tile_ids=tuple(range(spec.chunks)),
            result_shape=(spec.n, spec.dim),
            estimate_bytes=size + spec.n * 8,
            what=what,
            fix="use a smaller dim or fewer rows, delete finished results, or more disk",
        )

    def plan(self, request: AttributionFeaturesRequest, ctx: PlanContext) -> AttributionFeaturesSpec:
        """Check and resolve an attribution features job.

        Raises:
            InvalidInput: options ``AttributionOptions`` refuses (dim beyond [1, 65536], an unknown loss or
                features), rows outside a data set, labels of named arrays, out of range or of the wrong kind.
            ShapeMismatch: labels that are not one per training row, or not of the loss's shape; a model failing on
                the first row. MemoryEstimateExceeded (413): a chunk (or the exact kernel) over the memory budget.
            ModelNotFound / DatasetNotFound (404).
        """
        options = AttributionOptions.from_dict(
            {
                "loss": request.loss, "features": request.features, "dim": request.dim, "seed": request.seed,
                "params": None if request.params is None else tuple(request.params), "dtype": request.dtype,
                "memory_budget_bytes": ctx.memory_budget(), "rows_per_chunk": request.rows_per_chunk,
            }
        )  # fmt: skip
        x_lo, x_hi = resolve_rows(ctx.datasets, request.train, "train", operation=_OPERATION)
        y_lo, y_hi = resolve_rows(ctx.datasets, request.labels, "labels", operation=_OPERATION)
        n = x_hi - x_lo
        if y_hi - y_lo != n:
            raise ShapeMismatch(
                f"{_OPERATION}: labels rows [{y_lo}, {y_hi}) are {y_hi - y_lo} rows, the train rows [{x_lo}, {x_hi}) "
                f"are {n}; send one label per training example"
            )
        record, module = ctx.models.load_module(request.model, request.version)
        dtype = compute_dtype(module, options)
        if options.dtype is None:  # fixed now: the store's dtype, and the same on every resumed chunk
            options = options.replace(dtype="float64" if dtype == torch.float64 else "float32")
            dtype = compute_dtype(module, options)
        first = read_inputs(ctx.datasets, request.train.dataset, x_lo, x_lo + 1)
        out_shape = output_shape(in_dtype(module, dtype), first, dtype, "x_train")  # a copy when cast: never changed
        k = math.prod(out_shape)
        labels = load_labels(ctx.datasets, request.labels.dataset, y_lo, y_hi, what="labels", operation=_OPERATION)
        check_labels(labels, n=n, out_shape=out_shape, loss=options.loss, name="labels", operation=_OPERATION)
        limit = budget(options)
        if options.features is FeatureKind.EXACT:
            needed = exact_memory(n, k, options.loss)
            if needed > limit:
                raise refuse(f"exact features of N={n} examples (k={k})", needed, limit, "use features='structured'")
            chunk = n
        else:
            item = torch.finfo(dtype).bits // 8
            chunk = feature_chunk_rows(n, k, options, item, limit)
            needed = train_features_memory(chunk, k, options.dim, options.loss, chunk=chunk, itemsize=item)
            if needed > limit:
                raise refuse(f"features of a chunk of {chunk} examples at D={options.dim}", needed, limit,
                             "use a smaller dim (or rows_per_chunk)")  # fmt: skip
        return AttributionFeaturesSpec(
            model=request.model, version=int(record.version), weights_sha256=str(record.weights_sha256),
            train_dataset=request.train.dataset, train_start=x_lo, n=n, labels_dataset=request.labels.dataset,
            labels_start=y_lo, k=k, example_shape=example_shape_of(ctx.datasets.get(request.train.dataset)),
            loss=options.loss.value, features=options.features.value, dim=options.dim, seed=options.seed,
            params=options.params, dtype=options.dtype, memory_budget_bytes=options.memory_budget_bytes,
            rows_per_chunk=chunk,
        )  # fmt: skip

    def create(self, spec: AttributionFeaturesSpec, folder: Path) -> None:
        if spec.features != FeatureKind.EXACT:
            _create_train_store(folder / _TRAIN, spec, spec.dim, spec.dtype or "float32")

    def run(self, job: FeaturesJob, ctx: RunContext[FeaturesProgress]) -> AttributionFeaturesSummary:
        spec = job.spec
        if spec.features == FeatureKind.EXACT:
            return self._run_exact(spec, ctx)
        options = spec.options
        pending = ctx.pending()
        state = _load_state(ctx.folder)
        if len(pending) == spec.chunks and state is None:  # nothing recorded: (re)create the store
            _create_train_store(ctx.folder / _TRAIN, spec, spec.dim, spec.dtype or "float32")
        group = zarr.open_group(str(ctx.folder / _TRAIN), mode="r+")
        gram, included = state if state is not None else (None, [])
        model: nn.Module | None = None
        labels = load_labels(ctx.datasets, spec.labels_dataset, spec.labels_start, spec.labels_start + spec.n,
                             what="labels", operation=_OPERATION)  # fmt: skip
        done = spec.n - sum(hi - lo for lo, hi in map(spec.chunk_rows, pending))
        for chunk in pending:
            if ctx.should_stop():
                raise JobStopped
            if not ctx.claim([chunk]):
                raise JobStopped  # given up by a stop: the sum must stay a prefix of the chunks
            started = time.perf_counter()
            lo, hi = spec.chunk_rows(chunk)
            if chunk not in included:  # NOTE [gram resume]
                if model is None:
                    model = checkpoint_model(ctx.models, spec.model, spec.version, options)
                x = read_inputs(ctx.datasets, spec.train_dataset, spec.train_start + lo, spec.train_start + hi)
                part = ctx.run_compute(
                    partial(_chunk, model, x, labels[lo:hi], options.replace(rows_per_chunk=hi - lo))
                )
                _array(group, "features")[lo:hi] = part.features
                _array(group, "loss_weights")[lo:hi] = part.loss_weights
                gram = part.gram.copy() if gram is None else gram + part.gram
                included = [*included, chunk]
                _save_state(ctx.folder, gram, included, rows=_rows(spec, included))
            ctx.done([chunk], elapsed_s=time.perf_counter() - started)
            done += hi - lo
            progress = FeaturesProgress(rows_done=done, rows_total=spec.n)
            ctx.report(progress)
            ctx.checkpoint(progress)
        return _finish(ctx.folder, spec)

    def _run_exact(
        self, spec: AttributionFeaturesSpec, ctx: RunContext[FeaturesProgress]
    ) -> AttributionFeaturesSummary:
        if not ctx.claim([0]):  # written and recorded before a restart
            return _finish(ctx.folder, spec)
        started = time.perf_counter()
        options = spec.options
        model = checkpoint_model(ctx.models, spec.model, spec.version, options)
        x = read_inputs(ctx.datasets, spec.train_dataset, spec.train_start, spec.train_start + spec.n)
        labels = load_labels(ctx.datasets, spec.labels_dataset, spec.labels_start, spec.labels_start + spec.n,
                             what="labels", operation=_OPERATION)  # fmt: skip
        side = ctx.run_compute(lambda: train_features(model, x, labels, options=options))
        assert side.exact is not None  # features="exact" gives the exact basis
        group = _create_train_store(ctx.folder / _TRAIN, spec, side.dim, "float64")
        _array(group, "features")[:] = side.features
        _array(group, "loss_weights")[:] = side.loss_weights
        np.save(ctx.folder / "eigenvalues.npy", np.diag(side.gram))
        np.save(ctx.folder / "kernel_map.npy", side.exact.kernel_map)
        if side.exact.rows is not None:
            np.save(ctx.folder / "rows.npy", side.exact.rows.numpy())
        _save_state(ctx.folder, np.diag(side.gram), [0], rows=side.rows)  # the eigenvalues: F is diagonal
        ctx.done([0], elapsed_s=time.perf_counter() - started)
        ctx.report(FeaturesProgress(rows_done=spec.n, rows_total=spec.n))
        return _finish(ctx.folder, spec)


ATTRIBUTION_FEATURES_KIND = AttributionFeaturesKind()
"""The attribution features job kind (its row in ``JOB_KINDS``)."""


def open_train_side(folder: Path, spec: AttributionFeaturesSpec, datasets: DatasetSource) -> TrainFeatures:
    """A succeeded features job's training side: G' and s read from the store as they are sliced, F through a
    memory map (for exact features, the basis that places test examples, with the training inputs read now).

    The caller holds a read of the job (``JobLookup.reading``) while it uses the result, so it is not deleted.
    """
    group = zarr.open_group(str(folder / _TRAIN), mode="r")
    summary = AttributionFeaturesSummary.from_json(json.loads((folder / _SUMMARY).read_text()))
    options = spec.options
    exact = None
    if spec.features == FeatureKind.EXACT:
        x = read_inputs(datasets, spec.train_dataset, spec.train_start, spec.train_start + spec.n)
        rows_path = folder / "rows.npy"
        exact = ExactBasis(
            x_train=_cast64(x),
            rows=torch.from_numpy(np.load(rows_path)) if rows_path.exists() else None,
            kernel_map=np.load(folder / "kernel_map.npy"),
        )
        gram: Any = np.diag(np.load(folder / "eigenvalues.npy"))
    else:
        gram = np.load(folder / _GRAM, mmap_mode="r")
    return TrainFeatures(
        loss=options.loss,
        kind=options.features,
        seed=spec.seed,
        features=_array(group, "features"),
        loss_weights=np.asarray(_array(group, "loss_weights")[:]),
        gram=gram,
        rows=summary.rows,
        exact=exact,
        input_shape=spec.example_shape,
    )


def _cast64(x: Any) -> Any:
    if isinstance(x, dict):
        return {name: t.to(torch.float64) if t.is_floating_point() else t for name, t in x.items()}
    return x.to(torch.float64) if x.is_floating_point() else x


def _chunk(model: nn.Module, x: Any, labels: np.ndarray, options: AttributionOptions) -> FeatureChunk:
    """One tile of the feature pass: the whole of ``train_feature_chunks`` over its rows (one chunk)."""
    return next(train_feature_chunks(model, x, labels, options=options))


def _array(group: zarr.Group, name: str) -> zarr.Array[Any]:
    return cast(zarr.Array[Any], group[name])


def _rows(spec: AttributionFeaturesSpec, chunks: Sequence[int]) -> int:
    per = 1 if spec.loss == "cross_entropy" else spec.k
    return sum(hi - lo for lo, hi in map(spec.chunk_rows, chunks)) * per


def _create_train_store(path: Path, spec: AttributionFeaturesSpec, dim: int, dtype: str) -> zarr.Group:
    group = zarr.open_group(str(path), mode="w", attributes={"spec": spec.to_dict()})
    chunk = min(spec.n, spec.rows_per_chunk)
    group.create_array(
        "features", shape=(spec.n, dim), chunks=(chunk, dim), dtype=dtype, dimension_names=("example", "feature")
    )
    group.create_array("loss_weights", shape=(spec.n,), chunks=(chunk,), dtype="float64", dimension_names=("example",))
    return group


def _save_state(folder: Path, gram: np.ndarray, chunks: Sequence[int], *, rows: int) -> None:
    partial = folder / (_STATE + ".partial")
    with partial.open("wb") as file:
        np.savez(file, gram=gram, chunks=np.array(chunks, dtype=np.int64), rows=np.int64(rows))
    os.replace(partial, folder / _STATE)


def _load_state(folder: Path) -> tuple[np.ndarray, list[int]] | None:
    path = folder / _STATE
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as saved:
        return np.array(saved["gram"]), [int(c) for c in saved["chunks"]]


def _finish(folder: Path, spec: AttributionFeaturesSpec) -> AttributionFeaturesSummary:
    """F and the summary from the last state (idempotent: a run resumed after it wrote them reads them back)."""
    state = folder / _STATE
    if state.exists():
        with np.load(state, allow_pickle=False) as saved:
            gram, rows = np.array(saved["gram"]), int(saved["rows"])
        exact = spec.features == FeatureKind.EXACT
        dim = int(gram.shape[0])
        summary = AttributionFeaturesSummary(
            n=spec.n, dim=dim, rows=rows, gram_trace=float(gram.sum() if exact else np.trace(gram))
        )
        if not exact:
            partial = folder / (_GRAM + ".partial.npy")
            np.save(partial, gram)
            os.replace(partial, folder / _GRAM)
        (folder / (_SUMMARY + ".partial")).write_text(json.dumps(summary.to_json()))
        os.replace(folder / (_SUMMARY + ".partial"), folder / _SUMMARY)
        state.unlink()
        return summary
    return AttributionFeaturesSummary.from_json(json.loads((folder / _SUMMARY).read_text()))
