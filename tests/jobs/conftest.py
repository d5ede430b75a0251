"""Fixtures of the job tests: a real registry and data-set store in a temporary data directory, and a manager."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from ntk_service.jobs import JobManager, JobRecord, LocalExecutor
from ntk_service.jobs.executors.base import Executor
from ntk_service.registry import DatasetStore, ModelRegistry

TINY_MLP = {"family": "mlp", "input_dim": 4, "hidden": [6], "output_dim": 3, "activation": "tanh", "bias": True}
"""k = 3 outputs, P = 51: every tile takes milliseconds."""


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
