"""The kernel job: Θ of whole data sets in tiles, computed in panels by the executor (local or Ray) into a Zarr
result group (``jobs/results.py``), ``<results_dir>/<id>/result.zarr``.

- **plan**: resolve the model version and the data sets' rows, probe ``compute_ntk`` on one example of each side
  (wrong shapes, dtypes, globs and models are a 422 now, not a failed job later), check every token id of named
  arrays against the embeddings' vocabularies, and size the panels by the cost model.
- **run**: the panels holding a tile not done go to the executor; each is claimed and recorded in one transaction
  (NOTE [resume] in manager.py).
- **result**: the stored kernel, read with the symmetry (``open_result``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ntk_service.errors import InvalidInput, NtkServiceError, ShapeMismatch, operation_name
from ntk_service.jobs.executors.base import JobWork, PanelOutcome
from ntk_service.jobs.kinds.base import DatasetSource, JobKind, JobStopped, Layout, PlanContext, RunContext
from ntk_service.jobs.panels import Panel, cost_model_panel_tiles
from ntk_service.jobs.planner import Tile, TilePlan, plan_tiles
from ntk_service.jobs.records import KERNEL, JobRecord, JobSpec, JobStatus
from ntk_service.jobs.results import RESULT_GROUP_NAME, ResultArray, migrate_legacy
from ntk_service.kernels import KernelSpec, NtkOptions, compute_ntk
from ntk_service.kernels.modes import KernelMode, parse_mode
from ntk_service.kernels.options import DTYPES
from ntk_service.kernels.problem.batch import Batch, embedding_feeds
from ntk_service.kernels.problem.outputs import select_output
from ntk_service.kernels.types import NtkImplementation, parse_implementation
from ntk_service.registry import NamedDatasetRecord

__all__ = ["KERNEL_KIND", "DTYPE_SIZES", "KernelKind", "KernelRequest", "plan_of"]

logger = logging.getLogger(__name__)

DTYPE_SIZES = {"float32": 4, "float64": 8}
"""Bytes per stored value of each dtype a job may compute in."""

KernelJob = JobRecord[JobSpec, None, None]


@dataclass(frozen=True, slots=True)
class KernelRequest:
    """What a kernel job is asked to compute, as sent (``JobManager.submit`` takes the same as keywords).

    Attributes:
        model: registered model name. version: its version; None = latest.
        x1_dataset: data set id of x1 (N examples). x2_dataset: of x2 (M examples); None = x1 (symmetric: only
            tiles on and above the diagonal are computed).
        mode, implementation, dtype, params, output: as for ``compute_ntk``. Default: FULL, AUTO, "float32", all,
            None (the model returns a tensor; else the path of the output differentiated, whose size per example is
            k).
        tile_size: examples per tile side (the storage chunk). Default: the service's ``default_tile_size``.
        x1_rows, x2_rows: ``(start, stop)`` rows of the data sets. Default: all rows.
        panel_tiles: tiles per panel side (the work unit, ``jobs/panels.py``). Default: the cost model's.
    """

    model: str
    x1_dataset: str
    version: int | None = None
    x2_dataset: str | None = None
    mode: KernelMode | str = KernelMode.FULL
    implementation: NtkImplementation | str = NtkImplementation.AUTO
    dtype: str = "float32"
    params: Sequence[str] | None = None
    tile_size: int | None = None
    x1_rows: tuple[int, int] | None = None
    x2_rows: tuple[int, int] | None = None
    panel_tiles: int | None = None
    output: str | None = None


def plan_of(spec: JobSpec) -> TilePlan:
    """The job's TilePlan, recomputed from its spec (the same on every host and after every restart)."""
    return plan_tiles(n=spec.n, m=None if spec.is_symmetric else spec.m, tile_size=spec.tile_size, mode=spec.mode)


@dataclass(frozen=True, slots=True)
class _Inputs:
    """A job's data sets as resolved at submission: ids, row ranges (``(start, stop)``) and content hashes."""

    x1_dataset: str
    x2_dataset: str | None
    x1_rows: tuple[int, int]
    x2_rows: tuple[int, int] | None
    x1_sha256: str
    x2_sha256: str | None

    @property
    def n(self) -> int:
        return self.x1_rows[1] - self.x1_rows[0]

    @property
    def m(self) -> int | None:
        return None if self.x2_rows is None else self.x2_rows[1] - self.x2_rows[0]


class KernelKind(JobKind[KernelRequest, JobSpec, None, None]):
    """Batch kernel jobs (module docstring)."""

    name: ClassVar[str] = KERNEL
    noun: ClassVar[str] = "job"
    operation: ClassVar[str] = "jobs"
    route: ClassVar[str] = "/v1/jobs"
    folder: ClassVar[str] = ""
    uses_executor: ClassVar[bool] = True

    def layout(self, spec: JobSpec) -> Layout:
        plan = plan_of(spec)
        return Layout(
            tile_ids=tuple(t.id for t in plan.tiles),
            result_shape=tuple(plan.result_shape(spec.k)),
            estimate_bytes=plan.stored_bytes(spec.k, DTYPE_SIZES[spec.dtype]),
            what="the result",
            note=" (already only the upper triangle)" if plan.symmetric else "",
            fix="use mode 'trace' or 'output_diagonal', fewer examples, delete finished results "
            "(DELETE /v1/jobs/{id}), or more disk",
        )

    # -- plan -------------------------------------------------------------------------------------------------------

    def plan(self, request: KernelRequest, ctx: PlanContext) -> JobSpec:
        """Validate and resolve a kernel job (module docstring).

        Raises:
            ModelNotFound, DatasetNotFound: unknown names (404).
            InvalidInput and its subclasses: bad mode, implementation, dtype, tile size, shapes, parameter globs,
                output path, named arrays that differ between the sides or from the model's inputs (422), token ids
                outside an nn.Embedding's vocabulary in any row (every row is checked, in chunks).
        """
        dtype = request.dtype
        if dtype not in DTYPE_SIZES:
            raise InvalidInput(f"jobs: dtype {dtype!r} is not supported; use 'float32' or 'float64'")
        if request.panel_tiles is not None and request.panel_tiles < 1:
            raise InvalidInput(
                f"jobs: panel_tiles must be ≥ 1, got {request.panel_tiles}; omit it for the cost model's"
            )
        with operation_name("jobs"):  # the values every panel computes with, built once here
            mode = parse_mode(request.mode, operation="jobs")
            kernel = KernelSpec(mode=mode, params=request.params, output=request.output)
            options = NtkOptions(
                implementation=parse_implementation(request.implementation, operation="jobs"),
                dtype=DTYPES[dtype],
                memory_budget_bytes=ctx.memory_budget(),
            )
        record, module = ctx.models.load_module(request.model, request.version)
        inputs = _resolve_inputs(ctx.datasets, request)
        tile_size = ctx.settings.default_tile_size if request.tile_size is None else request.tile_size
        plan = plan_tiles(n=inputs.n, m=inputs.m, tile_size=tile_size, mode=mode)
        example = _probe(ctx.datasets, module, inputs, kernel, options)
        _check_ids(ctx.datasets, module, example, inputs)
        k = int(record.output_dim) if kernel.output_path is None else _selected_size(module, example, kernel)
        panel_tiles = request.panel_tiles
        if panel_tiles is None:
            panel_tiles = cost_model_panel_tiles(
                plan, module, example, k=k, implementation=options.implementation, params=kernel.params,
                dtype=dtype, output=kernel.output, memory_budget_bytes=options.memory_budget_bytes,
                target_s=ctx.settings.panel_seconds, workers=ctx.executor.parallelism(),
            )  # fmt: skip
        return JobSpec(
            model=record.name,
            version=int(record.version),
            weights_sha256=str(record.weights_sha256),
            x1_dataset=inputs.x1_dataset,
            x2_dataset=inputs.x2_dataset,
            x1_sha256=inputs.x1_sha256,
            x2_sha256=inputs.x2_sha256,
            n=plan.n,
            m=plan.m,
            k=k,
            tile_size=plan.tile_size,
            kernel=kernel,
            options=options,
            x1_start=inputs.x1_rows[0],
            x2_start=0 if inputs.x2_rows is None else inputs.x2_rows[0],
            panel_tiles=panel_tiles,
        )

    def create(self, spec: JobSpec, folder: Path) -> None:
        # The array first: a crash before the SQLite row leaves an orphan directory, never a job without its array.
        attributes = {"job_id": folder.name, **spec.result_attributes()}
        ResultArray.create(
            folder / RESULT_GROUP_NAME, plan=plan_of(spec), k=spec.k, dtype=spec.dtype, attributes=attributes
        )

    # -- run --------------------------------------------------------------------------------------------------------

    def run(self, job: KernelJob, ctx: RunContext[None]) -> None:
        spec = job.spec
        plan = plan_of(spec)
        pending = set(ctx.pending())
        work = JobWork(job_id=job.id, spec=spec, plan=plan, result_path=ctx.folder / RESULT_GROUP_NAME)
        panels = [p for p in work.panels() if any(t.id in pending for t in p.tiles)]
        _, module = ctx.models.load_module(spec.model, spec.version)
        x1 = _tensor(ctx.datasets, spec.x1_dataset, spec.x1_start, spec.x1_start + spec.n)
        x2 = None
        if spec.x2_dataset is not None:
            x2 = _tensor(ctx.datasets, spec.x2_dataset, spec.x2_start, spec.x2_start + spec.m)
        callbacks = _Panels(ctx, set(job.implementations))
        ctx.executor.run(work, module, x1, x2, panels, callbacks)
        if ctx.should_stop():
            raise JobStopped
        if not ctx.pending():
            ResultArray.open(work.result_path, plan=plan).update_attributes(
                {"implementation_used": sorted(callbacks.implementations)}
            )

    def recover(self, job: KernelJob, folder: Path, done: Callable[[], set[int]]) -> None:
        # Results of versions before the result group (a bare theta.zarr) become groups in place: nothing is copied,
        # nothing is lost; unfinished jobs then resume into the group.
        if job.result_deleted_at is not None:
            return
        plan = plan_of(job.spec)
        finished = {t.id for t in plan.tiles} if job.status is JobStatus.SUCCEEDED else None
        if migrate_legacy(
            folder,
            plan=plan,
            k=job.spec.k,
            done_tile_ids=finished if finished is not None else done(),
            attributes={"job_id": job.id, **job.spec.result_attributes()},
        ):
            logger.info("jobs: migrated the result of %s to the result group format", job.id)

    # -- result -----------------------------------------------------------------------------------------------------

    def open_result(self, job: KernelJob, folder: Path) -> ResultArray:
        """The succeeded job's stored kernel (``ResultArray``), read with the symmetry."""
        return ResultArray.open(folder / RESULT_GROUP_NAME, plan=plan_of(job.spec))


KERNEL_KIND = KernelKind()
"""The kernel job kind (its row in ``JOB_KINDS``)."""


class _Panels:
    """The PanelCallbacks of one run: a panel is claimed in one transaction and recorded in one (``RunContext``)."""

    def __init__(self, ctx: RunContext[None], implementations: set[str]) -> None:
        self.ctx, self.implementations = ctx, implementations

    def claim(self, panel: Panel) -> tuple[Tile, ...]:
        claimed = set(self.ctx.claim([t.id for t in panel.tiles]))
        return tuple(t for t in panel.tiles if t.id in claimed)

    def done(self, outcome: PanelOutcome) -> None:
        self.ctx.done(outcome.tile_ids, elapsed_s=outcome.elapsed_s)
        names = set(outcome.implementation.split(",")) - {""}
        if not names <= self.implementations:
            self.implementations |= names
            self.ctx.used(sorted(self.implementations))

    def should_stop(self) -> bool:
        return self.ctx.should_stop()


# -- planning -------------------------------------------------------------------------------------------------------


def _rows(rows: tuple[int, int] | None, size: int, side: str) -> tuple[int, int]:
    if rows is None:
        return 0, size
    start, stop = int(rows[0]), int(rows[1])
    if not 0 <= start < stop <= size:
        raise InvalidInput(
            f"jobs: {side} rows ({start}, {stop}) are outside the data set; expected 0 ≤ start < stop ≤ {size}"
        )
    return start, stop


def _resolve_inputs(datasets: DatasetSource, request: KernelRequest) -> _Inputs:
    """Look up the data sets, check that their examples match and resolve the row ranges."""
    ds1 = datasets.get(request.x1_dataset)
    ds2 = None if request.x2_dataset is None else datasets.get(request.x2_dataset)
    if ds2 is not None:
        _check_named_sides(ds1, ds2)
    if ds2 is not None and tuple(ds2.shape[1:]) != tuple(ds1.shape[1:]):
        raise ShapeMismatch(
            f"jobs: x2 data set {request.x2_dataset!r} has examples of shape {tuple(ds2.shape[1:])}, x1 data set "
            f"{request.x1_dataset!r} has {tuple(ds1.shape[1:])}; both sides must match"
        )
    if ds2 is None and request.x2_rows is not None:
        raise InvalidInput("jobs: x2 rows given without an x2 data set; name x2's data set too, or omit x2 rows")
    return _Inputs(
        x1_dataset=request.x1_dataset,
        x2_dataset=request.x2_dataset,
        x1_rows=_rows(request.x1_rows, int(ds1.shape[0]), "x1"),
        x2_rows=None if ds2 is None else _rows(request.x2_rows, int(ds2.shape[0]), "x2"),
        x1_sha256=str(ds1.sha256),
        x2_sha256=None if ds2 is None else str(ds2.sha256),
    )


def _check_named_sides(ds1: Any, ds2: Any) -> None:
    """x1's and x2's data sets hold the same named arrays (or both one array), each with one per-example shape."""
    named1, named2 = isinstance(ds1, NamedDatasetRecord), isinstance(ds2, NamedDatasetRecord)
    if named1 != named2:
        named, single = (ds1, ds2) if named1 else (ds2, ds1)
        raise InvalidInput(
            f"jobs: data set {named.id!r} holds named arrays but {single.id!r} holds one array; give both sides "
            "the same inputs (both named arrays with the same names, or both one array)"
        )
    if not named1:
        return
    s1, s2 = {a.name: tuple(a.shape[1:]) for a in ds1.arrays}, {a.name: tuple(a.shape[1:]) for a in ds2.arrays}
    missing, extra = sorted(s1.keys() - s2.keys()), sorted(s2.keys() - s1.keys())
    if missing or extra:
        raise InvalidInput(
            f"jobs: x2's data set {ds2.id!r} has names that differ from x1's {ds1.id!r}: missing {missing}, extra "
            f"{extra}; upload x2 with exactly x1's names ({sorted(s1)})"
        )
    for name, shape in s1.items():
        if s2[name] != shape:
            raise ShapeMismatch(
                f"jobs: x2[{name!r}] has per-example shape {s2[name]}, x1[{name!r}] has {shape}; both sides must "
                "have the same per-example shapes"
            )


def _tensor(datasets: DatasetSource, dataset_id: str, start: int | None = None, stop: int | None = None) -> Batch:
    rows = datasets.load(dataset_id, start, stop)
    if isinstance(rows, dict):  # named arrays: the model's keyword arguments
        return {name: torch.from_numpy(np.ascontiguousarray(leaf)) for name, leaf in rows.items()}
    return torch.from_numpy(np.ascontiguousarray(rows))


def _probe(
    datasets: DatasetSource, module: nn.Module, inputs: _Inputs, kernel: KernelSpec, options: NtkOptions
) -> Batch:
    """One example per side: finds wrong shapes, dtypes, parameter globs and unsupported models in milliseconds,
    so the client gets a 422 now instead of a failed job later; named arrays are checked leaf by leaf against
    each other and the model by the library (``validate_inputs``, which names the leaf). Returns x1's first
    example (1, *input), a dict of such leaves for named arrays."""
    x1_start = inputs.x1_rows[0]
    x1 = _tensor(datasets, inputs.x1_dataset, x1_start, x1_start + 1)
    x2 = None
    if inputs.x2_rows is not None and kernel.mode.spec.pairs:
        x2 = _tensor(datasets, str(inputs.x2_dataset), inputs.x2_rows[0], inputs.x2_rows[0] + 1)
    try:
        compute_ntk(module, x1, x2, spec=kernel, options=options)
    except NtkServiceError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        # The model's own forward pass fails on these examples (wrong feature count, token ids, ...).
        raise InvalidInput(
            f"jobs: the model fails on the first example of data set {inputs.x1_dataset!r}: {exc}; "
            "check that the data set matches the model's input shape and dtype"
        ) from exc
    return x1


def _check_ids(datasets: DatasetSource, module: nn.Module, example: Batch, inputs: _Inputs) -> None:
    """Every row's token ids inside the vocabulary of the nn.Embedding each named int64 array feeds (found by
    one forward pass on the probe's example), read in chunks through the store's memory map, so a job never
    fails at its last tile for an id its first example did not have."""
    if not isinstance(example, dict):
        return
    with torch.no_grad(), embedding_feeds(module, example) as feeds:
        module(**example)
    sides = [("x1", inputs.x1_dataset, inputs.x1_rows)]
    if inputs.x2_dataset is not None and inputs.x2_rows is not None:
        sides.append(("x2", inputs.x2_dataset, inputs.x2_rows))
    for leaf, (module_name, size) in feeds.tables.items():
        name = leaf[2:-2]  # "['input_ids']" -> "input_ids" (batch.leaves' names)
        for side, dataset_id, (start, stop) in sides:
            bad = datasets.first_out_of_range(dataset_id, name, size, start, stop)
            if bad is not None:
                raise InvalidInput(
                    f"jobs: {side}[{name!r}] (data set {dataset_id!r}) has token id {bad[1]} in row {bad[0]}, "
                    f"outside the vocabulary of nn.Embedding {module_name!r} ({size} ids, 0..{size - 1}); "
                    "upload ids inside the vocabulary"
                )


def _selected_size(module: nn.Module, example: Batch, kernel: KernelSpec) -> int:
    """k of a job with ``output=``: the selected tensor's size per example (the model record's output_dim describes
    what forward returns, not the selection)."""
    with torch.no_grad():
        raw = (
            module(**example)
            if isinstance(example, dict)
            else module(*example)
            if isinstance(example, tuple)
            else module(example)
        )
    return int(select_output(raw, kernel.output_path, "jobs")[0].numel())
