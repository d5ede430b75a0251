"""Panels, the work units of a job: every tile in exactly one panel, bands in order, the cost model's size, one
SQLite transaction per claim and per record, and resumes that recompute a partly written panel without ever
rewriting (or recording) a chunk they should not."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.errors import InvalidInput
from ntk_service.jobs import JobManager, JobStatus, LocalExecutor, plan_panels, plan_tiles
from ntk_service.jobs.executors.base import JobWork, compute_panel
from ntk_service.jobs.manager import plan_of
from ntk_service.jobs.panels import NOMINAL_FLOP_RATE, diagonal_blocks, panel_count, panel_tiles_for
from ntk_service.jobs.records import JobSpec
from ntk_service.jobs.store import JobStore
from ntk_service.kernels import KernelMode, SideCache
from ntk_service.results import compute_ntk_tiled
from tests.jobs.conftest import JobsEnv, wait_finished
from tests.jobs.test_store import _record as store_record
from tests.reference import reference_ntk

SHAPES = [(10, None), (10, 7), (1, None), (9, 9)]


@pytest.mark.parametrize("mode", list(KernelMode))
@pytest.mark.parametrize(("n", "m"), SHAPES)
@pytest.mark.parametrize("panel_tiles", [1, 2, 3, 8])
def test_every_tile_is_in_exactly_one_panel_inside_its_bounds(
    mode: KernelMode, n: int, m: int | None, panel_tiles: int
) -> None:
    if not mode.spec.pairs and m is not None:
        return
    plan = plan_tiles(n=n, m=m, tile_size=2, mode=mode)
    panels = plan_panels(plan, panel_tiles=panel_tiles)
    ids = [t.id for p in panels for t in p.tiles]
    assert sorted(ids) == sorted(t.id for t in plan.tiles) and len(ids) == len(set(ids))
    assert [p.id for p in panels] == list(range(len(panels))) and len(panels) == panel_count(plan, panel_tiles)
    for panel in panels:
        assert len(panel.tiles) <= panel_tiles**2
        assert {t.i // panel_tiles for t in panel.tiles} == {panel.band}
        for tile in panel.tiles:
            assert panel.rows[0] <= tile.rows[0] < tile.rows[1] <= panel.rows[1]
            assert panel.cols[0] <= tile.cols[0] < tile.cols[1] <= panel.cols[1]
        assert panel.rows[1] - panel.rows[0] <= panel_tiles * 2
        if panel.is_diagonal:
            assert panel.cols == panel.rows and (plan.symmetric or not mode.spec.pairs)
    bands = [p.band for p in panels]
    assert bands == sorted(bands)  # a band's panels run one after another: its side is built once


def test_panels_of_one_tile_are_the_tiles_in_plan_order() -> None:
    plan = plan_tiles(n=10, m=7, tile_size=3, mode=KernelMode.FULL)
    panels = plan_panels(plan, panel_tiles=1)
    assert [p.tiles for p in panels] == [(t,) for t in plan.tiles]
    assert all((p.rows, p.cols) == (p.tiles[0].rows, p.tiles[0].cols) for p in panels)


def test_a_panel_of_zero_tiles_is_refused() -> None:
    with pytest.raises(InvalidInput, match="panel_tiles must be ≥ 1"):
        plan_panels(plan_tiles(n=4, m=None, tile_size=2, mode=KernelMode.TRACE), panel_tiles=0)


def test_panel_size_is_the_largest_within_the_target_and_a_quarter_of_the_budget() -> None:
    plan = plan_tiles(n=4096, m=None, tile_size=256, mode=KernelMode.TRACE)  # 16 row blocks

    def flops_of(rows: int, cols: int) -> float:
        return 1e5 * rows * cols  # written out: a panel of s tiles per side costs (256 s)² · 1e5 FLOP

    # (256 s)² · 1e5 / 1e11 ≤ 4 s  ⇔  s ≤ 7.8: seven tiles per side.
    assert panel_tiles_for(plan, k=1, itemsize=4, flops_of=flops_of, memory_budget_bytes=None, flop_rate=1e11) == 7
    # A (256 s)² float32 result within budget / 4 = 2 MiB: 2^18 s² ≤ 2^21, s ≤ 2.8.
    budget = 8 * 2**20
    assert panel_tiles_for(plan, k=1, itemsize=4, flops_of=flops_of, memory_budget_bytes=budget, flop_rate=1e11) == 2
    # Work that does not fit one tile still runs a tile per panel; work far below the target takes the whole job.
    assert panel_tiles_for(plan, k=1, itemsize=4, flops_of=lambda r, c: 1e30, memory_budget_bytes=None) == 1
    assert panel_tiles_for(plan, k=1, itemsize=4, flops_of=lambda r, c: 1.0, memory_budget_bytes=None) == 16
    # At least 8 panels (two workers): 16 row blocks in bands of s make b(b+1)/2 panels, b = ceil(16 / s) ≥ 4: s ≤ 5.
    cheap = {"k": 1, "itemsize": 4, "flops_of": lambda r, c: 1.0, "memory_budget_bytes": None}
    assert panel_tiles_for(plan, **cheap, min_panels=8) == 5  # type: ignore[arg-type]


def test_panel_size_follows_the_flop_rate() -> None:
    plan = plan_tiles(n=8192, m=None, tile_size=256, mode=KernelMode.TRACE)  # 32 row blocks

    def flops_of(rows: int, cols: int) -> float:
        return 1e5 * rows * cols

    sizes = {
        rate: panel_tiles_for(plan, k=1, itemsize=4, flops_of=flops_of, memory_budget_bytes=None, flop_rate=rate)
        for rate in (1e11, 4e11, 16e11)
    }
    # (256 s)² · 1e5 / rate ≤ 4 s  ⇔  s ≤ √(4 rate / 1e5) / 256: 7.8, 15.6, 31.3 tiles. Four times the rate is
    # twice the side: the same seconds of work per panel.
    assert sizes == {1e11: 7, 4e11: 15, 16e11: 31}
    # The default is the calibrated rate (NOMINAL_FLOP_RATE): 3e11 gives s ≤ 13.5.
    assert NOMINAL_FLOP_RATE == 3e11
    assert panel_tiles_for(plan, k=1, itemsize=4, flops_of=flops_of, memory_budget_bytes=None) == 13


def test_claim_and_record_are_one_transaction_each(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.create_job(store_record("j1", tiles=4), tile_ids=[0, 1, 2, 3])
    store.mark_tile_done("j1", 1, elapsed_s=0.1)
    statements: list[str] = []
    connect = store._connect

    def traced() -> sqlite3.Connection:
        conn = connect()
        conn.set_trace_callback(statements.append)
        return conn

    store._connect = traced  # type: ignore[method-assign]
    assert store.claim_tiles("j1", [0, 1, 2]) == [0, 2]  # 1 is done: not claimed, its attempt not counted
    assert [s.split()[0] for s in statements if not s.startswith("PRAGMA")] == ["BEGIN", "UPDATE", "COMMIT"]
    statements.clear()
    store.mark_tiles_done("j1", [0, 2], elapsed_s=1.0)
    assert [s.split()[0] for s in statements if not s.startswith("PRAGMA")] == ["BEGIN", "UPDATE", "UPDATE", "COMMIT"]
    assert store.tile_attempts("j1") == {0: 1, 1: 0, 2: 1, 3: 0}
    assert store.done_tile_ids("j1") == {0, 1, 2} and sorted(store.tile_seconds("j1")) == [0.1, 0.5, 0.5]
    assert store.claim_tiles("j1", [0, 1, 2]) == []  # a done panel: nothing to compute


class _StopAfter:
    """A run_compute that lets ``free`` panels through, then blocks until released (the server is stopping)."""

    def __init__(self, free: int) -> None:
        self.free, self.calls = free, 0
        self.blocked, self.go = threading.Event(), threading.Event()

    def __call__(self, fn: Callable[[], Any]) -> Any:
        self.calls += 1
        if self.calls > self.free:
            self.blocked.set()
            self.go.wait(30)
        return fn()


def test_a_job_in_panels_equals_the_reference_and_resumes_panel_by_panel(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    gate = _StopAfter(free=1)
    first = make_manager(LocalExecutor(run_compute=gate))
    options: dict[str, Any] = {
        "model": "tiny",
        "x1_dataset": jobs_env.x1_id,
        "mode": "full",
        "dtype": "float64",
        "tile_size": 2,
    }
    job = first.submit(**options, panel_tiles=2)  # 6 row blocks: 21 tiles in 6 panels
    panels = plan_panels(plan_of(job.spec), panel_tiles=2)
    assert job.spec.panel_tiles == 2 and len(panels) == 6
    assert gate.blocked.wait(30)
    stopper = threading.Thread(target=first.stop)
    stopper.start()
    gate.go.set()  # the second panel finishes and is recorded; the runner stops at the boundary
    stopper.join(30)
    interrupted = first.get(job.id)
    assert interrupted.status is JobStatus.RUNNING
    assert interrupted.tiles_done == len(panels[0].tiles) + len(panels[1].tiles)  # whole panels, never part of one
    second = make_manager()
    resumed = wait_finished(second, job.id)
    assert resumed.status is JobStatus.SUCCEEDED and resumed.spec.panel_tiles == 2
    assert set(second.store.tile_attempts(job.id).values()) == {1}  # nothing computed twice
    _, model = jobs_env.registry.load_module("tiny")
    expected = reference_ntk(model, torch.from_numpy(jobs_env.x1), mode="full").numpy()
    np.testing.assert_allclose(second.read_result(job.id), expected, rtol=1e-10, atol=1e-12)
    again = second.submit(**options, panel_tiles=2)
    wait_finished(second, again.id)
    np.testing.assert_array_equal(second.read_result(job.id), second.read_result(again.id))


def test_the_cost_model_sizes_panels_at_submission(jobs_env: JobsEnv, make_manager: Callable[..., JobManager]) -> None:
    quick = make_manager()  # a tiny model: far below the 4 s target, so the panel count decides
    job = quick.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", tile_size=2)
    # 11 examples, 6 row blocks of 2, one worker: at least 4 panels; bands of 2 blocks make 3 · 4 / 2 = 6, of 3 only 3.
    assert job.spec.panel_tiles == 2
    assert wait_finished(quick, job.id).status is JobStatus.SUCCEEDED
    quick.stop()
    strict = make_manager(panel_seconds=1e-12)  # no panel fits: a tile per panel
    assert strict.submit(model="tiny", x1_dataset=jobs_env.x1_id, tile_size=2).spec.panel_tiles == 1
    with pytest.raises(InvalidInput, match="panel_tiles must be ≥ 1"):
        strict.submit(model="tiny", x1_dataset=jobs_env.x1_id, panel_tiles=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _files(out: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for path in out.rglob("*"):
        if path.is_file() and "c" in path.relative_to(out).parts:
            stat = path.stat()
            found[str(path.relative_to(out))] = (stat.st_ino, stat.st_mtime_ns)
    return found


def test_a_partly_recorded_panel_is_recomputed_and_only_its_unrecorded_tiles_are_rewritten(tmp_path: Path) -> None:
    model, out = _model(), tmp_path / "k.zarr"
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((11, 4)))
    options: dict[str, Any] = {"mode": "full", "tile_size": 2, "panel_tiles": 3, "dtype": "float64", "progress": False}
    whole = compute_ntk_tiled(model, x, out=out, **options).to_numpy()
    # As if the process died after a panel's chunks and part of its ledger were written: tiles (0, 2) and (1, 2) of
    # the first panel (row blocks 0-2 against 0-2) lost their ledger entries; (2, 3) of the next panel, both.
    lost = [0 * 6 + 2, 1 * 6 + 2, 2 * 6 + 3, 0 * 6 + 3]
    for tile_id in lost:
        (out / "tiles" / "done" / "c" / str(tile_id)).unlink()
    before = _files(out)
    resumed = compute_ntk_tiled(model, x, out=out, **options).to_numpy()
    after = _files(out)
    rewritten = {name for name, stat in before.items() if after.get(name) != stat} | (set(after) - set(before))
    expected = set()
    for tile_id in lost:
        i, j = divmod(tile_id, 6)
        expected |= {f"tiles/done/c/{tile_id}", f"theta/c/{i}/{j}/0/0"}
    assert rewritten == expected  # recorded tiles of the same panels kept their files
    np.testing.assert_array_equal(resumed, whole)
    np.testing.assert_allclose(resumed, reference_ntk(model, x, mode="full").numpy(), rtol=1e-10, atol=1e-12)


def test_a_bands_side_is_built_once_for_all_its_panels() -> None:
    model, x = _model(), torch.from_numpy(np.random.default_rng(0).standard_normal((12, 4)))
    plan = plan_tiles(n=12, m=None, tile_size=2, mode=KernelMode.TRACE)
    spec = JobSpec(
        model="m", version=1, weights_sha256="w", x1_dataset="ds", x2_dataset=None, x1_sha256="x", x2_sha256=None,
        n=12, m=12, k=3, mode="trace", implementation="jacobian_contraction", dtype="float64", params=None,
        tile_size=2, memory_budget_bytes=2**26, panel_tiles=2,
    )  # fmt: skip
    # diagonal_split=1: the diagonal panel is one x2=None call (test_diagonal_panels_... splits it).
    work = JobWork(job_id="j", spec=spec, plan=plan, result_path=Path("unused"), diagonal_split=1)
    band = [p for p in work.panels() if p.band == 0]
    assert [(p.cols, p.is_diagonal) for p in band] == [((0, 4), True), ((4, 8), False), ((8, 12), False)]
    cache = SideCache(max_bytes=2**26)
    dense = reference_ntk(model, x, mode="trace").numpy()
    for panel in band:
        theta, _ = compute_panel(model, x, None, work, panel, side_cache=cache)
        np.testing.assert_allclose(theta, dense[0:4, panel.cols[0] : panel.cols[1]], rtol=1e-10, atol=1e-12)
    # The band's side: built by the diagonal panel (a miss), taken from the cache by the two others (two hits);
    # each run's side is built once (two misses).
    assert (cache.hits, cache.misses) == (2, 3)


@pytest.mark.parametrize("mode", [KernelMode.FULL, KernelMode.TRACE, KernelMode.OUTPUT_DIAGONAL])
def test_diagonal_panels_contract_only_the_blocks_on_and_above_their_diagonal(mode: KernelMode) -> None:
    model, x = _model(), torch.from_numpy(np.random.default_rng(1).standard_normal((11, 4)))
    plan = plan_tiles(n=11, m=None, tile_size=2, mode=mode)  # 6 row blocks, the last of one example
    spec = JobSpec(
        model="m", version=1, weights_sha256="w", x1_dataset="ds", x2_dataset=None, x1_sha256="x", x2_sha256=None,
        n=11, m=11, k=3, mode=mode.value, implementation="jacobian_contraction", dtype="float64", params=None,
        tile_size=2, memory_budget_bytes=2**26, panel_tiles=6,
    )  # fmt: skip
    work = JobWork(job_id="j", spec=spec, plan=plan, result_path=Path("unused"), diagonal_split=3, diagonal_min_rows=1)
    (panel,) = work.panels()  # the whole job is one diagonal panel
    blocks = diagonal_blocks(panel, plan.tile_size, split=3, min_rows=1)
    assert blocks == ((0, 4), (4, 8), (8, 11))  # two tiles each, cut at tile boundaries
    cache = SideCache(max_bytes=2**26)
    theta, implementation = compute_panel(model, x, None, work, panel, side_cache=cache)
    dense = reference_ntk(model, x, mode=mode.value).numpy()
    np.testing.assert_allclose(theta, dense, rtol=1e-10, atol=1e-12)  # the whole panel, mirrored part included
    assert implementation == "jacobian_contraction"
    # Six calls (3 diagonal blocks, 3 pairs above): each block's side built once (3 misses), the pairs' two
    # sides from the cache (6 hits).
    assert (cache.hits, cache.misses) == (6, 3)
    # Without a side cache the diagonal panel stays one call (splitting would rebuild every block's side).
    whole, _ = compute_panel(model, x, None, work, panel, side_cache=None)
    np.testing.assert_allclose(whole, dense, rtol=1e-10, atol=1e-12)


def test_diagonal_blocks_never_exceed_the_tiles_of_the_band() -> None:
    plan = plan_tiles(n=10, m=None, tile_size=4, mode=KernelMode.TRACE)  # 3 row blocks: 4, 4, 2
    (panel,) = plan_panels(plan, panel_tiles=3)
    assert diagonal_blocks(panel, 4, split=8, min_rows=1) == ((0, 4), (4, 8), (8, 10))
    assert diagonal_blocks(panel, 4, split=2, min_rows=1) == ((0, 4), (4, 10))
    assert diagonal_blocks(panel, 4, split=1, min_rows=1) == ((0, 10),)
    assert diagonal_blocks(panel, 4, split=8, min_rows=5) == ((0, 4), (4, 10))  # 10 // 5: two blocks at most
    assert diagonal_blocks(panel, 4, split=8, min_rows=6) == ((0, 10),)  # under 2 · 6 examples: one block
    big = plan_panels(plan_tiles(n=8192, m=None, tile_size=256, mode=KernelMode.TRACE), panel_tiles=13)[0]
    assert diagonal_blocks(big, 256) == ((0, 768), (768, 1536), (1536, 2304), (2304, 3328))  # the defaults: 4
