"""The one small interface every executor implements, and the tile computation they all share.

An executor receives a job's model and data once (``JobWork`` plus the arrays) and the tiles still to compute.
For each tile it asks ``TileCallbacks.claim`` (which counts the attempt in SQLite), computes the block with
``compute_ntk``, writes it to the job's Zarr array (``run_tile``), and hands the ``TileOutcome`` to
``TileCallbacks.done``, which records the tile as done. It checks ``should_stop`` between tiles: a cancelled or
shutting-down job stops at a tile boundary, never in the middle of a chunk.

    executor.run(work, model, x1, x2, tiles, callbacks)   # blocks until the tiles are done or it is told to stop
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn

from ntk_service.jobs.planner import Tile, TilePlan
from ntk_service.jobs.records import JobSpec
from ntk_service.jobs.results import ResultArray
from ntk_service.kernels import SideCache, compute_ntk, device_memory_budget
from ntk_service.kernels.inputs import Batch, take

__all__ = ["Executor", "JobWork", "TileCallbacks", "TileOutcome", "compute_tile", "run_tile"]


@dataclass(frozen=True, slots=True)
class JobWork:
    """What every tile of one job needs besides the model and data (small and picklable: shipped to Ray once).

    Attributes:
        job_id: the job id (also names the side-cache keys).
        spec: the resolved JobSpec.
        plan: the TilePlan.
        result_path: the Zarr array every tile writes to (a shared filesystem path for a Ray cluster).
    """

    job_id: str
    spec: JobSpec
    plan: TilePlan
    result_path: Path


@dataclass(frozen=True, slots=True)
class TileOutcome:
    """A computed and written tile: its id, compute seconds, and the implementation that ran."""

    tile_id: int
    elapsed_s: float
    implementation: str


class TileCallbacks(Protocol):
    """How an executor reports to the job manager (all thread-safe)."""

    def claim(self, tile: Tile) -> bool:
        """Count an attempt at ``tile``; False means it is already done: skip it."""
        ...

    def done(self, outcome: TileOutcome) -> None:
        """Record a tile whose chunk is written."""
        ...

    def should_stop(self) -> bool:
        """True once the job is cancelled or the server stops: claim no further tile."""
        ...


def compute_tile(
    model: nn.Module,
    x1: Batch,
    x2: Batch | None,
    work: JobWork,
    tile: Tile,
    *,
    side_cache: SideCache | None = None,
    device: torch.device | str | None = None,
    allow_tf32: bool = False,
) -> tuple[np.ndarray, str]:
    """Compute one tile's block with ``compute_ntk``.

    Args:
        model: the job's model.
        x1: (N, *input) the whole x1 data set. x2: (M, *input), or None for a symmetric job.
        work: the job.
        tile: the tile.
        side_cache: optional cache of per-side intermediates, keyed by the data set hash and the row range (a
            row block of a symmetric job is the same side whether it appears as rows or columns).
        device: where the block is computed (the tile's rows are moved there; the result comes back to the host).
            Default: the model's device.
        allow_tf32: as for ``compute_ntk``. Default: False.

    Returns:
        (theta, implementation): theta (R, C, k, k) FULL, (R, C) TRACE, (R, C, k) OUTPUT_DIAGONAL, (R, k, k)
        EXAMPLE_DIAGONAL as a numpy array of the job's dtype; the implementation that ran.
    """
    spec = work.spec
    r0, r1 = tile.rows
    c0, c1 = tile.cols
    other = x1 if x2 is None else x2
    other_sha = spec.x1_sha256 if spec.x2_sha256 is None else spec.x2_sha256
    other_start = spec.x1_start if spec.x2_sha256 is None else spec.x2_start
    right = None if tile.is_diagonal else take(other, c0, c1)
    result = compute_ntk(
        model,
        take(x1, r0, r1),
        right,
        mode=spec.mode,
        output=spec.output,
        implementation=spec.implementation,
        params=spec.params,
        dtype=spec.dtype,
        memory_budget_bytes=spec.memory_budget_bytes,
        side_cache=side_cache,
        device=device,
        allow_tf32=allow_tf32,
        # Keys name data-set rows, not tile rows: two jobs over different row ranges of one data set never collide.
        x1_key=(spec.weights_sha256, spec.x1_sha256, spec.x1_start + r0, spec.x1_start + r1),
        x2_key=None if right is None else (spec.weights_sha256, other_sha, other_start + c0, other_start + c1),
    )
    return result.theta.detach().cpu().numpy(), result.implementation.value


def run_tile(
    model: nn.Module,
    x1: Batch,
    x2: Batch | None,
    work: JobWork,
    tile: Tile,
    *,
    array: ResultArray | None = None,
    side_cache: SideCache | None = None,
    device: torch.device | str | None = None,
    allow_tf32: bool = False,
) -> TileOutcome:
    """Compute one tile and write its chunk; returns the outcome to record (the caller records it).

    Args:
        array: the job's open ResultArray. Default: opened from ``work.result_path`` (what a Ray worker does).
        side_cache, device, allow_tf32: as for ``compute_tile``.
    """
    start = time.perf_counter()
    theta, implementation = compute_tile(
        model, x1, x2, work, tile, side_cache=side_cache, device=device, allow_tf32=allow_tf32
    )
    if array is None:
        array = ResultArray.open(work.result_path, plan=work.plan)
    array.write_tile(tile, theta)
    return TileOutcome(tile_id=tile.id, elapsed_s=time.perf_counter() - start, implementation=implementation)


class Executor(ABC):
    """Runs the tiles of a job. Implementations: ``LocalExecutor`` (in-process) and ``RayExecutor``."""

    name: str = "executor"

    device: torch.device = torch.device("cpu")
    """Where this executor's tiles run (the planner budget of a job is that device's)."""

    @abstractmethod
    def run(
        self,
        work: JobWork,
        model: nn.Module,
        x1: Batch,
        x2: Batch | None,
        tiles: Sequence[Tile],
        callbacks: TileCallbacks,
    ) -> None:
        """Compute ``tiles`` (claim, compute, write, report each); return when all are done or told to stop.

        Args:
            work: the job.
            model: its model (never mutated).
            x1: (N, *input) the x1 data set. x2: (M, *input) or None for a symmetric job.
            tiles: the tiles still to do, in the order to do them.
            callbacks: claim / done / should_stop.

        Raises:
            NtkServiceError or any exception of a tile's computation: the job fails with its message.
        """

    def memory_budget(self) -> int | None:
        """The per-tile memory budget fixed into a job at submission when none is configured: the default budget
        of ``device`` (None lets each tile plan for the device it gets)."""
        return device_memory_budget(self.device)

    def close(self) -> None:  # noqa: B027 - optional hook, most executors hold nothing
        """Release what the executor holds (threads, a Ray connection)."""
