"""The Ray executor: the same tiles as Ray tasks, on this machine or a Ray cluster (``NTK_EXECUTOR=ray``).

- Ray is imported only when this executor runs; without ``pip install 'ntk-service[ray]'`` the job fails with
  OptionalDependencyMissing saying so.
- ``ray.init(address=NTK_RAY_ADDRESS)`` connects to a cluster (``"auto"`` or ``"ray://head:10001"``); without an
  address a local Ray instance is started on first use. A Ray already initialised in this process is reused.
- The model and the data sets are put in the object store once per job run; every task gets the references.
- One task per tile: it computes the block, writes its chunk to the job's Zarr array (the path must be on a
  filesystem every worker sees) and returns the outcome; the server records the tile as done when the task
  returns. Tasks go out in plan order, so a worker often meets a row or column block again and reuses its
  per-side intermediates from its per-process SideCache (NOTE [worker cache]).
- ``max_retries`` re-runs a task whose worker died (Ray's default is 3); an exception inside a task is not
  retried and fails the job with its message.
- At most ``max_in_flight`` tasks are submitted at once, so cancellation stops the job within that many tiles and a
  10k-tile job does not flood the scheduler.
- ``num_gpus`` per task (``NTK_RAY_NUM_GPUS``, fractions share a GPU) reserves a GPU and the task computes on the
  GPU Ray assigned it (``assigned_device``): Ray sets CUDA_VISIBLE_DEVICES in the worker to the ids of
  ``ray.get_gpu_ids()``. A task that was given a GPU but whose torch sees none fails the job saying so, instead
  of quietly running on the CPU. The model goes to the object store as a CPU copy; each worker moves it to its
  GPU once per model version (NOTE [worker cache]) and only a tile's rows are moved per task.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ntk_service.errors import JobFailed, NtkServiceError, OptionalDependencyMissing, UnknownDevice
from ntk_service.jobs.executors.base import Executor, JobWork, TileCallbacks, TileOutcome, run_tile
from ntk_service.jobs.executors.local import DEFAULT_JOB_SIDE_CACHE_BYTES
from ntk_service.jobs.planner import Tile
from ntk_service.kernels import (
    SideCache,
    device_memory_budget,
    model_device,
    parse_device,
    place_module,
    retain_freed_memory,
)
from ntk_service.kernels.inputs import Batch

__all__ = ["DEFAULT_MAX_RETRIES", "RayExecutor", "assigned_device", "import_ray"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_RETRIES = 3
"""Re-runs of a task whose worker process died (OOM kill, node loss); Ray's own default."""

_WAIT_S = 1.0
"""How often the driver loop wakes to check for cancellation while tasks run."""

_REAP_GRACE_S = 1.0
"""After ``ray.shutdown()``, how long a process of the local Ray may take to exit before it gets SIGTERM (the
agents take up to a minute on their own, so waiting longer buys nothing)."""


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        OptionalDependencyMissing: ray is not installed; the message says how to install it.
    """
    # NOTE [Ray's failure signal handler]: the Ray core worker of a driver installs absl's failure signal handler,
    # for SIGTERM too: on SIGTERM it dumps a stack, forwards the signal to uvicorn's handler and arms an alarm that
    # aborts the process (exit -6) 3 s later, in the middle of the graceful shutdown (test_shutdown_ray.py). Ray reads
    # the switch once, when it is imported, so it is set for that import only (an operator's own setting wins); the
    # raylet and the workers it starts keep Ray's default, and with it their crash stacks.
    first_import = "ray" not in sys.modules and "RAY_DISABLE_FAILURE_SIGNAL_HANDLER" not in os.environ
    if first_import:
        os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise OptionalDependencyMissing(
            "jobs: the Ray executor (NTK_EXECUTOR=ray) needs Ray, which is not installed; "
            "install it with pip install 'ntk-service[ray]', or use NTK_EXECUTOR=local"
        ) from exc
    finally:
        if first_import:
            del os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"]


_worker_side_cache: SideCache | None = None
"""The side cache of this Ray worker process, see NOTE [worker cache]."""


def _worker_cache() -> SideCache:
    # NOTE [worker cache]: a Ray worker process has no lifespan to hang objects on, so its SideCache is a module
    # global, created on the worker's first tile. Keys name the weights and data content (and the row range), so
    # tiles of any job on this worker share it safely; a tile's bits do not depend on hits or misses.
    global _worker_side_cache
    if _worker_side_cache is None:
        _worker_side_cache = SideCache(max_bytes=DEFAULT_JOB_SIDE_CACHE_BYTES)
    return _worker_side_cache


_WORKER_MODELS = 2
"""Models a Ray worker keeps on its GPU (NOTE [worker cache]): the current job's and one more."""

_worker_models: OrderedDict[tuple[str, str], nn.Module] = OrderedDict()


def _worker_model(model: nn.Module, weights_sha256: str, device: torch.device) -> nn.Module:
    # NOTE [worker cache] too: the model moved to this worker's GPU once per version; keyed by the weights' hash.
    if device.type == "cpu":
        return model
    key = (weights_sha256, str(device))
    placed = _worker_models.get(key)
    if placed is None:
        placed = _worker_models[key] = model.to(device)  # the task's own deserialized copy: moving it is safe
        while len(_worker_models) > _WORKER_MODELS:
            _worker_models.popitem(last=False)
    _worker_models.move_to_end(key)
    return placed


def assigned_device(gpu_ids: Sequence[int | str], visible_devices: str | None) -> torch.device:
    """The CUDA device of the first GPU Ray assigned a task, or the CPU when it assigned none.

    Args:
        gpu_ids: ``ray.get_gpu_ids()`` in the task.
        visible_devices: the worker's CUDA_VISIBLE_DEVICES, which Ray sets to the assigned ids (so the GPU is
            ``cuda:<its position there>``); None or empty when Ray leaves it alone (then the id is the index).

    Raises:
        JobFailed: an assigned id that is neither listed in CUDA_VISIBLE_DEVICES nor an index.
    """
    if not gpu_ids:
        return torch.device("cpu")
    first = str(gpu_ids[0])
    order = [v.strip() for v in (visible_devices or "").split(",") if v.strip()]
    if first in order:
        return torch.device("cuda", order.index(first))
    if first.isdigit() and not order:
        return torch.device("cuda", int(first))
    raise JobFailed(
        f"jobs: Ray assigned GPU {first!r} to a tile but CUDA_VISIBLE_DEVICES is {visible_devices!r}; "
        "let Ray manage CUDA_VISIBLE_DEVICES in its workers"
    )


def _tile_task(
    model: nn.Module,
    x1: Batch,
    x2: Batch | None,
    work: JobWork,
    tile: Tile,
    threads: int,
    use_gpu: bool,
    allow_tf32: bool = False,
) -> TileOutcome:
    # Runs in a Ray worker: one torch thread per reserved CPU, so tasks sharing a node do not oversubscribe it.
    torch.set_num_threads(max(1, threads))
    device = assigned_device(import_ray().get_gpu_ids() if use_gpu else [], os.environ.get("CUDA_VISIBLE_DEVICES"))
    if device.type == "cpu":
        retain_freed_memory()  # as the server process does (NOTE [allocator]); once per worker process
    else:
        try:
            device = parse_device(device, operation="jobs: a Ray tile task")
        except UnknownDevice as exc:
            raise JobFailed(
                f"{exc.message}. Ray gave this task a GPU (NTK_RAY_NUM_GPUS > 0) but torch in the worker cannot "
                "use it: install a CUDA build of torch on the GPU nodes, or set NTK_RAY_NUM_GPUS=0"
            ) from None
        model = _worker_model(model, work.spec.weights_sha256, device)
    return run_tile(model, x1, x2, work, tile, side_cache=_worker_cache(), device=device, allow_tf32=allow_tf32)


class RayExecutor(Executor):
    """Runs tiles as Ray tasks.

    Args:
        address: Ray cluster address for ``ray.init`` (None: reuse an initialised Ray, else start a local one).
        num_cpus: CPUs reserved per task (also its torch threads). Default: 1.
        num_gpus: GPUs reserved per task; > 0 runs the tile on the CUDA device Ray assigns. Default: 0.
        allow_tf32: let float32 tiles on CUDA use TF32 (NOTE [TF32] in kernels/device.py). Default: False.
        max_retries: retries of a task whose worker died. Default: ``DEFAULT_MAX_RETRIES``.
        max_in_flight: tasks submitted at once. Default: twice the cluster's CPUs divided by ``num_cpus``.
    """

    name = "ray"

    def __init__(
        self,
        *,
        address: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_in_flight: int | None = None,
        allow_tf32: bool = False,
    ) -> None:
        self.address = address
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.max_retries = max_retries
        self.max_in_flight = max_in_flight
        self.allow_tf32 = allow_tf32
        self._ray: Any = None
        self._owns_ray = False
        self._before_ray: set[int] = set()  # this process's children before it started a local Ray
        self._ray_pids: set[int] = set()  # the local Ray's processes seen so far (close reaps them)

    def memory_budget(self) -> int | None:
        """The host budget for CPU tasks; None for GPU tasks, so each plans for the GPU it is given (the driver
        cannot see the workers' GPUs)."""
        return None if self.num_gpus > 0 else device_memory_budget(torch.device("cpu"))

    def _connect(self) -> Any:
        if self._ray is None:
            ray = import_ray()
            if not ray.is_initialized():
                logger.info("jobs: connecting to Ray at %s", self.address or "a new local instance")
                self._before_ray = _descendants(os.getpid())
                ray.init(address=self.address, include_dashboard=False, logging_level=logging.WARNING)
                self._owns_ray = True
            self._ray = ray
        return self._ray

    def close(self) -> None:
        """Disconnect from Ray if this executor connected (a local instance it started stops with it).

        ``ray.shutdown()`` stops the GCS and the raylet, but the raylet's agents (``ray::DashboardAgent``,
        ``ray::RuntimeEnvAgent``) only notice their parent is gone and exit up to a minute later, after this
        process may have ended (``tests/server/test_shutdown_ray.py`` saw them outlive the server). So the local
        instance's processes are noted (``_note_local_ray``) and any still alive ``_REAP_GRACE_S`` after the
        shutdown get SIGTERM, then SIGKILL.
        """
        if self._ray is not None and self._owns_ray:
            self._note_local_ray()
            raylets = {pid for pid in self._ray_pids if "raylet" in _command(pid)}
            self._ray.shutdown()
            ours = {pid for pid in self._ray_pids if "ray" in _command(pid)}  # not reused by another program since
            _reap(ours | _children_of_raylets(raylets), grace_s=_REAP_GRACE_S)
        self._ray, self._owns_ray, self._ray_pids = None, False, set()

    def _note_local_ray(self) -> None:
        """Add the local Ray's processes (this process's descendants that were not there before ``ray.init`` and
        run Ray's code) to those ``close`` reaps. Noted while jobs run as well as at the end, so a process that is
        re-parented before ``close`` (its raylet gone first) is still known then."""
        if self._owns_ray:
            found = _descendants(os.getpid()) - self._before_ray
            self._ray_pids |= {pid for pid in found if "ray" in _command(pid)}

    def _window(self, ray: Any) -> int:
        if self.max_in_flight is not None:
            return max(1, self.max_in_flight)
        cpus = float(ray.cluster_resources().get("CPU", 1))
        return max(1, int(2 * cpus / max(self.num_cpus, 0.001)))

    def run(
        self,
        work: JobWork,
        model: nn.Module,
        x1: Batch,
        x2: Batch | None,
        tiles: Sequence[Tile],
        callbacks: TileCallbacks,
    ) -> None:
        ray = self._connect()
        # Put once: every task receives references to the same objects instead of its own copy. The model goes as
        # a CPU copy (a server computing on its GPU keeps its modules there); workers place it themselves.
        shipped = model if model_device(model).type == "cpu" else place_module(model, torch.device("cpu"))
        model_ref, x1_ref = ray.put(shipped), ray.put(x1)
        x2_ref = None if x2 is None else ray.put(x2)
        remote = ray.remote(_tile_task).options(
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
            max_retries=self.max_retries,
            retry_exceptions=False,
        )
        threads = max(1, int(self.num_cpus))
        pending = list(reversed(tiles))
        in_flight: dict[Any, Tile] = {}
        window = self._window(ray)
        started = time.perf_counter()
        while pending or in_flight:
            while pending and len(in_flight) < window and not callbacks.should_stop():
                tile = pending.pop()
                if callbacks.claim(tile):
                    use_gpu = self.num_gpus > 0
                    ref = remote.remote(model_ref, x1_ref, x2_ref, work, tile, threads, use_gpu, self.allow_tf32)
                    in_flight[ref] = tile
            if callbacks.should_stop():
                pending.clear()  # tasks already running finish at their tile boundary and are recorded
            if not in_flight:
                break
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=_WAIT_S)
            self._note_local_ray()
            for ref in ready:
                tile = in_flight.pop(ref)
                try:
                    outcome: TileOutcome = ray.get(ref)
                except Exception as exc:
                    for other in in_flight:
                        ray.cancel(other)
                    raise _unwrap(exc, tile) from exc
                callbacks.done(outcome)
        logger.info("jobs: %s ran %d tile(s) on Ray in %.1f s", work.job_id, len(tiles), time.perf_counter() - started)


def _descendants(root: int) -> set[int]:
    """The pids of ``root``'s live descendants (Linux ``/proc``; elsewhere none are found)."""
    children: dict[int, set[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile, or not a process entry
        children.setdefault(parent, set()).add(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), set()) - found:
            found.add(child)
            todo.append(child)
    return found


def _children_of_raylets(raylets: set[int]) -> set[int]:
    """Live Ray processes started by one of ``raylets`` (their ``RAY_RAYLET_PID``), wherever they were re-parented."""
    if not raylets:
        return set()
    marks = {f"RAY_RAYLET_PID={pid}".encode() for pid in raylets}
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environment = set((entry / "environ").read_bytes().split(b"\0"))
            if marks & environment and _command(int(entry.name)).startswith("ray::"):
                found.add(int(entry.name))
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return found


def _command(pid: int) -> str:
    """The command line of ``pid`` ("" when it has exited)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the pid was reused by someone else's process: not ours any more
        return False
    return True


def _reap(pids: set[int], *, grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``pids`` to exit; SIGTERM, then SIGKILL, those still alive."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 1.0), (signal.SIGKILL, 1.0)):
        left = {pid for pid in pids if _alive(pid)}
        if not left:
            return
        if sig is not None:
            logger.info("jobs: %s to %d process(es) the local Ray left behind", sig.name, len(left))
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_alive(pid) for pid in left):
            time.sleep(0.05)


def _unwrap(exc: Exception, tile: Tile) -> Exception:
    """The domain error a task raised (Ray wraps it), else a JobFailed naming the tile."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, NtkServiceError):
        return cause
    return JobFailed(f"jobs: tile {tile.id} (rows {tile.rows}, cols {tile.cols}) failed on Ray: {exc}")
