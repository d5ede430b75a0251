"""Panels: the work units of a job, separate from its tiles, the storage units readers need.

A panel is a band of ``panel_tiles`` row blocks against a run of ``panel_tiles`` column blocks: one ``compute_ntk``
call computes it, and its result is cut into the tiles (Zarr chunks) it covers. A panel is claimed and recorded in
one SQLite transaction each (``JobStore.claim_tiles`` / ``mark_tiles_done``), so the per-tile bookkeeping (two
writes, a compute-slot handoff, a ledger write per tile) is paid once per panel instead.

- Symmetric jobs (x2 omitted): panels on or above the diagonal only. A diagonal panel (its band is its run) is one
  ``x2=None`` call over the band, exactly symmetric, and yields the band's tiles with ``i ≤ j``.
- ``EXAMPLE_DIAGONAL``: a panel is a band of row blocks.
- Order: by bands, the runs of odd bands walked backwards (serpentine), so the band's side is built once per band and
  kept in the side cache (keyed by its data-set rows) while the runs' sides stream through.
- ``panel_tiles = 1`` is a panel per tile, what every job before panels ran (their specs load with it).

Panel size comes from the cost model (``panel_tiles_for``): the engine's own FLOP estimate of a panel, over a
nominal FLOP rate, kept under a target of a few seconds of work, with the panel's result within a quarter of the
memory budget and at least ``PANELS_PER_WORKER`` panels per worker of the executor. It is fixed in the job's spec at submission: a resumed job cuts the same panels, so it computes the
same bits.

    >>> plan = plan_tiles(n=10, m=None, tile_size=2, mode=KernelMode.TRACE)        # 5 row blocks, 15 tiles
    >>> [(p.rows, p.cols, len(p.tiles)) for p in plan_panels(plan, panel_tiles=2)]
    [((0, 4), (0, 4), 3), ((0, 4), (4, 8), 4), ((0, 4), (8, 10), 2), ((4, 8), (8, 10), 2), ((4, 8), (4, 8), 3), ((8, 10), (8, 10), 1)]
"""  # noqa: E501

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn

from ntk_service.errors import InvalidInput
from ntk_service.jobs.planner import Tile, TilePlan
from ntk_service.kernels.algorithm import NtkAlgorithm
from ntk_service.kernels.choice import loop_implementation
from ntk_service.kernels.jacobian_contraction import JacobianContraction
from ntk_service.kernels.modes import KernelMode, contraction, result_shape
from ntk_service.kernels.ntk_vector_products import NtkVectorProducts
from ntk_service.kernels.problem.batch import Batch
from ntk_service.kernels.problem.outputs import parse_output
from ntk_service.kernels.runtime.problem_pool import prepared_problem
from ntk_service.kernels.structured import Structured
from ntk_service.kernels.types import NtkImplementation

__all__ = [
    "DEFAULT_PANEL_SECONDS",
    "DIAGONAL_MIN_ROWS",
    "DIAGONAL_SPLIT",
    "NOMINAL_FLOP_RATE",
    "PANELS_PER_WORKER",
    "Panel",
    "cost_model_panel_tiles",
    "diagonal_blocks",
    "estimate_panel_flops",
    "panel_count",
    "panel_tiles_for",
    "plan_panels",
]

PANELS_PER_WORKER = 4
"""The fewest panels per worker (thread or Ray actor) a job is cut into, where its size allows: with fewer, the
last, largest panels leave workers idle at the end of a job."""

DEFAULT_PANEL_SECONDS = 4.0
"""Target work per panel: long enough that claiming, recording and the compute-slot handoff (tens of ms under load)
vanish beside it and the sides are built over large blocks, short enough that progress, cancellation and a
resumed job's lost work stay within seconds."""

NOMINAL_FLOP_RATE = 3e11
"""FLOP/s the cost model assumes, in the engine's own FLOP estimate (``estimate_panel_flops``), measured: the idle
2-core development machine computed a 2048 × 2048 trace block of the MLP 784-512-512-10 (1.62e11 estimated FLOPs)
in 0.50 s with 2 threads (docs/jobs.md, stop 33 floor), 3.2e11 FLOP/s, rounded down. The earlier uncalibrated 1e11
made a "4 s" panel about 1.2 s of work. Only the panel size depends on it, never a result's value; another machine
(a GPU actor, many cores) should pass its own ``flop_rate`` or a ``panel_tiles``."""

DIAGONAL_SPLIT = 4
"""Row blocks a symmetric job's diagonal panel is cut into (``diagonal_blocks``): one ``x2=None`` call over a band
of R rows contracts all R² pairs where R(R+1)/2 are needed, so a diagonal panel of one block does twice its work;
cut into d blocks it contracts the d(d+1)/2 blocks on and above its diagonal, R²(1 + 1/d)/2 pairs. Each block's
side is built once and kept in the side cache for the others. At N = 8192 with 13-tile panels the job contracts
1.09x the pairs it needs instead of 1.36x (d = 4; see docs/jobs.md)."""

DIAGONAL_MIN_ROWS = 512
"""The fewest examples per block of a split diagonal panel: a band is cut into at most ``rows // 512`` blocks.
Small blocks lose what the split saves: in bench_jobs.py's A/B, 3328-row diagonal panels cut into blocks of
768-1024 rows took 0.58x the CPU time of one call, but 448-row panels cut into 128-row blocks took 1.51x (--small;
both contended)."""

_ALGORITHMS: dict[NtkImplementation, NtkAlgorithm] = {
    NtkImplementation.JACOBIAN_CONTRACTION: JacobianContraction(),
    NtkImplementation.NTK_VECTOR_PRODUCTS: NtkVectorProducts(),
    NtkImplementation.STRUCTURED: Structured(),
}


@dataclass(frozen=True, slots=True)
class Panel:
    """One work unit: rows ``[rows[0], rows[1])`` of x1 against columns ``[cols[0], cols[1])`` of x2.

    Attributes:
        id: position in the job's panel order (stable for a spec).
        band: the index of its row band (panels of one band share their left side).
        rows, cols: example ranges; ``cols == rows`` for diagonal panels and EXAMPLE_DIAGONAL.
        tiles: the tiles (chunks) it covers, in plan order.
        is_diagonal: computed with ``x2=None`` (a symmetric job's diagonal panel, or EXAMPLE_DIAGONAL).
    """

    id: int
    band: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    tiles: tuple[Tile, ...]
    is_diagonal: bool

    def block_of(self, tile: Tile, theta: np.ndarray, mode: KernelMode) -> np.ndarray:
        """The part of the panel's result ``theta`` that is ``tile``'s block (a view)."""
        r0, r1 = tile.rows[0] - self.rows[0], tile.rows[1] - self.rows[0]
        if not mode.spec.pairs:
            return theta[r0:r1]
        c0, c1 = tile.cols[0] - self.cols[0], tile.cols[1] - self.cols[0]
        return theta[r0:r1, c0:c1]


def diagonal_blocks(
    panel: Panel, tile_size: int, *, split: int = DIAGONAL_SPLIT, min_rows: int = DIAGONAL_MIN_ROWS
) -> tuple[tuple[int, int], ...]:
    """The example ranges a diagonal panel is computed in: its band cut at tile boundaries into ``split`` nearly
    equal runs of tiles (fewer when the band has fewer tiles, or fewer than ``split · min_rows`` examples).

    Args:
        panel: a diagonal panel (``panel.is_diagonal``).
        tile_size: the plan's tile side.
        split: blocks wanted. Default: ``DIAGONAL_SPLIT``.
        min_rows: the fewest examples per block (a band under ``2 · min_rows`` stays one block). Default:
            ``DIAGONAL_MIN_ROWS``.

    Returns:
        ``(start, stop)`` example ranges covering ``panel.rows`` in order, each a whole number of tiles (the last may
        end in the job's last, shorter tile): every tile of the panel lies in one block (i = j) or one pair of blocks.
    """
    start, stop = panel.rows
    tiles = -(-(stop - start) // tile_size)
    parts = max(1, min(split, tiles, (stop - start) // max(1, min_rows)))
    bounds = [start + (tiles * p // parts) * tile_size for p in range(parts)] + [stop]
    return tuple(zip(bounds[:-1], bounds[1:], strict=True))


def plan_panels(plan: TilePlan, *, panel_tiles: int) -> tuple[Panel, ...]:
    """Group a plan's tiles into panels of ``panel_tiles`` × ``panel_tiles`` tiles (fewer at the edges).

    Args:
        plan (TilePlan): the job's tiles.
        panel_tiles (int): row (and column) blocks per panel side, ≥ 1.

    Returns:
        The panels in computation order (bands in order, serpentine over the runs); every planned tile is in
        exactly one panel.

    Raises:
        InvalidInput: panel_tiles < 1.
    """
    if panel_tiles < 1:
        raise InvalidInput(f"plan_panels: panel_tiles must be ≥ 1, got {panel_tiles}; omit it for the cost model's")
    groups: dict[tuple[int, int], list[Tile]] = {}
    for tile in plan.tiles:
        groups.setdefault((tile.i // panel_tiles, tile.j // panel_tiles), []).append(tile)
    diagonal_only = not plan.mode.spec.pairs
    bands = sorted({band for band, _ in groups})
    panels: list[Panel] = []
    for band in bands:
        runs = sorted(run for b, run in groups if b == band)
        for run in runs if band % 2 == 0 else runs[::-1]:
            tiles = groups[(band, run)]
            rows = (min(t.rows[0] for t in tiles), max(t.rows[1] for t in tiles))
            cols = (min(t.cols[0] for t in tiles), max(t.cols[1] for t in tiles))
            diagonal = diagonal_only or (plan.symmetric and band == run)
            if diagonal:
                cols = rows
            panels.append(Panel(len(panels), band, rows, cols, tuple(tiles), diagonal))
    return tuple(panels)


def estimate_panel_flops(
    model: nn.Module,
    example: Batch,
    *,
    rows: int,
    cols: int,
    mode: KernelMode,
    implementation: NtkImplementation,
    params: Sequence[str] | None,
    dtype: str,
    output: str | None = None,
) -> float:
    """The engine's FLOP estimate of one ``rows × cols`` kernel block of ``model`` (the cheapest implementation for
    AUTO, as AUTO would run it).

    Args:
        model: the job's model. example: (1, *input) one example (sets the per-example shapes and [FP]).
        rows, cols: the block's examples per side. mode, implementation, params, dtype, output: the job's.

    Returns:
        Estimated FLOPs (sides and contraction).
    """
    with prepared_problem(model, example, None, params=params, dtype=dtype, output=parse_output(output)) as prepared:
        problem = prepared.problem
        implementation = loop_implementation(implementation, problem)
        core = contraction(mode)  # what the implementations contract for it (NOTE [mode contractions])
        if implementation is NtkImplementation.AUTO:
            return min(alg.flops(problem, rows, cols, core) for alg in _ALGORITHMS.values())
        return _ALGORITHMS[implementation].flops(problem, rows, cols, core)


def panel_tiles_for(
    plan: TilePlan,
    *,
    k: int,
    itemsize: int,
    flops_of: Callable[[int, int], float],
    memory_budget_bytes: int | None,
    target_s: float = DEFAULT_PANEL_SECONDS,
    flop_rate: float = NOMINAL_FLOP_RATE,
    min_panels: int = 1,
) -> int:
    """The largest panel side (in tiles) whose estimated work stays within ``target_s``, whose result takes at
    most a quarter of the memory budget (the engine plans its sides and contractions in the rest), and that cuts
    the job into at least ``min_panels`` panels (so every worker has work until near the end).

    Args:
        plan: the job's tiles. k: outputs per example. itemsize: bytes per stored value.
        flops_of: ``flops_of(rows, cols)``, the estimated FLOPs of a block (``estimate_panel_flops``).
        memory_budget_bytes: the job's memory budget (None: no memory bound).
        target_s: seconds of work per panel. Default: ``DEFAULT_PANEL_SECONDS``.
        flop_rate: FLOP/s assumed. Default: ``NOMINAL_FLOP_RATE``.
        min_panels: the fewest panels wanted (``PANELS_PER_WORKER`` per worker of the executor). Default: 1.

    Returns:
        panel_tiles ≥ 1 (1 when even one tile exceeds the target: a panel is never smaller than a tile).
    """
    blocks = max(-(-plan.n // plan.tile_size), -(-plan.m // plan.tile_size))
    best = 1
    for side in range(2, blocks + 1):
        examples = min(side * plan.tile_size, max(plan.n, plan.m))
        cols = examples if plan.mode.spec.pairs else 0
        result_bytes = math.prod(result_shape(plan.mode, examples, max(cols, 1), k)) * itemsize
        if memory_budget_bytes is not None and result_bytes > memory_budget_bytes / 4:
            break
        if flops_of(examples, max(cols, 1)) / flop_rate > target_s:
            break
        if panel_count(plan, side) < min_panels:
            break
        best = side
        if examples >= max(plan.n, plan.m):
            break
    return best


def cost_model_panel_tiles(
    plan: TilePlan,
    model: nn.Module,
    example: Batch,
    *,
    k: int,
    implementation: NtkImplementation,
    params: Sequence[str] | None,
    dtype: str,
    output: str | None,
    memory_budget_bytes: int | None,
    target_s: float = DEFAULT_PANEL_SECONDS,
    workers: int = 1,
) -> int:
    """``panel_tiles_for`` with the engine's own FLOP estimate of ``model`` on ``example`` (a job's first example):
    the panel size a job or ``compute_ntk_tiled`` fixes at submission, ``PANELS_PER_WORKER`` panels per worker.

    Args:
        plan: the job's tiles. model, example: as ``estimate_panel_flops``. k: outputs per example.
        implementation, params, dtype, output: the job's. memory_budget_bytes: its budget.
        target_s: seconds of work per panel. Default: ``DEFAULT_PANEL_SECONDS``. workers: the executor's
            parallelism. Default: 1.
    """

    def flops_of(rows: int, cols: int) -> float:
        return estimate_panel_flops(
            model, example, rows=rows, cols=cols, mode=plan.mode, implementation=implementation, params=params,
            dtype=dtype, output=output,
        )  # fmt: skip

    return panel_tiles_for(
        plan,
        k=k,
        itemsize=4 if dtype == "float32" else 8,
        flops_of=flops_of,
        memory_budget_bytes=memory_budget_bytes,
        target_s=target_s,
        min_panels=PANELS_PER_WORKER * workers,
    )


def panel_count(plan: TilePlan, panel_tiles: int) -> int:
    """How many panels ``plan_panels(plan, panel_tiles=panel_tiles)`` makes (without making them)."""
    bands = math.ceil(math.ceil(plan.n / plan.tile_size) / panel_tiles)
    if not plan.mode.spec.pairs:
        return bands
    if plan.symmetric:
        return bands * (bands + 1) // 2
    return bands * math.ceil(math.ceil(plan.m / plan.tile_size) / panel_tiles)
