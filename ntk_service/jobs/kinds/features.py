"""The features job: sketched NTK features Φ (N, k, D) of a data set's rows (``jobs/features_job.py``), stored as
``<results_dir>/solve/<id>/features.zarr``.

- **plan**: check D, dtype, sketch and seed, resolve the rows, run the model on the first row (k), size the chunks.
- **run**: each chunk of rows is a tile: claimed, computed under a compute slot (one ``ntk_features`` call),
  written, recorded; a resumed job computes only the chunks it lacks, each with the arguments it had, so its Φ is
  bitwise equal to an uninterrupted run's (NOTE [kind resume] in kinds/base.py).
- **result**: Φ as a read-only zarr array (``open_features``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import zarr

from ntk_service.errors import InvalidInput
from ntk_service.jobs.features_job import (
    FeaturesSpec,
    check_dim,
    compute_chunk,
    create_features,
    default_rows_per_chunk,
    open_features,
)
from ntk_service.jobs.kinds.base import JobKind, JobStopped, Layout, PlanContext, RunContext
from ntk_service.jobs.kinds.rows import DataRows, mapped_rows, probe_model, resolve_rows
from ntk_service.jobs.records import JobRecord
from ntk_service.jobs.solve_job import check_choice
from ntk_service.kernels.sketch.features import DEFAULT_SKETCH, SketchKind

__all__ = [
    "FEATURES_KIND",
    "FEATURES_ZARR",
    "FeaturesJobKind",
    "FeaturesProgress",
    "FeaturesRequest",
    "FeaturesSummary",
    "read_features",
]

_OPERATION = "features job"

FEATURES_ZARR = "features.zarr"
"""Φ's group in the job's folder."""


@dataclass(frozen=True, slots=True)
class FeaturesRequest:
    """A features job as asked for.

    Attributes:
        model, version: the registered model (None: latest). dataset: the rows to sketch.
        dim: D in [1, MAX_FEATURE_DIM]. seed: the sketch (the same seed, D, params and sketch: the same Φ anywhere).
        params: parameter globs. dtype: "float32" or "float64". rows_per_chunk: rows per stored chunk (None: about
            8 MiB). sketch: "structured" or "gaussian" (``SketchKind``). Default: ``DEFAULT_SKETCH``.
    """

    model: str
    dataset: DataRows
    dim: int
    seed: int = 0
    version: int | None = None
    params: Sequence[str] | None = None
    dtype: str = "float32"
    rows_per_chunk: int | None = None
    sketch: SketchKind | str = DEFAULT_SKETCH


@dataclass(frozen=True, slots=True)
class FeaturesProgress:
    """Rows of Φ written so far, of all."""

    rows_done: int
    rows_total: int

    def to_json(self) -> dict[str, Any]:
        return {"rows_done": self.rows_done, "rows_total": self.rows_total}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FeaturesProgress:
        return cls(rows_done=int(data["rows_done"]), rows_total=int(data["rows_total"]))


@dataclass(frozen=True, slots=True)
class FeaturesSummary:
    """A finished features job: Φ's shape (n, k, D), its seed and D."""

    shape: tuple[int, ...]
    seed: int
    dim: int

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "seed": self.seed, "dim": self.dim}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FeaturesSummary:
        return cls(shape=tuple(data["shape"]), seed=int(data["seed"]), dim=int(data["dim"]))


FeaturesJob = JobRecord[FeaturesSpec, FeaturesProgress, FeaturesSummary]


class FeaturesJobKind(JobKind[FeaturesRequest, FeaturesSpec, FeaturesProgress, FeaturesSummary]):
    """Features jobs (module docstring)."""

    name: ClassVar[str] = "features"
    noun: ClassVar[str] = "features job"
    operation: ClassVar[str] = _OPERATION
    route: ClassVar[str] = "/v1/feature-jobs"
    folder: ClassVar[str] = "solve"

    def layout(self, spec: FeaturesSpec) -> Layout:
        itemsize = 8 if spec.dtype == "float64" else 4
        return Layout(
            tile_ids=tuple(range(spec.chunks)),
            result_shape=(spec.n, spec.k, spec.dim),
            estimate_bytes=spec.n * spec.k * spec.dim * itemsize,
            what=f"Φ ({spec.n}, {spec.k}, {spec.dim}) in {spec.dtype}",
            fix="use a smaller dim or fewer rows, delete finished results, or more disk",
        )

    def plan(self, request: FeaturesRequest, ctx: PlanContext) -> FeaturesSpec:
        """Check and resolve a features job.

        Raises:
            InvalidInput: D outside the limits, an unknown dtype or sketch, a bad seed, rows outside the data set,
                a model failing on the first row. ModelNotFound / DatasetNotFound.
        """
        dim = check_dim(request.dim)
        check_choice(request.dtype, ("float32", "float64"), "dtype")
        check_choice(str(request.sketch), tuple(s.value for s in SketchKind), "sketch")
        seed = request.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise InvalidInput(f"{_OPERATION}: seed must be an integer in [0, 2**63), got {seed!r}")
        lo, hi = resolve_rows(ctx.datasets, request.dataset, "dataset", operation=_OPERATION)
        version, k = probe_model(
            ctx.models, ctx.datasets, request.model, request.version, request.dataset.dataset, lo, operation=_OPERATION
        )
        itemsize = 8 if request.dtype == "float64" else 4
        return FeaturesSpec(
            model=request.model,
            version=version,
            dataset=request.dataset.dataset,
            start=lo,
            n=hi - lo,
            k=k,
            dim=dim,
            seed=seed,
            params=None if request.params is None else tuple(request.params),
            dtype=request.dtype,
            rows_per_chunk=int(request.rows_per_chunk or default_rows_per_chunk(k, dim, itemsize)),
            memory_budget_bytes=ctx.settings.memory_budget_bytes,
            sketch=SketchKind(request.sketch),
        )

    def create(self, spec: FeaturesSpec, folder: Path) -> None:
        create_features(spec, folder / FEATURES_ZARR)

    def run(self, job: FeaturesJob, ctx: RunContext[FeaturesProgress]) -> FeaturesSummary:
        spec = job.spec
        path = ctx.folder / FEATURES_ZARR
        pending = ctx.pending()
        fresh = len(pending) == spec.chunks  # nothing recorded: (re)create, e.g. a job of an earlier version
        array = create_features(spec, path) if fresh else open_features(path, writable=True)
        _, module = ctx.models.load_module(spec.model, spec.version)
        rows = mapped_rows(ctx.datasets, spec.dataset, spec.start, spec.n)
        done = spec.n - sum(hi - lo for lo, hi in map(spec.chunk_rows, pending))
        for chunk in pending:
            if ctx.should_stop():
                raise JobStopped
            if not ctx.claim([chunk]):
                continue
            started = time.perf_counter()
            phi = ctx.run_compute(partial(compute_chunk, spec, module, rows, chunk))
            lo, hi = spec.chunk_rows(chunk)
            array[lo:hi] = phi
            ctx.done([chunk], elapsed_s=time.perf_counter() - started)
            done += hi - lo
            progress = FeaturesProgress(rows_done=done, rows_total=spec.n)
            ctx.report(progress)
            ctx.checkpoint(progress)
        return FeaturesSummary(shape=(spec.n, spec.k, spec.dim), seed=spec.seed, dim=spec.dim)


FEATURES_KIND = FeaturesJobKind()
"""The features job kind (its row in ``JOB_KINDS``)."""


def read_features(folder: Path) -> zarr.Array[Any]:
    """A succeeded features job's Φ (n, k, D), read only."""
    return open_features(folder / FEATURES_ZARR)
