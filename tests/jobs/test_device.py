"""Jobs on the configured device: the local executor hands its device to every tile, Ray tasks compute on the GPU
Ray assigned, and a job's budget is its executor's device's (GPU runs: tests/gpu/test_cuda.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ntk_service.errors import JobFailed, UnknownDevice
from ntk_service.jobs import JobManager, JobStatus, LocalExecutor
from ntk_service.jobs.executors import RayExecutor
from ntk_service.jobs.executors.ray import assigned_device
from ntk_service.results import compute_ntk_tiled
from tests.jobs.conftest import JobsEnv, wait_finished
from tests.reference import reference_ntk

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_the_local_executor_passes_its_device_and_tf32_choice_to_every_panel(
    jobs_env: JobsEnv, make_manager: Callable[..., JobManager]
) -> None:
    seen: list[tuple[object, object, object]] = []

    def run_compute(fn: Any) -> Any:  # the server's seam: every panel's computation passes through here
        options = fn.keywords["options"]  # built once per run from the job's stored options, not per panel
        seen.append((options.device, options.allow_tf32, options.dtype))
        return fn()

    executor = LocalExecutor(run_compute=run_compute, device="cpu", allow_tf32=True)
    assert executor.device == torch.device("cpu")
    manager = make_manager(executor)
    job = manager.submit(
        model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", dtype="float64", tile_size=4, panel_tiles=2
    )
    record = wait_finished(manager, job.id)
    assert record.status is JobStatus.SUCCEEDED, record.error
    # 3 row blocks, panels of 2² tiles: blocks {0, 1} against {0, 1} and against {2}, then {2} against {2}.
    assert seen == [(torch.device("cpu"), True, torch.float64)] * 3
    _, model = jobs_env.registry.load_module("tiny")
    expected = reference_ntk(model, torch.from_numpy(jobs_env.x1), mode="trace").numpy()
    np.testing.assert_allclose(manager.read_result(job.id), expected, rtol=1e-10, atol=1e-12)


@NO_CUDA
def test_a_local_executor_on_an_absent_gpu_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnknownDevice, match="LocalExecutor: device 'cuda' was asked for but CUDA is not available"):
        LocalExecutor(device="cuda")
    with pytest.raises(UnknownDevice, match="compute_ntk_tiled: device 'cuda:1' was asked for but CUDA is not"):
        compute_ntk_tiled(torch.nn.Linear(3, 2), torch.randn(4, 3), out=tmp_path / "k.zarr", device="cuda:1")
    assert not (tmp_path / "k.zarr").exists()  # refused before anything is written


def test_compute_ntk_tiled_on_device_cpu_equals_the_reference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    x1, x2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    out = tmp_path / "k.zarr"
    view = compute_ntk_tiled(model, x1, x2, out=out, tile_size=2, dtype="float64", progress=False, device="cpu")
    np.testing.assert_allclose(np.asarray(view[:]), reference_ntk(model, x1, x2).numpy(), rtol=1e-10, atol=1e-12)


def test_a_job_without_a_configured_budget_takes_its_executors(jobs_env: JobsEnv, tmp_path: Path) -> None:
    class Budgeted(LocalExecutor):
        def memory_budget(self) -> int | None:
            return 48 * 2**20

    manager = JobManager(data_dir=jobs_env.data_dir, models=jobs_env.registry, datasets=jobs_env.datasets,
                         executor=Budgeted())  # fmt: skip
    try:
        job = manager.submit(model="tiny", x1_dataset=jobs_env.x1_id, mode="trace", tile_size=4)
        assert job.spec.memory_budget_bytes == 48 * 2**20
    finally:
        manager.stop()
    assert LocalExecutor().memory_budget() > 0  # the host budget for CPU tiles
    assert RayExecutor().memory_budget() > 0
    assert RayExecutor(num_gpus=0.5).memory_budget() is None  # each GPU task plans for the GPU it is given


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "expected"),
    [
        ([], None, torch.device("cpu")),
        ([], "0,1", torch.device("cpu")),
        ([3], "3", torch.device("cuda", 0)),  # Ray narrows CUDA_VISIBLE_DEVICES to the assigned GPU
        (["1"], "0,1", torch.device("cuda", 1)),
        ([2, 5], "2,5", torch.device("cuda", 0)),  # two GPUs assigned: the tile uses the first
        ([2], None, torch.device("cuda", 2)),  # CUDA_VISIBLE_DEVICES left alone: the id is the index
        ([2], "", torch.device("cuda", 2)),
    ],
)
def test_a_ray_task_uses_the_gpu_ray_assigned(gpu_ids: list[object], visible: str | None, expected: object) -> None:
    assert assigned_device(gpu_ids, visible) == expected  # type: ignore[arg-type]


def test_an_assigned_gpu_missing_from_the_visible_devices_fails_clearly() -> None:
    with pytest.raises(JobFailed, match=r"Ray assigned GPU '5' to a tile but CUDA_VISIBLE_DEVICES is '0,1'"):
        assigned_device([5], "0,1")
