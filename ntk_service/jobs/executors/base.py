"""The one small interface every executor implements, and the panel computation they all share.

An executor receives a job's model and data once (``JobWork`` plus the arrays) and the panels still to compute
(``jobs/panels.py``: a band of rows against a run of columns, covering many tiles). For each panel it asks
``PanelCallbacks.claim``, which claims the panel's tiles not yet done in one SQLite transaction and returns them,
computes the panel with one ``compute_ntk`` call, writes those tiles' chunks to the job's Zarr array
(``run_panel``), and hands the ``PanelOutcome`` to ``PanelCallbacks.done``, which records them as done in one
transaction. It checks ``should_stop`` between panels: a cancelled or shutting-down job stops at a panel boundary,
never in the middle of a chunk.

    executor.run(work, model, x1, x2, panels, callbacks)   # blocks until the panels are done or it is told to stop
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from ntk_service.jobs.panels import DIAGONAL_MIN_ROWS, DIAGONAL_SPLIT, Panel, diagonal_blocks, plan_panels
from ntk_service.jobs.planner import Tile, TilePlan
from ntk_service.jobs.records import JobSpec
from ntk_service.jobs.results import ResultArray, mirror_theta
from ntk_service.kernels import NtkOptions, SideCache, compute_ntk, device_memory_budget
from ntk_service.kernels.modes import result_shape
from ntk_service.kernels.problem.batch import Batch

__all__ = [
    "Executor",
    "JobWork",
    "PanelCallbacks",
    "PanelOutcome",
    "compute_panel",
    "default_side_cache_bytes",
    "run_panel",
]

logger = logging.getLogger(__name__)

SIDE_CACHE_BUDGET_FRACTION = 0.25
"""The side cache's share of the memory budget when no size is set (``NTK_JOB_SIDE_CACHE_BYTES``): room for a band's
side and a few runs' beside the engine's own working set."""


def default_side_cache_bytes(memory_budget_bytes: int | None) -> int:
    """The side cache size of a job run: ``SIDE_CACHE_BUDGET_FRACTION`` of its memory budget (of the host's default
    budget when the job has none)."""
    budget = memory_budget_bytes if memory_budget_bytes is not None else device_memory_budget(torch.device("cpu"))
    return int((budget or 0) * SIDE_CACHE_BUDGET_FRACTION)


@dataclass(frozen=True, slots=True)
class JobWork:
    """What every panel of one job needs besides the model and data (small and picklable: shipped to Ray once).

    Attributes:
        job_id: the job id.
        spec: the resolved JobSpec (its ``panel_tiles`` cuts the panels).
        plan: the TilePlan.
        result_path: the Zarr array every panel writes to (a shared filesystem path for a Ray cluster).
        diagonal_split: blocks a symmetric job's diagonal panel is computed in (``diagonal_blocks``; 1: one
            ``x2=None`` call). Default: ``DIAGONAL_SPLIT``.
        diagonal_min_rows: the fewest examples per block of a split diagonal panel. Default:
            ``DIAGONAL_MIN_ROWS``.
    """

    job_id: str
    spec: JobSpec
    plan: TilePlan
    result_path: Path
    diagonal_split: int = DIAGONAL_SPLIT
    diagonal_min_rows: int = DIAGONAL_MIN_ROWS

    def panels(self) -> tuple[Panel, ...]:
        """The job's panels, in computation order (the same on every host and after every restart)."""
        return plan_panels(self.plan, panel_tiles=self.spec.panel_tiles)


@dataclass(frozen=True, slots=True)
class PanelOutcome:
    """A computed panel whose chunks are written: the panel id, the tiles written, compute seconds, the
    implementation that ran, and the worker that computed it (a Ray actor's id; None in-process)."""

    panel_id: int
    tile_ids: tuple[int, ...]
    elapsed_s: float
    implementation: str
    worker: str | None = None


class PanelCallbacks(Protocol):
    """How an executor reports to the job manager (all thread-safe)."""

    def claim(self, panel: Panel) -> tuple[Tile, ...]:
        """Claim the panel's tiles not done yet (one transaction, attempts counted); empty: skip the panel."""
        ...

    def done(self, outcome: PanelOutcome) -> None:
        """Record the tiles of a panel whose chunks are written (one transaction)."""
        ...

    def should_stop(self) -> bool:
        """True once the job is cancelled or the server stops: claim no further panel."""
        ...


def compute_panel(
    model: nn.Module,
    x1: Batch,
    x2: Batch | None,
    work: JobWork,
    panel: Panel,
    *,
    side_cache: SideCache | None = None,
    device: torch.device | str | None = None,
    allow_tf32: bool = False,
    options: NtkOptions | None = None,
) -> tuple[np.ndarray, str]:
    """Compute one panel's block: one ``compute_ntk`` call, or, for a symmetric job's diagonal panel when a side
    cache holds sides, one per block on and above its diagonal (``work.diagonal_split`` blocks, ``DIAGONAL_SPLIT``
    in jobs/panels.py: about half the pairs of one ``x2=None`` call over the band).

    Args:
        model: the job's model.
        x1: (N, *input) the whole x1 data set (a tensor or a numpy array). x2: (M, *input), or None for a symmetric
            job.
        work: the job.
        panel: the panel.
        side_cache: optional cache of per-side intermediates, keyed by the weights, the data set hash and the row
            range: a band's side is built once and reused by every panel of the band (and a symmetric job's band
            is the same side whether it is the rows or the columns).
        device: where the block is computed (the panel's rows are moved there; the result comes back to the host).
            Default: the model's device.
        allow_tf32: as for ``compute_ntk``. Default: False.
        options (NtkOptions, optional): how the block is computed, built once per run by the executor
            (``JobSpec.engine_options``). Default: None, the job's options on ``device`` with ``allow_tf32``.

    Returns:
        (theta, implementation): theta (R, C, k, k) FULL, (R, C) TRACE, (R, C, k) OUTPUT_DIAGONAL, (R, k, k)
        EXAMPLE_DIAGONAL as a numpy array of the job's dtype, R and C the panel's rows and columns; the
        implementation that ran.
    """
    spec = work.spec
    if options is None:
        options = spec.engine_options(device=device, allow_tf32=allow_tf32)
    if panel.is_diagonal and spec.mode.spec.pairs and _caches(side_cache):
        blocks = diagonal_blocks(panel, work.plan.tile_size, split=work.diagonal_split, min_rows=work.diagonal_min_rows)
        if len(blocks) > 1:
            return _diagonal_panel(model, x1, work, panel, blocks, side_cache, options)
    r0, r1 = panel.rows
    c0, c1 = panel.cols
    other = x1 if x2 is None else x2
    other_sha = spec.x1_sha256 if spec.x2_sha256 is None else spec.x2_sha256
    other_start = spec.x1_start if spec.x2_sha256 is None else spec.x2_start
    right = None if panel.is_diagonal else _rows(other, c0, c1)
    result = compute_ntk(
        model,
        _rows(x1, r0, r1),
        right,
        spec=spec.kernel,
        options=options,
        side_cache=side_cache,
        # Keys name data-set rows, not panel rows: two jobs over different row ranges of one data set never collide.
        x1_key=(spec.weights_sha256, spec.x1_sha256, spec.x1_start + r0, spec.x1_start + r1),
        x2_key=None if right is None else (spec.weights_sha256, other_sha, other_start + c0, other_start + c1),
    )
    return result.theta.detach().cpu().numpy(), result.implementation.value


def _caches(side_cache: SideCache | None) -> bool:
    return side_cache is not None and side_cache.max_bytes > 0


def _diagonal_panel(
    model: nn.Module,
    x1: Batch,
    work: JobWork,
    panel: Panel,
    blocks: Sequence[tuple[int, int]],
    side_cache: SideCache | None,
    options: NtkOptions,
) -> tuple[np.ndarray, str]:
    """A symmetric job's diagonal panel as the blocks on and above its diagonal (``diagonal_blocks``): block a
    against itself with ``x2=None``, a < b with both sides from the side cache, mirrored below the diagonal (the
    panel's tiles, i ≤ j and aligned to the blocks, never read those; the copy keeps the panel whole)."""
    spec = work.spec
    start = panel.rows[0]
    size = panel.rows[1] - start
    mode = spec.mode
    theta = np.empty(result_shape(mode, size, size, spec.k), dtype=spec.dtype)
    used: set[str] = set()

    def key(a: tuple[int, int]) -> tuple[str, str, int, int]:
        return (spec.weights_sha256, spec.x1_sha256, spec.x1_start + a[0], spec.x1_start + a[1])

    for ia, a in enumerate(blocks):
        for b in blocks[ia:]:
            result = compute_ntk(
                model,
                _rows(x1, *a),
                None if b == a else _rows(x1, *b),
                spec=spec.kernel,
                options=options,
                side_cache=side_cache,
                x1_key=key(a),
                x2_key=None if b == a else key(b),
            )
            block = result.theta.detach().cpu().numpy()
            rows, cols = slice(a[0] - start, a[1] - start), slice(b[0] - start, b[1] - start)
            theta[rows, cols] = block
            if b != a:
                theta[cols, rows] = mirror_theta(block, mode)  # the panel whole, as one call returns it
            used.add(result.implementation.value)
    return theta, ",".join(sorted(used))


def _rows(x: Batch | np.ndarray | tuple[Any, ...] | dict[str, Any], start: int, stop: int) -> Batch:
    """Rows [start, stop) of every leaf of a data set (a tensor or numpy array, or a tuple / mapping of them) as
    tensors for ``compute_ntk``."""
    if isinstance(x, tuple):
        return tuple(_tensor(leaf[start:stop]) for leaf in x)
    if isinstance(x, dict):
        return {name: _tensor(leaf[start:stop]) for name, leaf in x.items()}
    return _tensor(x[start:stop])


def _tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    # Ray hands workers read-only numpy views of the object store (zero-copy); torch wants writable memory, and the
    # engine never writes its inputs, so the warning torch gives for read-only arrays does not apply.
    if isinstance(x, torch.Tensor):
        return x
    if not x.flags.writeable:
        x = np.array(x)  # one row block's copy, not the data set's
    return torch.from_numpy(x)


def run_panel(
    model: nn.Module,
    x1: Batch,
    x2: Batch | None,
    work: JobWork,
    panel: Panel,
    tiles: Sequence[Tile],
    *,
    array: ResultArray | None = None,
    side_cache: SideCache | None = None,
    device: torch.device | str | None = None,
    allow_tf32: bool = False,
    options: NtkOptions | None = None,
) -> PanelOutcome:
    """Compute one panel and write the chunks of ``tiles`` (those claimed: a resumed panel rewrites none that is
    recorded); returns the outcome to record (the caller records it).

    Args:
        tiles: the panel's tiles to write.
        array: the job's open ResultArray. Default: opened from ``work.result_path`` (what a Ray worker does).
        side_cache, device, allow_tf32, options: as for ``compute_panel``.
    """
    start = time.perf_counter()
    theta, implementation = compute_panel(
        model, x1, x2, work, panel, side_cache=side_cache, device=device, allow_tf32=allow_tf32, options=options
    )
    computed = time.perf_counter()
    if array is None:
        array = ResultArray.open(work.result_path, plan=work.plan)
    mode = work.spec.mode
    array.write_tiles([(tile, panel.block_of(tile, theta, mode)) for tile in tiles])
    written = time.perf_counter()
    # Where a panel's time goes, compute against chunk writes (NTK_LOG_LEVEL=debug shows it).
    logger.debug(
        "jobs: %s panel %d: compute %.3f s, write %.3f s (%d tiles)",
        work.job_id,
        panel.id,
        computed - start,
        written - computed,
        len(tiles),
    )
    return PanelOutcome(
        panel_id=panel.id,
        tile_ids=tuple(t.id for t in tiles),
        elapsed_s=written - start,
        implementation=implementation,
    )


class Executor(ABC):
    """Runs the panels of a job. Implementations: ``LocalExecutor`` (in-process) and ``RayExecutor``."""

    name: str = "executor"

    device: torch.device = torch.device("cpu")
    """Where this executor's panels run (the planner budget of a job is that device's)."""

    @abstractmethod
    def run(
        self,
        work: JobWork,
        model: nn.Module,
        x1: Batch,
        x2: Batch | None,
        panels: Sequence[Panel],
        callbacks: PanelCallbacks,
    ) -> None:
        """Compute ``panels`` (claim, compute, write, report each); return when all are done or told to stop.

        Args:
            work: the job.
            model: its model (never mutated).
            x1: (N, *input) the x1 data set. x2: (M, *input) or None for a symmetric job.
            panels: the panels with tiles still to do, in the order to do them.
            callbacks: claim / done / should_stop.

        Raises:
            NtkServiceError or any exception of a panel's computation: the job fails with its message.
        """

    def memory_budget(self) -> int | None:
        """The per-panel memory budget fixed into a job at submission when none is configured: the default budget
        of ``device`` (None lets each tile plan for the device it gets)."""
        return device_memory_budget(self.device)

    def parallelism(self) -> int:
        """Panels this executor computes at once (the panel planner cuts a job into several per worker)."""
        return 1

    def close(self) -> None:  # noqa: B027 - optional hook, most executors hold nothing
        """Release what the executor holds (threads, a Ray connection)."""
