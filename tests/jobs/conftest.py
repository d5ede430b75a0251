"""Fixtures of the job tests: a real registry and data-set store in a temporary data directory, a manager, and a
real local Ray instance."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.jobs import JobManager, JobRecord, LocalExecutor
from ntk_service.jobs.executors.base import Executor
from ntk_service.registry import DatasetStore, ModelRegistry
from tests.conftest import REPO_ROOT

TINY_MLP = {"family": "mlp", "input_dim": 4, "hidden": [6], "output_dim": 3, "activation": "tanh", "bias": True}
"""k = 3 outputs, P = 51: every tile takes milliseconds."""

SLOW_MODEL = {
    "family": "factory",
    "factory": "tests.server.slow_factory:build",
    "kwargs": {"in_dim": 4, "out_dim": 2, "delay_s": 0.03},
    "input_shape": [4],
    "input_dtype": "float32",
}
"""A model whose every forward pass sleeps: tiles take a known time, so a test can act while a job runs."""


def tiny_model_from_weights(weights: Mapping[str, Any]) -> nn.Module:
    """TINY_MLP rebuilt as a plain nn.Sequential from downloaded weights (``layers.{i}.weight/bias``)."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    names = {
        "0.weight": "layers.0.weight",
        "0.bias": "layers.0.bias",
        "2.weight": "layers.1.weight",
        "2.bias": "layers.1.bias",
    }
    model.load_state_dict({mine: torch.as_tensor(np.asarray(weights[theirs])) for mine, theirs in names.items()})
    return model


@dataclass
class JobsEnv:
    data_dir: Path
    registry: ModelRegistry
    datasets: DatasetStore
    x1: np.ndarray
    x2: np.ndarray
    x1_id: str
    x2_id: str


@pytest.fixture
def jobs_env(tmp_path: Path) -> Iterator[JobsEnv]:
    """A registry with model 'tiny' (TINY_MLP) and two float32 data sets: x1 (11, 4) and x2 (7, 4)."""
    registry = ModelRegistry(tmp_path)
    datasets = DatasetStore(tmp_path)
    registry.register("tiny", TINY_MLP, seed=0)
    rng = np.random.default_rng(0)
    x1 = rng.standard_normal((11, 4)).astype(np.float32)
    x2 = rng.standard_normal((7, 4)).astype(np.float32)
    env = JobsEnv(tmp_path, registry, datasets, x1, x2, datasets.create(x1).id, datasets.create(x2).id)
    yield env
    registry.close()
    datasets.close()


@pytest.fixture
def make_manager(jobs_env: JobsEnv) -> Iterator[Callable[..., JobManager]]:
    """Build (and start) JobManagers over ``jobs_env``; all are stopped after the test."""
    managers: list[JobManager] = []

    def make(executor: Executor | None = None, *, start: bool = True, **options: object) -> JobManager:
        manager = JobManager(
            data_dir=jobs_env.data_dir,
            models=jobs_env.registry,
            datasets=jobs_env.datasets,
            executor=executor or LocalExecutor(),
            memory_budget_bytes=64 * 2**20,
            **options,  # type: ignore[arg-type]
        )
        if start:
            manager.start()
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.stop()


def wait_finished(manager: JobManager, job_id: str, timeout: float = 60.0) -> JobRecord:
    """Poll until the job is finished; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = manager.get(job_id)
        if record.is_finished:
            return record
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} not finished after {timeout} s: {manager.get(job_id)}")


@contextmanager
def ray_test_environment() -> Iterator[Any]:
    """The ``ray`` module (the test is skipped without it), with the environment Ray's workers need while it is
    entered: usage stats off, and ``PYTHONPATH`` naming the repository root, since workers unpickle the tests'
    factory models and import ``ntk_service`` from this checkout."""
    ray = pytest.importorskip("ray", reason="the Ray executor needs the ntk-service[ray] extra")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        yield ray


@pytest.fixture(scope="module")
def ray_cpus() -> float:
    """The CPUs of a module's local Ray instance; a test module overrides this fixture to get another count."""
    return 2


@pytest.fixture(scope="module")
def ray_instance(ray_cpus: float) -> Iterator[Any]:
    """A local Ray instance of ``ray_cpus`` CPUs, shared by a test module and shut down after it."""
    with ray_test_environment() as ray:
        # "local": its own instance, even while another test file's `ray start` cluster runs (xdist workers)
        ray.init(address="local", num_cpus=ray_cpus, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
