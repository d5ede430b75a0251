"""The Ray executor on a real two-node Ray cluster (``ray.cluster_utils.Cluster``: a head and a worker node, each a
raylet of its own on this machine): the worker node is killed mid-job, the job still succeeds with every tile and
equals compute_ntk. One Ray start for the module (about 6 s and 0.8 GB here)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ntk_service.jobs import JobManager, JobStatus
from ntk_service.jobs.executors import RayExecutor
from ntk_service.kernels import compute_ntk
from ntk_service.registry import DatasetStore, ModelRegistry
from tests.jobs.conftest import SLOW_MODEL, ray_test_environment, wait_finished
from tests.reference import reference_ntk

SLOW = "tests.server.slow_factory:build"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, Any]]:
    with ray_test_environment() as ray:
        cluster_utils = pytest.importorskip("ray.cluster_utils")
        built = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        worker = built.add_node(num_cpus=1)
        try:
            ray.init(address=built.address, log_to_driver=False)
            built.wait_for_nodes()
            yield built, worker
        finally:
            ray.shutdown()
            built.shutdown()


def test_a_job_survives_the_loss_of_a_worker_node(cluster: tuple[Any, Any], tmp_path: Path) -> None:
    built, worker = cluster
    registry = ModelRegistry(tmp_path, allowed_factories=frozenset({SLOW}))
    datasets = DatasetStore(tmp_path)
    slow = {**SLOW_MODEL, "kwargs": {**SLOW_MODEL["kwargs"], "delay_s": 0.2}}  # type: ignore[dict-item]
    registry.register("slow", slow, seed=0)
    x = np.random.default_rng(0).standard_normal((12, 4)).astype(np.float32)
    dataset = datasets.create(x).id
    executor = RayExecutor()  # one actor per CPU: one on the head, one on the worker node
    manager = JobManager(
        data_dir=tmp_path, models=registry, datasets=datasets, executor=executor, memory_budget_bytes=64 * 2**20
    )
    manager.start()
    try:
        job = manager.submit(
            model="slow", x1_dataset=dataset, mode="full", dtype="float64", tile_size=2, panel_tiles=1
        )  # 21 panels of a tile each
        deadline = time.monotonic() + 120
        while manager.get(job.id).tiles_done < 3:
            assert not manager.get(job.id).is_finished, manager.get(job.id).error
            assert time.monotonic() < deadline, "no 3 tiles in 120 s"
            time.sleep(0.05)
        nodes = set(executor._nodes.values())
        assert len(nodes) == 2 and worker.node_id in nodes  # an actor on each node: the worker node has work
        built.remove_node(worker, allow_graceful=False)
        lost_at = manager.get(job.id).tiles_done
        record = wait_finished(manager, job.id, timeout=180)
        assert record.status is JobStatus.SUCCEEDED, record.error
        assert lost_at < record.tiles_done == record.tiles_total == 21
        assert set(executor._nodes.values()) == nodes - {worker.node_id}  # the head's actor finished the job
        theta = manager.read_result(job.id)
        _, model = registry.load_module("slow")
        direct = compute_ntk(model, torch.from_numpy(x), mode="full", dtype="float64").theta.numpy()
        reference = reference_ntk(model, torch.from_numpy(x), mode="full").numpy()
    finally:
        manager.stop()
        registry.close()
        datasets.close()
    np.testing.assert_allclose(theta, direct, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(theta, reference, rtol=1e-10, atol=1e-12)
