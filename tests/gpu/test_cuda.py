"""Kernels, the HTTP service and a local job on a CUDA GPU, against the float64 CPU reference (tests/reference.py).

Runs only where ``torch.cuda.is_available()``; elsewhere every test here is reported as skipped, with the reason,
never as passed. ``benchmarks/gpu_session.sh`` runs this module and ``benchmarks/bench_gpu.py`` on a GPU machine:

    .venv/bin/python -m pytest tests/gpu -v -rs
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks._models import MODELS, make_inputs
from ntk_service.jobs import JobManager, JobStatus, LocalExecutor
from ntk_service.kernels import compute_ntk, device_memory_budget
from ntk_service.registry import DatasetStore, ModelRegistry
from ntk_service.results import compute_ntk_tiled
from tests.conftest import start_live_server
from tests.reference import assert_matches, reference_ntk
from tests.server.support import decode_theta, rebuild, request_kernel

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"needs a CUDA GPU: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees none here",
)

CUDA = torch.device("cuda", 0)
IMPLEMENTATIONS = ["jacobian_contraction", "ntk_vector_products", "structured", "auto"]
MODES = ["full", "trace", "output_diagonal", "example_diagonal"]
N, M = 4, 3
"""Small batches: the float64 reference loops over examples and outputs on the CPU."""


def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A benchmark model in float64 on the CPU and float64 inputs x1 (N, *input), x2 (M, *input)."""
    model = MODELS[name]().double()
    return model, make_inputs(name, N).double(), make_inputs(name, M, seed=2).double()


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], torch.Tensor]:
    """The float64 CPU reference kernel per (model, mode)."""
    out = {}
    for name in MODELS:
        model, x1, x2 = _case(name)
        for mode in MODES:
            out[name, mode] = reference_ntk(model, x1, None if mode == "example_diagonal" else x2, mode=mode)
    return out


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_on_cuda_equals_the_reference_in_float64(
    references: dict[tuple[str, str], torch.Tensor], name: str, mode: str, implementation: str
) -> None:
    model, x1, x2 = _case(name)
    placed = copy.deepcopy(model).to(CUDA)  # placed once, as the server's module cache does
    right = None if mode == "example_diagonal" else x2
    result = compute_ntk(placed, x1, right, mode=mode, implementation=implementation, device="cuda")
    assert result.theta.device == CUDA and result.theta.dtype == torch.float64
    assert_matches(result.theta.cpu(), references[name, mode])


def test_a_cpu_model_is_copied_to_the_gpu_for_the_call_and_left_on_the_cpu(
    references: dict[tuple[str, str], torch.Tensor],
) -> None:
    model, x1, x2 = _case("cnn")
    result = compute_ntk(model, x1, x2, device="cuda:0")
    assert result.theta.device == CUDA
    assert_matches(result.theta.cpu(), references["cnn", "full"])
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_chunked_on_the_gpu_under_a_small_budget(references: dict[tuple[str, str], torch.Tensor]) -> None:
    model, x1, x2 = _case("mlp")
    placed = copy.deepcopy(model).to(CUDA)
    whole = compute_ntk(placed, x1, x2, implementation="jacobian_contraction")
    assert whole.block_size == N  # the GPU's budget holds the whole kernel at once
    budget = whole.estimate_bytes // 2
    result = compute_ntk(placed, x1, x2, implementation="jacobian_contraction", memory_budget_bytes=budget)
    assert result.block_size < N and result.estimate_bytes <= budget  # the budget forced blocks
    assert_matches(result.theta.cpu(), references["mlp", "full"])


def test_the_gpu_budget_is_read_from_the_gpu() -> None:
    budget = device_memory_budget(CUDA)
    free, total = torch.cuda.mem_get_info(CUDA)
    idle = torch.cuda.memory_reserved(CUDA) - torch.cuda.memory_allocated(CUDA)
    assert 0 < budget <= total
    assert abs(budget - (free + idle) / 2) <= 0.01 * total  # half of what this process can get there, not host RAM


def test_float32_without_tf32_is_float32_accurate_and_the_switches_are_restored(
    references: dict[tuple[str, str], torch.Tensor],
) -> None:
    """TF32 rounds inputs to 10 mantissa bits (~1e-3 relative); float32 proper is ~1e-6 on these kernels."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    model, x1, x2 = _case("cnn")
    placed = copy.deepcopy(model).float().to(CUDA)
    for implementation in ["jacobian_contraction", "structured"]:
        result = compute_ntk(placed, x1.float(), x2.float(), implementation=implementation)
        assert result.theta.dtype == torch.float32
        assert_matches(result.theta.cpu(), references["cnn", "full"], rel=1e-4)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_a_server_with_ntk_device_cuda_computes_on_the_gpu(tmp_path: Path) -> None:
    server = start_live_server(tmp_path / "data", device="cuda")
    try:
        with server.client("write") as client:
            assert client.get("/readyz").json() == {"status": "ready", "device": "cuda:0"}
            architecture = {"family": "cnn", "input_shape": [3, 8, 8], "channels": [4], "output_dim": 3}
            record = client.post("/v1/models", json={"name": "c", "architecture": architecture}).json()
            model = rebuild(record, client.get("/v1/models/c/versions/1/weights").content)
            rng = np.random.default_rng(0)
            x1 = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
            x2 = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
            for fmt in ["json", "safetensors"]:
                theta, meta = decode_theta(request_kernel(client, "c", x1, x2, fmt=fmt, dtype="float64"))
                expected = reference_ntk(model, torch.from_numpy(x1), torch.from_numpy(x2))
                assert_matches(torch.from_numpy(np.asarray(theta)), expected)
                assert meta["model"] == "c"
    finally:
        server.stop()


def test_a_local_job_on_cuda_equals_the_reference(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path, device="cuda")
    datasets = DatasetStore(tmp_path)
    manager = JobManager(data_dir=tmp_path, models=registry, datasets=datasets, executor=LocalExecutor(device="cuda"))
    try:
        architecture = {"family": "mlp", "input_dim": 6, "hidden": [16], "output_dim": 3, "activation": "tanh"}
        registry.register("m", architecture, seed=0)
        _, placed = registry.load_module("m")
        assert {p.device for p in placed.parameters()} == {CUDA}  # the cache holds the GPU copy
        x = np.random.default_rng(0).standard_normal((9, 6)).astype(np.float32)
        dataset = datasets.create(x).id
        manager.start()
        job = manager.submit(model="m", x1_dataset=dataset, mode="full", dtype="float64", tile_size=4)
        deadline = time.monotonic() + 120
        while not (record := manager.get(job.id)).is_finished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record.status is JobStatus.SUCCEEDED, record.error
        model = copy.deepcopy(placed).cpu()
        expected = reference_ntk(model, torch.from_numpy(x))
        assert_matches(torch.from_numpy(manager.read_result(job.id)), expected)
    finally:
        manager.stop()
        registry.close()
        datasets.close()


def test_compute_ntk_tiled_on_cuda_equals_the_reference(tmp_path: Path) -> None:
    model, x1, x2 = _case("mlp")
    view = compute_ntk_tiled(
        model, x1, x2, out=tmp_path / "k.zarr", tile_size=2, dtype="float64", progress=False, device="cuda"
    )
    assert_matches(torch.from_numpy(np.asarray(view[:])), reference_ntk(model, x1, x2))
    assert {p.device.type for p in model.parameters()} == {"cpu"}  # the caller's model stays on the CPU


def test_a_ray_job_with_gpus_runs_on_the_gpu_ray_assigned(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="the Ray executor needs the ntk-service[ray] extra")
    from ntk_service.jobs.executors import RayExecutor
    from ntk_service.jobs.executors.ray import assigned_device

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
        ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    registry = ModelRegistry(tmp_path, device="cuda")  # the server's copy on its GPU: Ray ships a CPU copy
    datasets = DatasetStore(tmp_path)
    manager = JobManager(
        data_dir=tmp_path, models=registry, datasets=datasets, executor=RayExecutor(num_gpus=0.5, max_in_flight=2)
    )
    try:

        @ray.remote(num_gpus=0.5)
        def where() -> tuple[str, bool]:
            import os

            device = assigned_device(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            return str(device), torch.cuda.is_available()

        assert ray.get(where.remote()) == ("cuda:0", True)
        architecture = {"family": "mlp", "input_dim": 6, "hidden": [16], "output_dim": 3, "activation": "tanh"}
        registry.register("m", architecture, seed=0)
        x = np.random.default_rng(0).standard_normal((9, 6)).astype(np.float32)
        manager.start()
        job = manager.submit(model="m", x1_dataset=datasets.create(x).id, mode="trace", dtype="float64", tile_size=4)
        assert job.spec.memory_budget_bytes is None  # each GPU task plans for its own GPU
        deadline = time.monotonic() + 180
        while not (record := manager.get(job.id)).is_finished and time.monotonic() < deadline:
            time.sleep(0.1)
        assert record.status is JobStatus.SUCCEEDED, record.error
        _, placed = registry.load_module("m")
        expected = reference_ntk(copy.deepcopy(placed).cpu(), torch.from_numpy(x), mode="trace")
        assert_matches(torch.from_numpy(manager.read_result(job.id)), expected)
    finally:
        manager.stop()
        registry.close()
        datasets.close()
        ray.shutdown()
