"""Jobs: work on whole data sets, in units recorded as they finish, resumable, with progress, local or on Ray.

- ``records``: a job as stored (``JobRecord``: its kind, typed spec, status, checkpoint, result) and the kernel
  job's spec (``JobSpec``).
- ``kinds``: the job kinds, a plan/run/result module each, in one table (``JOB_KINDS``): kernel, solve, features.
- ``store``: jobs of every kind and their tiles in one SQLite file (WAL); ``migrations``: the stores of earlier
  versions.
- ``manager``: ``JobManager``, one lifecycle for every kind (submit, run, progress events, cancel, delete, disk
  accounting, resume); ``runner``: its runner threads, one per kind; ``activity``: what this process is doing with
  its jobs (runs, live progress, reads, change counters); ``disk``: the shared disk budget.
- ``planner`` / ``panels``: a kernel job's tiles (the storage chunks) and panels (its work units).
- ``results``: the Zarr v3 result array of a kernel job, one chunk per tile; symmetric reads mirror the stored half.
- ``executors``: ``LocalExecutor`` (in-process, under the compute limiter) and ``RayExecutor``, for kernel panels.
- ``solve_job`` / ``features_job``: what a solve and a features job compute.
"""

from ntk_service.jobs.executors.base import Executor
from ntk_service.jobs.executors.local import LocalExecutor
from ntk_service.jobs.kinds import JOB_KINDS, JobKind
from ntk_service.jobs.manager import JobManager
from ntk_service.jobs.panels import Panel, plan_panels
from ntk_service.jobs.planner import DEFAULT_TILE_SIZE, Tile, TilePlan, plan_tiles
from ntk_service.jobs.records import JobRecord, JobSpec, JobStatus
from ntk_service.jobs.results import ResultArray
from ntk_service.jobs.store import JobStore

__all__ = [
    "DEFAULT_TILE_SIZE",
    "JOB_KINDS",
    "Executor",
    "JobKind",
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
