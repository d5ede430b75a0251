"""The executor a service's settings configure (``NTK_EXECUTOR``): built once, in the server's lifespan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ntk_service.config import Settings
from ntk_service.jobs.executors.base import Executor
from ntk_service.jobs.executors.local import LocalExecutor
from ntk_service.jobs.executors.ray import RayExecutor, import_ray

__all__ = ["executor_for"]


def executor_for(settings: Settings, *, run_compute: Callable[[Callable[[], Any]], Any]) -> Executor:
    """The executor ``settings.executor`` names (``NTK_EXECUTOR``), configured from the settings.

    Args:
        settings: the service's settings (executor, Ray address and GPUs, device, TF32, side cache size).
        run_compute: what runs each local panel (the server's compute slot); Ray actors have their own CPUs.

    Raises:
        OptionalDependencyMissing: "ray" without Ray installed (with the install command), at startup rather
            than on the first job.
    """
    if settings.executor == "ray":
        import_ray()
        return RayExecutor(
            address=settings.ray_address,
            num_gpus=settings.ray_num_gpus,
            allow_tf32=settings.allow_tf32,
            side_cache_bytes=settings.job_side_cache_bytes,
        )
    return LocalExecutor(
        run_compute=run_compute,
        device=settings.device,
        allow_tf32=settings.allow_tf32,
        side_cache_bytes=settings.job_side_cache_bytes,
    )
