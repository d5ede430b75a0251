"""Executors of job tiles behind one interface (``base.Executor``): ``local`` (default) and ``ray`` (optional).

``make_executor(name, ...)`` builds the one the configuration names; the Ray module is imported only for "ray".
"""

from __future__ import annotations

from typing import Any

from ntk_service.errors import InvalidInput
from ntk_service.jobs.executors.base import Executor, JobWork, TileCallbacks, TileOutcome
from ntk_service.jobs.executors.local import LocalExecutor

__all__ = ["EXECUTORS", "Executor", "JobWork", "LocalExecutor", "TileCallbacks", "TileOutcome", "make_executor"]

EXECUTORS = ("local", "ray")
"""Executor names accepted by ``NTK_EXECUTOR``."""


def make_executor(name: str, **options: Any) -> Executor:
    """The executor called ``name`` ("local" or "ray"), built with ``options`` (its constructor's arguments).

    Raises:
        InvalidInput: an unknown name.
    """
    if name == "local":
        return LocalExecutor(**options)
    if name == "ray":
        from ntk_service.jobs.executors.ray import RayExecutor  # ray.py itself imports Ray only when run

        return RayExecutor(**options)
    raise InvalidInput(f"jobs: unknown executor {name!r}; NTK_EXECUTOR must be one of {', '.join(EXECUTORS)}")
