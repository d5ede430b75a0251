"""Executors of job tiles behind one interface (``base.Executor``): ``local`` (default) and ``ray`` (optional).

``ray.py`` imports Ray only when a RayExecutor runs (or ``import_ray()`` is called), so importing this package
never needs the ``ntk-service[ray]`` extra.
"""

from __future__ import annotations

from ntk_service.jobs.executors.base import Executor, JobWork, PanelCallbacks, PanelOutcome
from ntk_service.jobs.executors.local import LocalExecutor
from ntk_service.jobs.executors.ray import RayExecutor, import_ray

__all__ = ["Executor", "JobWork", "LocalExecutor", "PanelCallbacks", "PanelOutcome", "RayExecutor", "import_ray"]
