"""The Ray executor: the same panels on long-lived Ray actors, on this machine or a Ray cluster (``NTK_EXECUTOR=ray``).

- Ray is imported only when this executor runs; without ``pip install 'ntk-service[ray]'`` the job fails with
  OptionalDependencyMissing saying so.
- ``ray.init(address=NTK_RAY_ADDRESS)`` connects to a cluster (``"auto"`` or ``"ray://head:10001"``); without an
  address a local Ray instance is started on first use. A Ray already initialised in this process is reused.
- NOTE [panel workers]: one actor per ``num_cpus`` CPUs of the cluster (per ``num_gpus`` GPUs), created on the first
  job and kept until ``close``. Each keeps the job's model, its problem pool
  (``kernels/runtime/problem_pool.py``: the model's set-up is done once per actor, not once per task) and its side
  cache. Per job run the data sets go to the object
  store once, as numpy arrays (which workers read zero-copy), the model once as a data-free module tree and its
  weights as numpy (``weights.py``: zero-copy too, one copy per node however many actors), and the JobWork once;
  a call carries their references (in a list, so Ray does not resolve them per call) and a panel description
  only, and an actor fetches them once per job. Panels of one band go to the actor that ran the band's first
  panel while it has room, so the band's side is built once, on one actor.
- A call computes its panel, writes its chunks to the job's Zarr array (the path must be on a filesystem every
  worker sees) and returns the outcome; the server records the panel's tiles when the call returns, never before.
- Fault tolerance: a dead actor process (an OOM kill) is restarted by Ray and its call retried
  (``max_retries``). The driver watches the actors' nodes once a second: an actor whose node is gone is dropped
  (Ray would restart it only where resources are free, and its calls would wait for that) and its panels go back
  in the queue for the actors that remain, as do those of an actor that died more often than ``max_retries``. A
  chunk written by a call that did not return is rewritten by the re-run, and only then recorded. (Re-runs by Ray
  or after a lost node are not counted as attempts in SQLite: the server claimed the panel once.)
- At most ``max_in_flight`` calls are out at once (two per actor by default), so cancellation stops the job within
  that many panels.
- ``num_gpus`` per actor (``NTK_RAY_NUM_GPUS``, fractions share a GPU) reserves a GPU and the actor computes on the
  GPU Ray assigned it (``assigned_device``): Ray sets CUDA_VISIBLE_DEVICES in the worker to the ids of
  ``ray.get_gpu_ids()``. An actor that was given a GPU but whose torch sees none fails the job saying so, instead
  of quietly running on the CPU. The model goes to the object store as a CPU copy; each actor moves it to its
  GPU once per job and only a panel's rows are moved per call.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ntk_service.errors import JobFailed, NtkServiceError, OptionalDependencyMissing, UnknownDevice
from ntk_service.jobs.executors.base import (
    Executor,
    JobWork,
    PanelCallbacks,
    PanelOutcome,
    default_side_cache_bytes,
    run_panel,
)
from ntk_service.jobs.executors.weights import pack_module, unpack_module
from ntk_service.jobs.panels import Panel
from ntk_service.kernels import (
    NtkOptions,
    SideCache,
    device_memory_budget,
    model_device,
    parse_device,
    place_module,
    retain_freed_memory,
)
from ntk_service.kernels.problem.batch import Batch

__all__ = ["DEFAULT_MAX_RETRIES", "PanelWorker", "RayExecutor", "assigned_device", "batch_as_numpy", "import_ray"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_RETRIES = 3
"""Restarts of an actor whose process died (an OOM kill), and retries of its call; Ray's default for tasks."""

_CALLS_PER_ACTOR = 2
"""Calls queued per actor: one computing, one waiting, so an actor never idles between panels."""

_WAIT_S = 1.0
"""How often the driver loop wakes to check for cancellation while tasks run."""

_REAP_GRACE_S = 1.0
"""After ``ray.shutdown()``, how long a process of the local Ray may take to exit before it gets SIGTERM (the
agents take up to a minute on their own, so waiting longer buys nothing)."""


def ray_init_address(address: str | None) -> str:
    """What to pass to ``ray.init``: ``address``, else the ``RAY_ADDRESS`` environment variable (set by ``ray job
    submit`` and by users), else "local", a new local instance. A bare ``ray.init()`` would also join a cluster
    that ``ray start`` left an address file for on this machine, not what "no address" promises here."""
    return address or os.environ.get("RAY_ADDRESS") or "local"


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


class PanelWorker:
    """The state of one long-lived Ray actor (NOTE [panel workers]); ``RayExecutor`` runs it with ``ray.remote``.

    Args:
        threads: torch threads (the CPUs the actor reserves).
        use_gpu: compute on the GPU Ray assigned the actor.
        allow_tf32: as for ``compute_ntk``.
        side_cache_bytes: the actor's SideCache size; None: a quarter of each job's memory budget.
    """

    def __init__(self, threads: int, use_gpu: bool, allow_tf32: bool, side_cache_bytes: int | None) -> None:
        torch.set_num_threads(max(1, threads))
        self.use_gpu, self.allow_tf32, self.side_cache_bytes = use_gpu, allow_tf32, side_cache_bytes
        self._job: tuple[str, nn.Module, Any, Any, JobWork, SideCache, NtkOptions] | None = None

    def ready(self) -> str:
        """The id of the actor's node, once it is constructed (the driver waits for this before sending panels,
        and watches that node: NOTE [panel workers])."""
        return str(import_ray().get_runtime_context().get_node_id())

    def run(self, refs: list[Any], panel: Panel, tile_ids: tuple[int, ...]) -> PanelOutcome:
        """Compute ``panel`` and write the chunks of ``tile_ids``.

        Args:
            refs: ``[job_id, model_ref, x1_ref, x2_ref or None, work_ref]`` (fetched once per job).
            panel: the panel. tile_ids: its tiles to write (those the server claimed).

        Returns:
            The PanelOutcome to record, its ``worker`` this actor's id.
        """
        job_id, model, x1, x2, work, cache, options = self._load(refs)
        tiles = tuple(t for t in panel.tiles if t.id in set(tile_ids))
        outcome = run_panel(model, x1, x2, work, panel, tiles, side_cache=cache, options=options)
        return dataclasses.replace(outcome, worker=str(import_ray().get_runtime_context().get_actor_id()))

    def _load(self, refs: list[Any]) -> tuple[str, nn.Module, Any, Any, JobWork, SideCache, NtkOptions]:
        job_id = str(refs[0])
        if self._job is not None and self._job[0] == job_id:
            return self._job
        self._job = None  # the previous job's model and data go before this job's arrive
        ray = import_ray()
        (skeleton, arrays), x1, work = ray.get([refs[1], refs[2], refs[4]])
        model = unpack_module(skeleton, arrays)  # weights viewing the object store (NOTE [read-only weights])
        x2 = None if refs[3] is None else ray.get(refs[3])
        device = assigned_device(ray.get_gpu_ids() if self.use_gpu else [], os.environ.get("CUDA_VISIBLE_DEVICES"))
        if device.type == "cpu":
            retain_freed_memory()  # as the server process does (NOTE [allocator])
        else:
            try:
                device = parse_device(device, operation="jobs: a Ray panel worker")
            except UnknownDevice as exc:
                raise JobFailed(
                    f"{exc.message}. Ray gave this worker a GPU (NTK_RAY_NUM_GPUS > 0) but torch in the worker "
                    "cannot use it: install a CUDA build of torch on the GPU nodes, or set NTK_RAY_NUM_GPUS=0"
                ) from None
            model = model.to(device)  # this actor's own deserialized copy: moving it is safe
        size = self.side_cache_bytes
        cache = SideCache(max_bytes=default_side_cache_bytes(work.spec.memory_budget_bytes) if size is None else size)
        options = work.spec.engine_options(device=device, allow_tf32=self.allow_tf32)  # once per job, not per panel
        self._job = (job_id, model, x1, x2, work, cache, options)
        return self._job


class RayExecutor(Executor):
    """Runs panels on long-lived Ray actors (NOTE [panel workers]).

    Args:
        address: Ray cluster address for ``ray.init`` (None: reuse an initialised Ray, else start a local one).
        num_cpus: CPUs reserved per actor (also its torch threads). Default: 1.
        num_gpus: GPUs reserved per actor; > 0 runs the panels on the CUDA device Ray assigns. Default: 0.
        allow_tf32: let float32 panels on CUDA use TF32 (NOTE [TF32] in kernels/runtime/device.py). Default: False.
        max_retries: restarts of an actor whose process died, and retries of its call. Default:
            ``DEFAULT_MAX_RETRIES``.
        max_in_flight: calls out at once. Default: ``_CALLS_PER_ACTOR`` per actor.
        actors: actors to run. Default: the cluster's CPUs divided by ``num_cpus`` (its GPUs divided by
            ``num_gpus`` when > 0), at least 1.
        side_cache_bytes: each actor's SideCache (``NTK_JOB_SIDE_CACHE_BYTES``). Default: None, a quarter of the
            job's memory budget.
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
        actors: int | None = None,
        side_cache_bytes: int | None = None,
    ) -> None:
        if actors is not None and actors < 1:
            raise ValueError(f"RayExecutor: actors must be ≥ 1, got {actors}")
        self.address = address
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.max_retries = max_retries
        self.max_in_flight = max_in_flight
        self.allow_tf32 = allow_tf32
        self.actors = actors
        self.side_cache_bytes = side_cache_bytes
        self._ray: Any = None
        self._owns_ray = False
        self._pool: list[Any] = []  # live actors, NOTE [panel workers]
        self._nodes: dict[Any, str] = {}  # actor -> the id of its node
        self._before_ray: set[int] = set()  # this process's children before it started a local Ray
        self._ray_pids: set[int] = set()  # the local Ray's processes seen so far (close reaps them)

    def memory_budget(self) -> int | None:
        """The host budget for CPU panels; None for GPU actors, so each plans for the GPU it is given (the driver
        cannot see the workers' GPUs)."""
        return None if self.num_gpus > 0 else device_memory_budget(torch.device("cpu"))

    def _connect(self) -> Any:
        if self._ray is None:
            ray = import_ray()
            if not ray.is_initialized():
                logger.info("jobs: connecting to Ray at %s", self.address or "a new local instance")
                self._before_ray = _descendants(os.getpid())
                ray.init(address=ray_init_address(self.address), include_dashboard=False, logging_level=logging.WARNING)
                self._owns_ray = True
                self._note_local_ray()
            self._ray = ray
        return self._ray

    def close(self) -> None:
        """Stop the actors, and disconnect from Ray if this executor connected (a local instance it started stops
        with it).

        ``ray.shutdown()`` stops the GCS and the raylet, but the raylet's agents (``ray::DashboardAgent``,
        ``ray::RuntimeEnvAgent``) only notice their parent is gone and exit up to a minute later, after this
        process may have ended (``tests/server/test_shutdown_ray.py`` saw them outlive the server). So the local
        instance's processes are noted (``_note_local_ray``) and any still alive ``_REAP_GRACE_S`` after the
        shutdown get SIGTERM, then SIGKILL.
        """
        if self._ray is not None:
            for actor in self._pool:
                try:
                    self._ray.kill(actor)
                except Exception:  # noqa: BLE001 - an actor already gone (its node lost) needs no kill
                    logger.debug("jobs: a Ray panel worker was already gone at close")
        self._pool, self._nodes = [], {}
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

    def parallelism(self) -> int:
        """The actors: those running, else the ``actors`` setting, else the cluster's when connected, else this
        host's CPUs over ``num_cpus`` (a guess before the first job connects)."""
        if self._pool:
            return len(self._pool)
        if self.actors is not None or self._ray is not None:
            return self._pool_size(self._ray)
        return max(1, int((os.cpu_count() or 1) / max(self.num_cpus, 0.001)))

    def _pool_size(self, ray: Any) -> int:
        if self.actors is not None:
            return self.actors
        resources = ray.cluster_resources()
        if self.num_gpus > 0:
            return max(1, int(float(resources.get("GPU", 0)) / self.num_gpus))
        return max(1, int(float(resources.get("CPU", 1)) / max(self.num_cpus, 0.001)))

    def _ensure_pool(self, ray: Any, should_stop: Callable[[], bool]) -> list[Any]:
        """The live actors, created (and waited for, until ``should_stop``) when there are none: on the first job,
        or after every actor was lost. Empty when told to stop before any was ready."""
        if not self._pool:
            remote = ray.remote(PanelWorker).options(
                num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                max_restarts=self.max_retries,
                max_task_retries=self.max_retries,
            )
            threads = max(1, int(self.num_cpus))
            self._pool = [
                remote.remote(threads, self.num_gpus > 0, self.allow_tf32, self.side_cache_bytes)
                for _ in range(self._pool_size(ray))
            ]
            waiting = {actor.ready.remote(): actor for actor in self._pool}
            while waiting:
                # Starting actors takes seconds on a busy machine: the local Ray's processes are noted meanwhile
                # (``close`` reaps them) and a shutdown does not wait for the actors to come up.
                ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=_WAIT_S)
                self._note_local_ray()
                for ref, node in zip(ready, ray.get(ready), strict=True):
                    self._nodes[waiting.pop(ref)] = node
                if waiting and should_stop():
                    for actor in waiting.values():  # the next job starts its own; these would count as lost
                        self._discard(ray, actor)
                    return []
        return self._pool

    def _discard(self, ray: Any, actor: Any) -> None:
        """Drop an actor from the pool and kill it for good (it holds a CPU, and close only kills the pool's)."""
        if actor in self._pool:
            self._pool.remove(actor)
        self._nodes.pop(actor, None)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone with its node
            logger.debug("jobs: a lost Ray panel worker could not be killed (gone already)")

    def _drop_lost(self, ray: Any) -> list[Any]:
        """Remove the actors whose node is gone from the pool and return them. Ray would restart them, but only
        where resources are free, and their calls would wait for that, possibly for ever."""
        alive = {str(node["NodeID"]) for node in ray.nodes() if node.get("Alive")}
        lost = [actor for actor in self._pool if self._nodes.get(actor) not in alive]
        for actor in lost:
            self._discard(ray, actor)
        return lost

    def run(
        self,
        work: JobWork,
        model: nn.Module,
        x1: Batch,
        x2: Batch | None,
        panels: Sequence[Panel],
        callbacks: PanelCallbacks,
    ) -> None:
        ray = self._connect()
        # Put once (NOTE [panel workers]): the data and the weights as numpy, which workers map zero-copy (the
        # weights of a CPU copy: a server computing on its GPU keeps its modules there; actors place them
        # themselves), the module tree without data, and the JobWork.
        shipped = model if model_device(model).type == "cpu" else place_module(model, torch.device("cpu"))
        refs = [
            f"{work.job_id}:{time.monotonic_ns()}",  # a new run of a job is a new load: its data may have changed
            ray.put(pack_module(shipped)),  # a data-free module tree and its weights as numpy (weights.py)
            ray.put(batch_as_numpy(x1)),
            None if x2 is None else ray.put(batch_as_numpy(x2)),
            ray.put(work),
        ]
        _Dispatch(self, ray, refs, callbacks).run(panels)
        logger.info("jobs: %s ran %d panel(s) on Ray", work.job_id, len(panels))


def batch_as_numpy(x: Batch) -> Any:
    """Every leaf of a batch as a numpy array (a tuple or mapping keeps its structure)."""
    if isinstance(x, tuple):
        return tuple(batch_as_numpy(leaf) for leaf in x)
    if isinstance(x, dict):
        return {name: batch_as_numpy(leaf) for name, leaf in x.items()}
    return x.detach().cpu().contiguous().numpy()


class _Dispatch:
    """One job run's driver loop: claim panels, send them to actors (a band to its actor), record the outcomes,
    put a lost actor's panels back (NOTE [panel workers])."""

    def __init__(self, executor: RayExecutor, ray: Any, refs: list[Any], callbacks: PanelCallbacks) -> None:
        self.executor, self.ray, self.refs, self.callbacks = executor, ray, refs, callbacks
        self.in_flight: dict[Any, tuple[Panel, tuple[int, ...], Any]] = {}
        self.load: dict[Any, int] = {}
        self.band_actor: dict[int, Any] = {}
        self.retry: list[tuple[Panel, tuple[int, ...]]] = []
        self.next_node_check = time.monotonic() + _WAIT_S

    def _window(self, actors: int) -> int:
        limit = self.executor.max_in_flight
        return max(1, limit) if limit is not None else _CALLS_PER_ACTOR * actors

    def _actor_for(self, panel: Panel, pool: list[Any]) -> Any:
        # The band's actor while it has room, else the least loaded one (which becomes the band's actor when the
        # band has none yet, or its actor was lost).
        owner = self.band_actor.get(panel.band)
        if owner in pool and self.load.get(owner, 0) < _CALLS_PER_ACTOR:
            return owner
        actor = min(pool, key=lambda a: self.load.get(a, 0))
        if owner not in pool:
            self.band_actor[panel.band] = actor
        return actor

    def _send(self, panel: Panel, tile_ids: tuple[int, ...], pool: list[Any]) -> None:
        actor = self._actor_for(panel, pool)
        ref = actor.run.remote(self.refs, panel, tile_ids)
        self.in_flight[ref] = (panel, tile_ids, actor)
        self.load[actor] = self.load.get(actor, 0) + 1

    def run(self, panels: Sequence[Panel]) -> None:
        ray, callbacks = self.ray, self.callbacks
        pending = list(reversed(panels))
        while pending or self.in_flight or self.retry:
            pool = self.executor._ensure_pool(ray, callbacks.should_stop)
            if not pool:
                break  # told to stop while the actors started: nothing was sent
            window = self._window(len(pool))
            while self.retry and len(self.in_flight) < window:
                self._send(*self.retry.pop(), pool)
            while pending and len(self.in_flight) < window and not callbacks.should_stop():
                panel = pending.pop()
                tiles = callbacks.claim(panel)
                if tiles:
                    self._send(panel, tuple(t.id for t in tiles), pool)
            if callbacks.should_stop():
                pending.clear()  # calls already out finish at their panel boundary and are recorded
            if not self.in_flight:
                if self.retry:
                    continue
                break
            ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=_WAIT_S)
            self.executor._note_local_ray()
            for ref in ready:
                self._collect(ref)
            if time.monotonic() >= self.next_node_check:
                self.next_node_check = time.monotonic() + _WAIT_S
                self._requeue(self.executor._drop_lost(ray))

    def _requeue(self, lost: list[Any]) -> None:
        """Put the panels out on ``lost`` actors back in the queue: they run again on the actors that remain."""
        for ref, (panel, tile_ids, actor) in list(self.in_flight.items()):
            if actor in lost:
                logger.warning("jobs: the node of a Ray panel worker was lost; panel %d runs again", panel.id)
                del self.in_flight[ref]
                self.retry.append((panel, tile_ids))

    def _collect(self, ref: Any) -> None:
        ray = self.ray
        panel, tile_ids, actor = self.in_flight.pop(ref)
        self.load[actor] -= 1
        try:
            outcome: PanelOutcome = ray.get(ref)
        except ray.exceptions.RayActorError:
            # The actor is gone for good (its node was lost, or it died more often than max_retries): its panel
            # runs again on the actors that remain; its chunks, if partly written, are rewritten before recorded.
            logger.warning("jobs: a Ray panel worker was lost; panel %d runs again elsewhere", panel.id)
            self.executor._discard(ray, actor)
            self._requeue([actor])
            self.retry.append((panel, tile_ids))
            return
        except Exception as exc:
            for other in self.in_flight:
                ray.cancel(other)
            raise _unwrap(exc, panel) from exc
        self.callbacks.done(outcome)


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


def _unwrap(exc: Exception, panel: Panel) -> Exception:
    """The domain error a call raised (Ray wraps it), else a JobFailed naming the panel."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, NtkServiceError):
        return cause
    return JobFailed(f"jobs: panel {panel.id} (rows {panel.rows}, cols {panel.cols}) failed on Ray: {exc}")
