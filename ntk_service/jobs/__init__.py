"""Batch kernel jobs: whole-data-set kernels in ragged tiles, resumable, with progress, local or on Ray.

- ``planner``: tiles (the storage chunks) with deterministic ids (only the upper triangle when x2 is omitted).
- ``panels``: panels (the work units: a band of rows against a run of columns), sized by the cost model.
- ``store``: job and tile state in SQLite (WAL).
- ``results``: the Zarr v3 result array, one chunk per tile; symmetric reads mirror the stored half.
- ``executors``: ``LocalExecutor`` (in-process, under the compute limiter) and ``RayExecutor``.
- ``manager``: ``JobManager`` (submit, get, list, cancel, resume, progress events).
"""

from ntk_service.jobs.executors.base import Executor
from ntk_service.jobs.executors.local import LocalExecutor
from ntk_service.jobs.manager import JobManager
from ntk_service.jobs.panels import Panel, plan_panels
from ntk_service.jobs.planner import DEFAULT_TILE_SIZE, Tile, TilePlan, plan_tiles
from ntk_service.jobs.records import JobRecord, JobSpec, JobStatus
from ntk_service.jobs.results import ResultArray
from ntk_service.jobs.store import JobStore

__all__ = [
    "DEFAULT_TILE_SIZE",
    "Executor",
    "JobManager",
    "JobRecord",
    "JobSpec",
    "JobStatus",
    "JobStore",
    "LocalExecutor",
    "Panel",
    "ResultArray",
    "Tile",
    "TilePlan",
    "plan_panels",
    "plan_tiles",
]
