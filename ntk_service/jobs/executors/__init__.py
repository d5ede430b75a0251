"""Executors of kernel job panels behind one interface (``base.Executor``): ``local`` (default) and ``ray``
(optional); and ``ray_operator``, the matrix-free kernel operator whose products run on Ray actors, one data shard
each.

``ray.py`` imports Ray only when a RayExecutor runs (or ``import_ray()`` is called), and ``ray_operator.py`` only
when ``ray_ntk_operator`` is called, so importing this package never needs the ``ntk-service[ray]`` extra.
"""

from __future__ import annotations

from ntk_service.jobs.executors.base import Executor, JobWork, PanelCallbacks, PanelOutcome
from ntk_service.jobs.executors.configured import executor_for
from ntk_service.jobs.executors.local import LocalExecutor
from ntk_service.jobs.executors.ray import RayExecutor, import_ray
from ntk_service.jobs.executors.ray_operator import RayNtkOperator, ray_ntk_operator

__all__ = [
    "Executor",
    "JobWork",
    "LocalExecutor",
    "PanelCallbacks",
    "PanelOutcome",
    "RayExecutor",
    "RayNtkOperator",
    "executor_for",
    "import_ray",
    "ray_ntk_operator",
]
