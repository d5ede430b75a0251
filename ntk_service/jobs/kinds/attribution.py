"""The attribution job: which training examples drove each prediction of a test set, and by how much (TRAK-style,
``ntk_service.attribution``), scored against the training sides that attribution features jobs stored, one per
checkpoint (``kinds/attribution_features.py``). Its folder, ``<results_dir>/attribution/<id>/``, holds
``attribution.zarr``: the top-k proponents and opponents of every test example with their scores, each training
example's total influence on the test set and its self-influence, and, when asked, the dense scores (M, N) float32.

- **plan**: the features jobs must have succeeded and fit together (one training set, loss, feature kind and D;
  checkpoints of one architecture: ``IncompatibleCheckpoint`` otherwise); the test rows must have the training
  inputs' per-example shape and run through the model; test labels are checked like the training labels. The
  scoring's memory is planned and refused up front when it would not fit (NOTE [scoring memory]); the disk its
  arrays take is checked by the manager.
- **run**, every unit a tile: (1) the test features, a chunk of test rows of one checkpoint each
  (``target_features``), written to the store; (2) the scores, a block of training rows against every test row each
  (``score_train_rows``): its tiles written when the dense scores are kept, and merged into the running top-k
  (NOTE [top-k resume]); (3) the total influence and (4) the self-influence, one tile each. The test features are
  removed once every tile is recorded.
- **result**: ``read_answers`` (the small arrays, by test rows) and ``read_scores`` (a block of the dense scores).

NOTE [top-k resume]
    The running top-k (``RunningTop``) is saved after each block of training rows with the ids of the blocks in it
    (``top_state.npz``, a new file renamed over the old: never half written), and the block is recorded only then.
    A resumed run starts from that state: a block in it but not recorded is recorded without scoring it again (its
    dense tiles were written before the state), and the next block merges into the same state, so the answer is
    bitwise the uninterrupted run's. Blocks go in id order: the state always holds a prefix of them.

NOTE [scoring memory]
    While it scores, a job holds the Cholesky factor of F + λI of every checkpoint (Σ_c D_c² float64), the solved
    test features (M · Σ_c D_c float32) and the running top-k, and on top of that the largest of: one factorization
    (two D² float64 temporaries), one solve of the test features (about 28·M·D bytes: the float64 copy, the
    right-hand side and the result), one block of training rows (train_rows · Σ_c D_c float32 and two
    (M, train_rows) float32 tiles: the tile, and the room its merge into the top-k or its write takes, NOTE [merge
    memory] in attribution/answers.py), and one block of the self-influence (4 · 4096 · D float64); plus
    ``ALLOCATOR_SLACK`` (at most the live bytes again) for the small pieces the C allocator keeps once freed. F
    itself stays on disk (memory-mapped) and G' is read block by block. At N = 10⁵, M = 10⁴, D = 2048 and 10
    checkpoints that is 1.2 GB held and blocks of 12,500 training rows, 3.3 GB in all: under a 4 GB budget, where
    the dense scores alone would be 4 GB. ``tests/jobs/test_attribution_kinds.py`` runs the scoring at a smaller
    size in a fresh process and holds the operating system's count of its peak (VmHWM) to the plan.
    ``plan_scoring`` halves the block from N until the estimate fits, and refuses (413) when even the held part
    does not.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, cast

import numpy as np
import zarr
from torch import nn

from ntk_service.attribution import (
    DEFAULT_RIDGE,
    AttributionLoss,
    AttributionOptions,
    Ensemble,
    FeatureKind,
    FittedCheckpoint,
    RunningTop,
    ScoreTile,
    TrainFeatures,
    feature_chunk_rows,
    fit_checkpoint,
    load_checkpoint,
    score_train_rows,
    self_influence_scores,
    solve_targets,
    target_features,
    total_influence_scores,
)
from ntk_service.attribution.rows import budget, compute_dtype, in_dtype, output_shape
from ntk_service.attribution.targets import check_labels
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch, format_bytes
from ntk_service.jobs.kinds.attribution_features import (
    ATTRIBUTION_FEATURES_KIND,
    AttributionFeaturesSpec,
    AttributionFeaturesSummary,
    checkpoint_model,
    input_layout,
    load_labels,
    open_train_side,
    read_inputs,
)
from ntk_service.jobs.kinds.base import JobKind, JobStopped, Layout, PlanContext, RunContext
from ntk_service.jobs.kinds.rows import DataRows, resolve_rows
from ntk_service.jobs.records import JobRecord

__all__ = [
    "ANSWER_ARRAYS",
    "ATTRIBUTION_KIND",
    "AttributionKind",
    "DEFAULT_TOP_K",
    "AttributionProgress",
    "AttributionRequest",
    "AttributionSpec",
    "AttributionSummary",
    "MAX_CHECKPOINTS",
    "ScoringPlan",
    "plan_scoring",
    "read_answers",
    "read_scores",
    "scoring_memory",
]

_OPERATION = "attribution job"
_STORE = "attribution.zarr"
_TOP_STATE = "top_state.npz"

DEFAULT_TOP_K = 10
"""Proponents and opponents kept per test example when a job names no top_k (at most N)."""

MAX_CHECKPOINTS = 64
"""Checkpoints one attribution job ensembles at most (TRAK's ensembles use up to a few dozen)."""

SELF_INFLUENCE_ROWS = 4096
"""Training rows per block of the self-influence (``self_influence_scores``'s default)."""

ALLOCATOR_SLACK = 128 * 2**20
"""Bytes the scoring may hold beyond its live arrays, at most as much again as they: pieces under 32 MiB (Zarr's
decoded chunks, small solves) that the C allocator keeps for reuse once freed, where larger ones go back to the
system (NOTE [scoring memory]; tests/jobs/scoring_peak.py measured 20-130 MiB over the live arrays)."""

TOP_ARRAYS = ("proponents", "proponent_scores", "opponents", "opponent_scores")
"""The top-k answer's arrays, (M, k) each: int64 training indices and their float32 scores."""

ANSWER_ARRAYS = (*TOP_ARRAYS, "total_influence", "self_influence")
"""Every small answer an attribution job may store (the dense ``scores`` are read by block: ``read_scores``)."""


@dataclass(frozen=True, slots=True)
class AttributionRequest:
    """An attribution job as asked for.

    Attributes:
        features: the ids of succeeded attribution features jobs, one per checkpoint of the ensemble.
        test: the test inputs (M examples); None: only the self-influence. test_labels: their labels (class indices
            (M,), or None to measure the predicted class, for cross-entropy; targets (M, *out), required, for mse).
        ridge: λ relative to the mean diagonal of the training kernel. ensemble: "trak" or "mean".
        top_k: proponents and opponents per test example (0: none; None: ``DEFAULT_TOP_K``, at most N).
            store_scores: keep the dense (M, N) scores.
        total_influence: each training example's total influence on the test set. self_influence: each training
            example's self-influence.
        train_rows: training rows per scoring unit (None: the largest that fits the memory budget).
        test_rows_per_chunk: test rows per unit of test features (None: as the training side's chunks).
    """

    features: Sequence[str]
    test: DataRows | None = None
    test_labels: DataRows | None = None
    ridge: float = DEFAULT_RIDGE
    ensemble: str = "trak"
    top_k: int | None = None
    store_scores: bool = False
    total_influence: bool = True
    self_influence: bool = False
    train_rows: int | None = None
    test_rows_per_chunk: int | None = None


@dataclass(frozen=True, slots=True)
class AttributionSpec:
    """What an attribution job computes, resolved at submission.

    Attributes:
        features: the features jobs (one per checkpoint). models, versions: their checkpoints. dims: their D.
        model: the first checkpoint's model. loss, feature_kind: the training sides'. n: training examples.
        train_dataset, train_start: the training inputs (for the examples' view).
        labels_dataset, labels_start: their labels.
        test_dataset, test_start, m: the test rows (None and 0: no test set).
        test_labels_dataset, test_labels_start: their labels (None: the predicted class).
        ridge, ensemble, top_k, store_scores, total_influence, self_influence: what to compute.
        train_rows: training rows per scoring unit. test_chunk: test rows per unit of test features.
        test_dtype: the stored test features' dtype (float64 for exact or float64 features).
        memory_budget_bytes: the budget the plan fits. memory_estimate_bytes: the scoring's planned peak.
    """

    features: tuple[str, ...]
    models: tuple[str, ...]
    versions: tuple[int, ...]
    dims: tuple[int, ...]
    model: str
    loss: str
    feature_kind: str
    n: int
    train_dataset: str
    train_start: int
    labels_dataset: str
    labels_start: int
    test_dataset: str | None
    test_start: int
    m: int
    test_labels_dataset: str | None
    test_labels_start: int
    ridge: float
    ensemble: str
    top_k: int
    store_scores: bool
    total_influence: bool
    self_influence: bool
    train_rows: int
    test_chunk: int
    test_dtype: str
    memory_budget_bytes: int
    memory_estimate_bytes: int

    def __post_init__(self) -> None:
        for name in ("features", "models", "versions", "dims"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def checkpoints(self) -> int:
        return len(self.features)

    @property
    def test_tiles(self) -> int:
        """Units of test features per checkpoint."""
        return 0 if self.m == 0 else math.ceil(self.m / self.test_chunk)

    @property
    def score_blocks(self) -> int:
        """Blocks of training rows scored against the test set (for the top-k and the dense scores)."""
        return math.ceil(self.n / self.train_rows) if self.m and (self.top_k or self.store_scores) else 0

    def tile_ids(self) -> dict[str, list[int]]:
        """The tiles of each stage, in the order they run."""
        first_score = self.checkpoints * self.test_tiles
        after = first_score + self.score_blocks
        total = [after] if self.m and self.total_influence else []
        own = [after + len(total)] if self.self_influence else []
        return {
            "test features": list(range(first_score)),
            "scores": list(range(first_score, after)),
            "total influence": total,
            "self influence": own,
        }

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("features", "models", "versions", "dims"):
            data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttributionSpec:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class AttributionProgress:
    """Where a running attribution job stands: its stage and units, the test rows featurized (over all checkpoints)
    and the training rows scored."""

    stage: str
    units_done: int
    units_total: int
    test_rows_done: int
    test_rows_total: int
    train_rows_scored: int
    train_rows_total: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttributionProgress:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class AttributionSummary:
    """A finished attribution job: its sizes, the answers it stored, and each checkpoint's absolute λ and solve."""

    n_train: int
    n_test: int
    checkpoints: int
    top_k: int
    answers: tuple[str, ...]
    lam: tuple[float, ...]
    methods: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("answers", "lam", "methods"):
            data[name] = list(data[name])
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttributionSummary:
        fields = {name: data[name] for name in cls.__dataclass_fields__}
        return cls(**{**fields, **{name: tuple(fields[name]) for name in ("answers", "lam", "methods")}})


AttributionJob = JobRecord[AttributionSpec, AttributionProgress, AttributionSummary]


class ScoringPlan(NamedTuple):
    """Training rows per scoring unit and the planned peak (NOTE [scoring memory])."""

    train_rows: int
    bytes: int


def _scoring_parts(n_test: int, dims: Sequence[int], *, train_rows: int, top_k: int) -> tuple[int, dict[str, int]]:
    """Bytes held while scoring, and each step's bytes on top of them (NOTE [scoring memory])."""
    widest, total = max(dims), sum(dims)
    held = 8 * sum(d * d for d in dims) + 4 * n_test * total + 4 * 12 * n_test * top_k
    steps = {
        "one factorization of F + λI": 2 * 8 * widest * widest,
        "one solve of the test features": 28 * n_test * widest,
        f"a block of {train_rows} training rows": 4 * train_rows * total + 2 * 4 * n_test * train_rows,
        "a block of the self-influence": 4 * 8 * SELF_INFLUENCE_ROWS * widest,
    }
    return held, steps


def scoring_memory(n_test: int, dims: Sequence[int], *, train_rows: int, top_k: int) -> int:
    """Peak bytes of an attribution job's scoring (NOTE [scoring memory]) with ``train_rows`` per block."""
    held, steps = _scoring_parts(n_test, dims, train_rows=train_rows, top_k=top_k)
    live = held + max(steps.values())
    return live + min(ALLOCATOR_SLACK, live)


def plan_scoring(n_train: int, n_test: int, dims: Sequence[int], *, top_k: int, budget_bytes: int,
                 train_rows: int | None = None) -> ScoringPlan:  # fmt: skip
    """The largest block of training rows (from N, halved) whose scoring fits ``budget_bytes``; ``train_rows``
    when given (checked, not changed).

    Example::

        >>> plan_scoring(100_000, 10_000, [2048] * 10, top_k=10, budget_bytes=4 * 10**9)
        ScoringPlan(train_rows=12500, bytes=3317762048)

    Raises:
        MemoryEstimateExceeded: even the smallest block does not fit (the estimate, its parts and the budget in the
            message).
    """
    rows = max(1, min(n_train, train_rows or n_train))
    while (needed := scoring_memory(n_test, dims, train_rows=rows, top_k=top_k)) > budget_bytes:
        if train_rows is not None or rows == 1:
            held, steps = _scoring_parts(n_test, dims, train_rows=rows, top_k=top_k)
            step = max(steps, key=lambda name: steps[name])
            raise MemoryEstimateExceeded(
                f"{_OPERATION}: scoring M={n_test} test against N={n_train} training examples over {len(dims)} "
                f"checkpoint(s) at D={max(dims)} needs about {format_bytes(needed)} ({format_bytes(held)} held: the "
                f"factors of F + λI and the solved test features; {format_bytes(steps[step])} more for {step}; "
                f"{format_bytes(needed - held - steps[step])} for what the allocator keeps), over "
                f"the memory budget of {format_bytes(budget_bytes)}; score the test set in parts (its rows start / "
                "stop), use fewer checkpoints or a smaller dim" + (", or fewer train_rows" if train_rows else ""),
                estimate_bytes=needed,
                budget_bytes=budget_bytes,
            )
        rows = max(1, rows // 2)
    return ScoringPlan(rows, needed)


def _sides_of(ctx: PlanContext, ids: Sequence[str]) -> list[tuple[AttributionFeaturesSpec, AttributionFeaturesSummary]]:
    sides = []
    for job_id in ids:
        record, _ = ctx.jobs.succeeded(job_id, ATTRIBUTION_FEATURES_KIND)
        sides.append((cast(AttributionFeaturesSpec, record.spec), cast(AttributionFeaturesSummary, record.result)))
    return sides


_SHARED = ("train_dataset", "train_start", "n", "labels_dataset", "labels_start", "loss", "features", "params")
"""What the training sides of one ensemble must share: the training set, its labels, the loss, the feature kind and
the parameters attributed through (and D, for a sketch)."""


def _check_together(ids: Sequence[str], specs: Sequence[AttributionFeaturesSpec], ctx: PlanContext) -> None:
    first = specs[0]
    for job_id, spec in zip(ids[1:], specs[1:], strict=True):
        shared = _SHARED if first.features == FeatureKind.EXACT else (*_SHARED, "dim")
        differ = [f"{name} {getattr(first, name)!r} vs {getattr(spec, name)!r}" for name in shared
                  if getattr(first, name) != getattr(spec, name)]  # fmt: skip
        if differ:
            raise InvalidInput(
                f"{_OPERATION}: features jobs {ids[0]} and {job_id} differ in {', '.join(differ)}; the checkpoints of "
                "one attribution must share the training rows, labels, loss, feature kind, params and dim"
            )
    _, reference = ctx.models.load_module(first.model, first.version)
    for c, spec in enumerate(specs[1:], start=1):
        if (spec.model, spec.version) != (first.model, first.version):
            _, module = ctx.models.load_module(spec.model, spec.version)
            load_checkpoint(reference, module.state_dict(), index=c, operation=_OPERATION)  # IncompatibleCheckpoint


class AttributionKind(JobKind[AttributionRequest, AttributionSpec, AttributionProgress, AttributionSummary]):
    """Attribution jobs (module docstring)."""

    name: ClassVar[str] = "attribution"
    noun: ClassVar[str] = "attribution job"
    operation: ClassVar[str] = _OPERATION
    route: ClassVar[str] = "/v1/attribution-jobs"
    folder: ClassVar[str] = "attribution"

    def layout(self, spec: AttributionSpec) -> Layout:
        item = 8 if spec.test_dtype == "float64" else 4  # the test features
        size = spec.m * sum(spec.dims) * item + spec.m * spec.top_k * 2 * 12 + 8 * spec.n * 2
        if spec.store_scores:
            size += 4 * spec.m * spec.n
        ids = spec.tile_ids()
        return Layout(
            tile_ids=tuple(t for stage in ids.values() for t in stage),
            result_shape=(spec.m, spec.n) if spec.m else (spec.n,),
            estimate_bytes=size,
            what=f"the attribution of M={spec.m} test to N={spec.n} training examples"
            + (" with the dense scores" if spec.store_scores else ""),
            note=" (the test features included: written while it runs, removed at the end)" if spec.m else "",
            fix="keep top_k instead of the dense scores (store_scores=false), score fewer test rows, delete finished "
            "results, or more disk",
        )

    def plan(self, request: AttributionRequest, ctx: PlanContext) -> AttributionSpec:
        """Check and resolve an attribution job.

        Raises:
            JobNotFound (404), JobNotFinished (409): a features job that does not exist or has not succeeded.
            InvalidInput: no or too many checkpoints, features jobs that do not fit together, nothing to compute,
                top_k beyond N, an unknown ensemble, a bad ridge, mse without test labels.
            IncompatibleCheckpoint: checkpoints of different architectures. ShapeMismatch: test inputs of another
                per-example shape than the training inputs, or that the model fails on; test labels of the wrong
                shape. MemoryEstimateExceeded (413): the scoring would not fit the memory budget.
        """
        ids = [str(f) for f in request.features]
        if not 1 <= len(ids) <= MAX_CHECKPOINTS:
            raise InvalidInput(
                f"{_OPERATION}: features must list 1 to {MAX_CHECKPOINTS} attribution features jobs (one per "
                f"checkpoint), got {len(ids)}"
            )
        sides = _sides_of(ctx, ids)
        specs = [spec for spec, _ in sides]
        _check_together(ids, specs, ctx)
        first = specs[0]
        options = AttributionOptions.from_dict({"ridge": request.ridge, "ensemble": request.ensemble})  # checks both
        n, test = first.n, request.test
        asked_k = request.top_k
        if asked_k is None:
            asked_k = min(DEFAULT_TOP_K, n) if test is not None else 0
        if test is None and (asked_k or request.store_scores or request.test_labels is not None):
            raise InvalidInput(
                f"{_OPERATION}: top_k, store_scores and test_labels need a test set; without one only the "
                "self-influence is computed (top_k=0, self_influence=true)"
            )
        if test is None and not request.self_influence:
            raise InvalidInput(f"{_OPERATION}: nothing to compute: give a test set, or ask for self_influence")
        if test is not None and not (asked_k or request.store_scores or request.total_influence
                                     or request.self_influence):  # fmt: skip
            raise InvalidInput(
                f"{_OPERATION}: nothing to compute: ask for top_k > 0, store_scores, total_influence or self_influence"
            )
        if isinstance(asked_k, bool) or not isinstance(asked_k, int) or not 0 <= asked_k <= n:
            raise InvalidInput(f"{_OPERATION}: top_k must be in [0, N={n}], got {asked_k!r}")
        t_lo = t_hi = l_lo = 0
        budget_bytes = budget(AttributionOptions(memory_budget_bytes=ctx.memory_budget()))
        if test is not None:
            t_lo, t_hi = self._check_test(request, first, ctx)
            if request.test_labels is not None:
                l_lo, _ = resolve_rows(ctx.datasets, request.test_labels, "test_labels", operation=_OPERATION)
        m = t_hi - t_lo
        dims = [summary.dim for _, summary in sides]
        top_k = asked_k if m else 0
        wide = first.features == FeatureKind.EXACT or any(s.dtype == "float64" for s in specs)
        test_dtype = "float64" if wide else "float32"
        scoring = plan_scoring(n, m, dims, top_k=top_k, budget_bytes=budget_bytes, train_rows=request.train_rows)
        chunk = request.test_rows_per_chunk or (
            feature_chunk_rows(m, first.k, first.options, 8, budget_bytes) if m else 1
        )
        return AttributionSpec(
            features=tuple(ids), models=tuple(s.model for s in specs), versions=tuple(s.version for s in specs),
            dims=tuple(dims), model=first.model, loss=first.loss, feature_kind=first.features, n=n,
            train_dataset=first.train_dataset, train_start=first.train_start, labels_dataset=first.labels_dataset,
            labels_start=first.labels_start, test_dataset=None if test is None else test.dataset, test_start=t_lo,
            m=m, test_labels_dataset=None if request.test_labels is None else request.test_labels.dataset,
            test_labels_start=l_lo, ridge=options.ridge, ensemble=options.ensemble.value, top_k=top_k,
            store_scores=bool(request.store_scores and m), total_influence=bool(request.total_influence and m),
            self_influence=bool(request.self_influence), train_rows=scoring.train_rows,
            test_chunk=int(min(chunk, m or 1)), test_dtype=test_dtype, memory_budget_bytes=budget_bytes,
            memory_estimate_bytes=scoring.bytes,
        )  # fmt: skip

    def _check_test(
        self, request: AttributionRequest, first: AttributionFeaturesSpec, ctx: PlanContext
    ) -> tuple[int, int]:
        """The test rows, checked against the training inputs' layout, the model, and the test labels."""
        assert request.test is not None
        t_lo, t_hi = resolve_rows(ctx.datasets, request.test, "test", operation=_OPERATION)
        train_layout = input_layout(ctx.datasets.get(first.train_dataset))
        test_layout = input_layout(ctx.datasets.get(request.test.dataset))
        if train_layout != test_layout:
            shown = [(name or "x", list(shape)) for name, shape in test_layout]
            expected = [(name or "x", list(shape)) for name, shape in train_layout]
            raise ShapeMismatch(
                f"{_OPERATION}: the test inputs have per-example shape(s) {shown}, the training inputs {expected}; "
                "attribute test examples of the model's input shape"
            )
        _, module = ctx.models.load_module(first.model, first.version)
        first_row = read_inputs(ctx.datasets, request.test.dataset, t_lo, t_lo + 1)
        dtype = compute_dtype(module, first.options)
        out_shape = output_shape(in_dtype(module, dtype), first_row, dtype, "x_test")  # a copy when cast
        loss = AttributionLoss(first.loss)
        if request.test_labels is None:
            if loss is AttributionLoss.MSE:
                raise InvalidInput(
                    f"{_OPERATION}: loss='mse' measures the test loss, so test_labels (M, *out) targets are required"
                )
            return t_lo, t_hi
        l_lo, l_hi = resolve_rows(ctx.datasets, request.test_labels, "test_labels", operation=_OPERATION)
        if l_hi - l_lo != t_hi - t_lo:
            raise ShapeMismatch(
                f"{_OPERATION}: test_labels rows [{l_lo}, {l_hi}) are {l_hi - l_lo} rows, the test rows [{t_lo}, "
                f"{t_hi}) are {t_hi - t_lo}; send one label per test example"
            )
        labels = load_labels(ctx.datasets, request.test_labels.dataset, l_lo, l_hi, what="test_labels",
                             operation=_OPERATION)  # fmt: skip
        check_labels(labels, n=t_hi - t_lo, out_shape=out_shape, loss=loss, name="test_labels", operation=_OPERATION)
        return t_lo, t_hi

    def create(self, spec: AttributionSpec, folder: Path) -> None:
        _create_store(folder / _STORE, spec)

    def run(self, job: AttributionJob, ctx: RunContext[AttributionProgress]) -> AttributionSummary:
        spec = job.spec
        pending = set(ctx.pending())
        with ExitStack() as reads:
            sides: list[tuple[AttributionFeaturesSpec, TrainFeatures]] = []
            for job_id in spec.features:
                reads.enter_context(ctx.jobs.reading(job_id))  # the features job cannot be deleted meanwhile
                record, folder = ctx.jobs.succeeded(job_id, ATTRIBUTION_FEATURES_KIND)
                sides.append((record.spec, open_train_side(folder, record.spec, ctx.datasets)))
            group = zarr.open_group(str(ctx.folder / _STORE), mode="r+")
            progress = _Progress(spec, ctx, pending)
            progress.show(next((stage for stage, tiles in spec.tile_ids().items() if pending & set(tiles)), "done"))
            self._test_features(spec, ctx, sides, group, pending, progress)
            fitted: list[FittedCheckpoint] | None = None
            if pending - set(spec.tile_ids()["test features"]) or "lam" not in group.attrs:
                fitted = ctx.run_compute(lambda: [fit_checkpoint(train, spec.ridge) for _, train in sides])
                group.attrs.update({"lam": [f.lam for f in fitted], "methods": [f.method for f in fitted]})
            tests = [_array(group, f"test_features_{c}") for c in range(spec.checkpoints)] if spec.m else []
            if fitted is not None:
                self._scores(spec, ctx, fitted, tests, group, pending, progress)
                self._influence(spec, ctx, fitted, tests, group, pending, progress)
            _finish_top(ctx.folder, spec, group)
            for c in range(spec.checkpoints if spec.m else 0):  # every tile is recorded: only resumes needed them
                if f"test_features_{c}" in group:
                    del group[f"test_features_{c}"]
            progress.show("done")
            attrs = group.attrs.asdict()
        wanted = {"top": spec.top_k, "scores": spec.store_scores, "total_influence": spec.total_influence,
                  "self_influence": spec.self_influence}  # fmt: skip
        answers = [name for name, asked in wanted.items() if asked]
        return AttributionSummary(
            n_train=spec.n, n_test=spec.m, checkpoints=spec.checkpoints, top_k=spec.top_k, answers=tuple(answers),
            lam=tuple(float(v) for v in cast(list[float], attrs["lam"])),
            methods=tuple(str(v) for v in cast(list[str], attrs["methods"])),
        )  # fmt: skip

    def _test_features(
        self, spec: AttributionSpec, ctx: RunContext[AttributionProgress],
        sides: Sequence[tuple[AttributionFeaturesSpec, TrainFeatures]], group: zarr.Group, pending: set[int],
        progress: _Progress,
    ) -> None:  # fmt: skip
        ids = [t for t in spec.tile_ids()["test features"] if t in pending]
        if not ids:
            return
        assert spec.test_dataset is not None
        labels = None
        if spec.test_labels_dataset is not None:
            labels = load_labels(ctx.datasets, spec.test_labels_dataset, spec.test_labels_start,
                                 spec.test_labels_start + spec.m, what="test_labels", operation=_OPERATION)  # fmt: skip
        models: dict[int, nn.Module] = {}
        for tile in ids:
            c, t = divmod(tile, spec.test_tiles)
            fspec, train = sides[c]
            options = fspec.options.replace(
                rows_per_chunk=spec.test_chunk, memory_budget_bytes=spec.memory_budget_bytes
            )
            lo, hi = t * spec.test_chunk, min(spec.m, (t + 1) * spec.test_chunk)
            _claim(ctx, tile)
            started = time.perf_counter()
            if c not in models:
                models = {c: checkpoint_model(ctx.models, fspec.model, fspec.version, options)}  # one copy at a time
            x = read_inputs(ctx.datasets, spec.test_dataset, spec.test_start + lo, spec.test_start + hi)
            y = None if labels is None else labels[lo:hi]
            phi = ctx.run_compute(partial(target_features, models[c], x, y, train=train, options=options))
            _array(group, f"test_features_{c}")[lo:hi] = phi
            ctx.done([tile], elapsed_s=time.perf_counter() - started)
            progress.advance("test features", test_rows=hi - lo)

    def _scores(
        self, spec: AttributionSpec, ctx: RunContext[AttributionProgress], fitted: list[FittedCheckpoint],
        tests: list[zarr.Array[Any]], group: zarr.Group, pending: set[int], progress: _Progress,
    ) -> None:  # fmt: skip
        ids = spec.tile_ids()["scores"]
        if not any(t in pending for t in ids):
            return
        ensemble = Ensemble(spec.ensemble)
        running, included = _load_top(ctx.folder, spec)
        solved = ctx.run_compute(lambda: solve_targets(fitted, tests))
        scores = _array(group, "scores") if spec.store_scores else None
        for block, tile in enumerate(ids):
            if tile not in pending:
                continue
            _claim(ctx, tile)
            started = time.perf_counter()
            j0, j1 = block * spec.train_rows, min(spec.n, (block + 1) * spec.train_rows)
            if block not in included:  # NOTE [top-k resume]
                tiles = ctx.run_compute(partial(_score_block, fitted, solved, (j0, j1), ensemble))
                for score_tile in tiles:
                    if scores is not None:
                        rows = slice(score_tile.test_start, score_tile.test_start + score_tile.block.shape[0])
                        scores[rows, j0:j1] = score_tile.block
                    if running is not None:
                        running.add(score_tile)
                included = [*included, block]
                _save_top(ctx.folder, running, included)
            ctx.done([tile], elapsed_s=time.perf_counter() - started)
            progress.advance("scores", train_rows=j1 - j0)

    def _influence(
        self, spec: AttributionSpec, ctx: RunContext[AttributionProgress], fitted: list[FittedCheckpoint],
        tests: list[zarr.Array[Any]], group: zarr.Group, pending: set[int], progress: _Progress,
    ) -> None:  # fmt: skip
        ids = spec.tile_ids()
        for stage, compute in (
            ("total influence", lambda: total_influence_scores(fitted, cast(list[Any], tests), ensemble=spec.ensemble)),
            ("self influence", lambda: self_influence_scores(fitted, ensemble=spec.ensemble)),
        ):
            for tile in ids[stage]:
                if tile not in pending:
                    continue
                _claim(ctx, tile)
                started = time.perf_counter()
                _array(group, stage.replace(" ", "_"))[:] = ctx.run_compute(compute)
                ctx.done([tile], elapsed_s=time.perf_counter() - started)
                progress.advance(stage)


ATTRIBUTION_KIND = AttributionKind()
"""The attribution job kind (its row in ``JOB_KINDS``)."""


class _Progress:
    """Counts a run's units and rows from what is recorded, and reports them after each unit."""

    def __init__(self, spec: AttributionSpec, ctx: RunContext[AttributionProgress], pending: set[int]) -> None:
        self.spec, self.ctx = spec, ctx
        ids = spec.tile_ids()
        self.total = sum(len(stage) for stage in ids.values())
        self.done = self.total - len(pending)
        tests_left = sum(
            min(spec.m, (t % spec.test_tiles + 1) * spec.test_chunk) - (t % spec.test_tiles) * spec.test_chunk
            for t in ids["test features"] if t in pending
        )  # fmt: skip
        self.test_rows = spec.checkpoints * spec.m - tests_left
        blocks_left = [b for b, t in enumerate(ids["scores"]) if t in pending]
        self.train_rows = (spec.n if ids["scores"] else 0) - sum(
            min(spec.n, (b + 1) * spec.train_rows) - b * spec.train_rows for b in blocks_left
        )

    def advance(self, stage: str, *, test_rows: int = 0, train_rows: int = 0) -> None:
        self.done += 1
        self.test_rows += test_rows
        self.train_rows += train_rows
        self.show(stage, checkpoint=True)

    def show(self, stage: str, *, checkpoint: bool = False) -> None:
        progress = AttributionProgress(
            stage=stage, units_done=self.done, units_total=self.total, test_rows_done=self.test_rows,
            test_rows_total=self.spec.checkpoints * self.spec.m, train_rows_scored=self.train_rows,
            train_rows_total=self.spec.n if self.spec.score_blocks else 0,
        )  # fmt: skip
        if checkpoint:
            self.ctx.checkpoint(progress)
        else:
            self.ctx.report(progress)


def _score_block(
    fitted: list[FittedCheckpoint], solved: list[Any], train: tuple[int, int], ensemble: Ensemble
) -> list[ScoreTile]:
    return list(score_train_rows(fitted, solved, train, ensemble=ensemble))


def _claim(ctx: RunContext[AttributionProgress], tile: int) -> None:
    if ctx.should_stop() or not ctx.claim([tile]):
        raise JobStopped  # cancelled, the server stops, or a stop gave this run up: resumed from what is recorded


def _array(group: zarr.Group, name: str) -> zarr.Array[Any]:
    return cast(zarr.Array[Any], group[name])


def _create_store(path: Path, spec: AttributionSpec) -> None:
    group = zarr.open_group(str(path), mode="w", attributes={"spec": spec.to_dict()})
    for c, dim in enumerate(spec.dims if spec.m else ()):
        rows = min(spec.m, spec.test_chunk)
        group.create_array(f"test_features_{c}", shape=(spec.m, dim), chunks=(rows, dim), dtype=spec.test_dtype)
    if spec.store_scores:
        group.create_array(
            "scores", shape=(spec.m, spec.n), chunks=(min(spec.m, 1024), min(spec.n, spec.train_rows, 4096)),
            dtype="float32", dimension_names=("test", "train"),
        )  # fmt: skip
    for name in TOP_ARRAYS if spec.top_k else ():
        dtype = "int64" if name in ("proponents", "opponents") else "float32"
        group.create_array(name, shape=(spec.m, spec.top_k), chunks=(min(spec.m, 4096), spec.top_k), dtype=dtype,
                           dimension_names=("test", "rank"))  # fmt: skip
    for name, wanted in (("total_influence", spec.total_influence), ("self_influence", spec.self_influence)):
        if wanted:
            group.create_array(name, shape=(spec.n,), dtype="float64", dimension_names=("train",))


def _load_top(folder: Path, spec: AttributionSpec) -> tuple[RunningTop | None, list[int]]:
    path = folder / _TOP_STATE
    if not path.exists():
        return (RunningTop(n_test=spec.m, n_train=spec.n, k=spec.top_k) if spec.top_k else None), []
    with np.load(path, allow_pickle=False) as saved:
        arrays = {name: np.array(saved[name]) for name in saved.files}
    blocks = [int(b) for b in arrays.pop("blocks")]
    running = RunningTop.from_arrays(arrays, n_test=spec.m, n_train=spec.n, k=spec.top_k) if spec.top_k else None
    return running, blocks


def _save_top(folder: Path, running: RunningTop | None, blocks: Sequence[int]) -> None:
    partial_path = folder / (_TOP_STATE + ".partial")
    arrays = {} if running is None else running.arrays()
    with partial_path.open("wb") as file:
        np.savez(file, blocks=np.array(blocks, dtype=np.int64), **arrays)  # type: ignore[arg-type]
    os.replace(partial_path, folder / _TOP_STATE)


def _finish_top(folder: Path, spec: AttributionSpec, group: zarr.Group) -> None:
    """The top-k arrays from the last state (idempotent: a run resumed after writing them finds no state)."""
    path = folder / _TOP_STATE
    if not path.exists():
        return
    running, _ = _load_top(folder, spec)
    if running is not None:
        top = running.result()
        for name in TOP_ARRAYS:
            _array(group, name)[:] = getattr(top, name)
    path.unlink()


def _open(folder: Path) -> zarr.Group:
    return zarr.open_group(str(folder / _STORE), mode="r")


def read_answers(folder: Path, spec: AttributionSpec, rows: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """A succeeded attribution job's small answers: the top-k arrays of test rows ``rows`` (M, k) (default: all),
    and the total and self influence (N,), as far as the job computed them."""
    group = _open(folder)
    lo, hi = (0, spec.m) if rows is None else rows
    out = {name: np.asarray(_array(group, name)[lo:hi]) for name in TOP_ARRAYS if spec.top_k}
    for name in ("total_influence", "self_influence"):
        if getattr(spec, name):
            out[name] = np.asarray(_array(group, name)[:])
    return out


def read_scores(folder: Path, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """The dense scores' block ``rows × cols`` of a succeeded job that kept them: (r, c) float32."""
    return np.asarray(_array(_open(folder), "scores")[rows[0] : rows[1], cols[0] : cols[1]])
