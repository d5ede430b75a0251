"""The Ray executor on a real local Ray instance (2 CPUs): same bits as the local executor, even when a worker
process dies mid-tile and Ray retries its task; and a clear error when Ray is not installed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.errors import OptionalDependencyMissing
from ntk_service.jobs import JobManager, JobStatus, LocalExecutor
from ntk_service.jobs.executors import RayExecutor, import_ray
from ntk_service.jobs.executors.base import JobWork, PanelOutcome
from ntk_service.jobs.panels import Panel
from ntk_service.jobs.planner import Tile, plan_tiles
from ntk_service.jobs.records import JobSpec
from ntk_service.jobs.results import ResultArray
from ntk_service.kernels import KernelMode
from ntk_service.registry import DatasetStore, ModelRegistry
from ntk_service.results import compute_ntk_tiled, open_result
from tests.jobs.conftest import wait_finished
from tests.reference import reference_ntk

KILLER = "tests.jobs.factories:build_kill_once"


def test_ray_job_equals_the_local_job_after_a_worker_is_killed(ray_instance: object, tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path, allowed_factories=frozenset({KILLER}))
    datasets = DatasetStore(tmp_path)
    marker = tmp_path / "killed-worker.pid"
    registry.register(
        "killer",
        {
            "family": "factory",
            "factory": KILLER,
            "kwargs": {"marker": str(marker)},
            "input_shape": [4],
            "input_dtype": "float32",
        },
        seed=0,
    )
    x1 = datasets.create(np.random.default_rng(0).standard_normal((11, 4)).astype(np.float32)).id
    x2 = datasets.create(np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)).id
    options = {
        "model": "killer",
        "x1_dataset": x1,
        "x2_dataset": x2,
        "mode": "full",
        "dtype": "float64",
        "tile_size": 4,
    }

    def manager(executor: LocalExecutor | RayExecutor) -> JobManager:
        built = JobManager(
            data_dir=tmp_path, models=registry, datasets=datasets, executor=executor, memory_budget_bytes=64 * 2**20
        )
        built.start()
        return built

    on_ray = manager(RayExecutor(max_in_flight=2))
    ray_job = on_ray.submit(**options)
    record = wait_finished(on_ray, ray_job.id, timeout=120)
    on_ray.stop()
    assert record.status is JobStatus.SUCCEEDED, record.error
    assert record.executor == "ray" and record.tiles_done == record.tiles_total == 6
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # one worker died mid-tile ...
    assert set(on_ray.store.tile_attempts(ray_job.id).values()) == {1}  # ... and Ray, not the server, retried it

    local = manager(LocalExecutor())
    local_job = local.submit(**options)
    assert wait_finished(local, local_job.id).status is JobStatus.SUCCEEDED
    np.testing.assert_array_equal(local.read_result(ray_job.id), local.read_result(local_job.id))
    local.stop()
    registry.close()
    datasets.close()


def test_compute_ntk_tiled_on_ray_equals_the_reference(ray_instance: object, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((9, 4)))
    options = {"mode": "trace", "tile_size": 4, "dtype": "float64", "progress": False}
    on_ray = compute_ntk_tiled(model, x, out=tmp_path / "ray.zarr", executor="ray", **options)  # type: ignore[arg-type]
    assert ray_instance.is_initialized()  # type: ignore[attr-defined]  # an initialised Ray is reused, not shut down
    dense = reference_ntk(model, x, mode="trace").numpy()
    np.testing.assert_allclose(on_ray.to_numpy(), dense, rtol=1e-10, atol=1e-12)
    assert on_ray.attrs["implementation_used"]


class _Recorder:
    """PanelCallbacks that claim every tile and keep each outcome the actors report."""

    def __init__(self) -> None:
        self.outcomes: list[PanelOutcome] = []

    def claim(self, panel: Panel) -> tuple[Tile, ...]:
        return panel.tiles

    def done(self, outcome: PanelOutcome) -> None:
        self.outcomes.append(outcome)

    def should_stop(self) -> bool:
        return False


def test_a_bands_panels_are_computed_by_one_actor(ray_instance: object, tmp_path: Path) -> None:
    """With the window at two calls (one actor's room) the band's actor always has room: every panel of a band is
    reported by the same actor (their own ids, from the actors' runtime context), and the result is the reference's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((16, 4)))
    plan = plan_tiles(n=16, m=None, tile_size=2, mode=KernelMode.TRACE)  # 8 row blocks
    spec = JobSpec(
        model="m", version=1, weights_sha256="w", x1_dataset="ds", x2_dataset=None, x1_sha256="x", x2_sha256=None,
        n=16, m=16, k=3, mode="trace", implementation="jacobian_contraction", dtype="float64", params=None,
        tile_size=2, memory_budget_bytes=2**26, panel_tiles=2,
    )  # fmt: skip
    out = tmp_path / "result.zarr"
    ResultArray.create(out, plan=plan, k=3, dtype="float64", attributes=spec.result_attributes())
    work = JobWork(job_id="bands", spec=spec, plan=plan, result_path=out)
    panels = work.panels()  # 4 bands of 2 row blocks: 10 panels
    recorder = _Recorder()
    executor = RayExecutor(num_cpus=1, max_in_flight=2)  # two actors on the fixture's 2 CPUs
    try:
        executor.run(work, model, x, None, panels, recorder)
    finally:
        executor.close()
    assert sorted(o.panel_id for o in recorder.outcomes) == [p.id for p in panels]
    band_of = {p.id: p.band for p in panels}
    workers: dict[int, set[str | None]] = {}
    for outcome in recorder.outcomes:
        workers.setdefault(band_of[outcome.panel_id], set()).add(outcome.worker)
    assert sorted(workers) == [0, 1, 2, 3]
    assert all(len(ids) == 1 and None not in ids for ids in workers.values()), workers
    dense = reference_ntk(model, x, mode="trace").numpy()
    np.testing.assert_allclose(open_result(out).to_numpy(), dense, rtol=1e-10, atol=1e-12)


class _Tokens(nn.Module):
    """Keyword inputs (ids, an integer mask) and a dict output: the mapping path through the object store."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin = nn.Embedding(9, 4), nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lin(torch.tanh(self.emb(input_ids)) * attention_mask.unsqueeze(-1))}


def test_mapping_inputs_on_ray_equal_the_reference(ray_instance: object, tmp_path: Path) -> None:
    """A mapping of inputs travels to the panel workers leaf by leaf (numpy in the object store) and comes back
    as the reference's kernel of the selected output."""
    torch.manual_seed(1)
    model = _Tokens().double()
    g = torch.Generator().manual_seed(2)
    x1 = {"input_ids": torch.randint(0, 9, (7, 3), generator=g), "attention_mask": torch.ones(7, 3, dtype=torch.int64)}
    x2 = {"input_ids": torch.randint(0, 9, (5, 3), generator=g), "attention_mask": torch.ones(5, 3, dtype=torch.int64)}
    options = {"mode": "full", "tile_size": 3, "dtype": "float64", "progress": False, "output": "logits[:, 1]"}
    on_ray = compute_ntk_tiled(model, x1, x2, out=tmp_path / "ray.zarr", executor="ray", **options)  # type: ignore[arg-type]
    dense = reference_ntk(model, x1, x2, mode="full", output=lambda o: o["logits"][:, 1]).numpy()
    np.testing.assert_allclose(on_ray.to_numpy(), dense, rtol=1e-10, atol=1e-12)


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees without the extra installed
    with pytest.raises(OptionalDependencyMissing, match=r"pip install 'ntk-service\[ray\]'"):
        import_ray()
