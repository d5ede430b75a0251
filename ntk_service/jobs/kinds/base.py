"""What a job kind is: a plan/run/result module behind one small interface, run by the one lifecycle
(``jobs/manager.py``).

A kind says how to turn a request into a resolved spec and the tiles it will record (``plan``), how to run it
(``run``: claim tiles, compute each under a compute slot, record them, report progress, stop when told), and how to
store its typed values (``encode_*`` / ``decode_*``: the store serialises them once, at its boundary). Everything
else (the queue, status changes, progress events, cancel, delete, disk accounting, resume after a crash) is the
manager's and the same for every kind.

NOTE [kind resume]
    What a kind records as done is never computed again: a resumed run claims only the tiles not done (a kernel's
    tiles, a chunk of features' rows) or goes on from its last ``RunContext.checkpoint`` (a solve's state after a
    segment, written to its folder before the checkpoint is recorded). Each kind computes a unit with the same
    arguments whether or not it resumed, so a resumed job's result is bitwise equal to an uninterrupted run's
    (NOTE [resume] in manager.py for tiles, NOTE [solve resume] in kinds/solve.py for a solver's state).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast, get_args, get_origin

import numpy as np
from torch import nn

from ntk_service.jobs.executors.base import Executor
from ntk_service.jobs.records import JobRecord

__all__ = [
    "DatasetSource",
    "JobKind",
    "JobLookup",
    "JobSettings",
    "JobStopped",
    "Layout",
    "ModelSource",
    "PlanContext",
    "RunCompute",
    "RunContext",
    "direct",
]

RequestT = TypeVar("RequestT")
SpecT = TypeVar("SpecT")
ProgressT = TypeVar("ProgressT")
ResultT = TypeVar("ResultT")
ProgressIn = TypeVar("ProgressIn", contravariant=True)
T = TypeVar("T")

RunCompute = Callable[[Callable[[], T]], T]
"""Runs one unit of computation under the server's compute limiter and returns its result (``direct`` without a
server)."""


def direct(fn: Callable[[], T]) -> T:
    """The RunCompute of a process without a compute limiter: call ``fn`` here."""
    return fn()


class JobStopped(Exception):  # noqa: N818 - a signal, not an error: the run was told to stop
    """Raised by a kind's ``run`` when ``RunContext.should_stop()`` turned true mid-run (cancel or server stop); the
    manager decides what follows (cancelled, or resumed at the next start). Never leaves the job engine."""


class ModelSource(Protocol):
    """What jobs need of the model registry."""

    def load_module(self, name: str, version: int | None = None) -> tuple[Any, nn.Module]: ...


class DatasetSource(Protocol):
    """What jobs need of the data-set store: records with ``shape`` and ``sha256`` (and ``arrays``, each with
    ``name``/``shape``, for named arrays), rows as an array or a dict of named arrays, the ids check, and the path
    of a data set's ``.npy`` (read through a memory map)."""

    def get(self, dataset_id: str) -> Any: ...

    def load(
        self, dataset_id: str, start: int | None = None, stop: int | None = None
    ) -> np.ndarray | dict[str, np.ndarray]: ...

    def first_out_of_range(
        self, dataset_id: str, array: str, size: int, start: int, stop: int
    ) -> tuple[int, int] | None: ...

    def path(self, dataset_id: str) -> Path: ...


@dataclass(frozen=True, slots=True)
class JobSettings:
    """The service's job settings every kind's plan may read.

    Attributes:
        default_tile_size: tile side of a kernel job that names none (``NTK_JOB_TILE_SIZE``).
        panel_seconds: the work a kernel job's panel targets (``NTK_JOB_PANEL_SECONDS``).
        memory_budget_bytes: the engine's budget per unit of work, fixed into each job at submission; None: the
            executor's device's default at submission (``NTK_MEMORY_BUDGET_BYTES``).
    """

    default_tile_size: int
    panel_seconds: float
    memory_budget_bytes: int | None = None


class JobLookup(Protocol):
    """What a kind may read of other jobs: the results its jobs consume (an attribution job scores with the
    features its features jobs stored). The manager is one."""

    def succeeded(self, job_id: str, kind: JobKind[Any, Any, Any, Any]) -> tuple[JobRecord[Any, Any, Any], Path]:
        """A succeeded job of ``kind`` and its result folder.

        Raises:
            JobNotFound, ResultNotFound (404). JobNotFinished (409): it has not succeeded.
        """
        ...

    def reading(self, job_id: str) -> AbstractContextManager[None]:
        """For the ``with`` block, the job's result is being read: deleting it is refused (409) until it ends."""
        ...


@dataclass(frozen=True, slots=True)
class PlanContext:
    """What a kind's ``plan`` reads: the registry, the data sets, the executor (its device's memory budget and its
    parallelism size kernel panels), the settings, and the other jobs (``JobLookup``)."""

    models: ModelSource
    datasets: DatasetSource
    executor: Executor
    settings: JobSettings
    jobs: JobLookup

    def memory_budget(self) -> int | None:
        """The budget fixed into a job: the configured one, else the executor's device's default now."""
        configured = self.settings.memory_budget_bytes
        return configured if configured is not None else self.executor.memory_budget()


@dataclass(frozen=True, slots=True)
class Layout:
    """What a planned job will store: its tiles (the units it records as done), its result's shape and size, and
    how to say so when the disk budget refuses it.

    Attributes:
        tile_ids: the ids of the tiles, each recorded once done.
        result_shape: the shape of the whole result. estimate_bytes: its size on disk when complete.
        what: the result in words, for the disk message ("the result", "Φ (12, 3, 512) in float32").
        note: said after the size ("(already only the upper triangle)"), or "". fix: what to change instead.
    """

    tile_ids: tuple[int, ...]
    result_shape: tuple[int, ...]
    estimate_bytes: int
    what: str
    fix: str
    note: str = ""


class RunContext(Protocol[ProgressIn]):
    """What a running job may do; the manager gives one to ``JobKind.run`` (all methods thread-safe).

    Attributes:
        job_id: the job. folder: its result folder (created). models, datasets, executor, jobs: as at planning.
    """

    job_id: str
    folder: Path
    models: ModelSource
    datasets: DatasetSource
    executor: Executor
    jobs: JobLookup

    def run_compute(self, fn: Callable[[], T]) -> T:
        """Run one unit of computation under a compute slot (the server's limiter; directly without one)."""
        ...

    def claim(self, tile_ids: Sequence[int]) -> list[int]:
        """Mark the tiles not done running and count their attempt (one transaction); returns those claimed, in
        the order given (empty: all done, or the run was given up by a stop)."""
        ...

    def done(self, tile_ids: Sequence[int], *, elapsed_s: float) -> None:
        """Record claimed tiles as done (one transaction), after what they stand for is written."""
        ...

    def pending(self) -> list[int]:
        """The ids of the tiles not done, in id order."""
        ...

    def report(self, progress: ProgressIn) -> None:
        """Publish live progress (events, GET); not written to the store."""
        ...

    def checkpoint(self, progress: ProgressIn) -> None:
        """Record progress in the store: what a resumed run starts from (write the kind's own state first)."""
        ...

    def used(self, names: Sequence[str]) -> None:
        """Record what the engine's AUTO choices resolved to (``JobRecord.implementation_used``)."""
        ...

    def should_stop(self) -> bool:
        """True once the job is cancelled or the server stops: start no further unit (raise ``JobStopped``)."""
        ...


class _StoredSpec(Protocol):
    """A spec's stored form: ``to_dict()``, read back by its class's ``from_dict``."""

    def to_dict(self) -> dict[str, Any]: ...


class _StoredValue(Protocol):
    """A progress value's or a result summary's stored form: ``to_json()``, read back by ``from_json``."""

    def to_json(self) -> dict[str, Any]: ...


class JobKind(ABC, Generic[RequestT, SpecT, ProgressT, ResultT]):
    """A kind of job: its names, its typed values' stored form, and plan / run / result.

    Attributes:
        name: the kind stored with each job ("solve"). noun: how messages name a job of it ("solve job").
        operation: how messages start ("solve job"). route: where users list it ("/v1/solve-jobs").
        folder: the subfolder of the results directory holding its jobs' folders ("" for the directory itself).
        request_type: the typed request its ``plan`` takes (``JobManager.create`` dispatches on it).
        uses_executor: its runs hand units to the manager's executor (local or Ray) rather than run in-process.
        spec_type, progress_type, result_type: its typed values (None: it records no progress value / no result
            summary).

    The four types are read from the class's parameters, ``JobKind[Request, Spec, Progress, Result]`` (None for
    no progress value or no result summary), unless its body sets them.
    """

    name: ClassVar[str]
    noun: ClassVar[str]
    operation: ClassVar[str]
    route: ClassVar[str]
    folder: ClassVar[str] = ""
    request_type: ClassVar[type]
    uses_executor: ClassVar[bool] = False
    spec_type: ClassVar[Any]
    progress_type: ClassVar[Any] = None
    result_type: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            if get_origin(base) is JobKind:
                names = ("request_type", "spec_type", "progress_type", "result_type")
                for name, value in zip(names, get_args(base), strict=True):
                    if name not in cls.__dict__:
                        setattr(cls, name, None if value is type(None) else value)

    # -- the store's boundary ---------------------------------------------------------------------------------------
    # Each typed value writes its stored (JSON) form (``to_dict`` for a spec, ``to_json`` for progress and results)
    # and reads it back, of this version or an earlier one (``from_dict`` / ``from_json``); a kind names the types.

    def encode_spec(self, spec: SpecT) -> dict[str, Any]:
        """The spec's stored (JSON) form."""
        return cast(_StoredSpec, spec).to_dict()

    def decode_spec(self, data: dict[str, Any]) -> SpecT:
        """The spec from its stored form."""
        spec: SpecT = self.spec_type.from_dict(data)
        return spec

    def encode_progress(self, progress: ProgressT) -> dict[str, Any]:
        """The progress value's stored form."""
        return cast(_StoredValue, progress).to_json()

    def decode_progress(self, data: dict[str, Any]) -> ProgressT | None:
        """The progress value from its stored form (None for a kind that records none)."""
        return None if self.progress_type is None else self.progress_type.from_json(data)

    def encode_result(self, result: ResultT) -> dict[str, Any]:
        """The result summary's stored form."""
        return cast(_StoredValue, result).to_json()

    def decode_result(self, data: dict[str, Any]) -> ResultT | None:
        """The result summary from its stored form (None for a kind whose result is its files only)."""
        return None if self.result_type is None else self.result_type.from_json(data)

    # -- plan / run -------------------------------------------------------------------------------------------------

    @abstractmethod
    def layout(self, spec: SpecT) -> Layout:
        """The tiles and the result's size of a job of ``spec`` (also for a job migrated from an older store)."""

    @abstractmethod
    def plan(self, request: RequestT, ctx: PlanContext) -> SpecT:
        """Check a request and resolve it into a spec (model version, rows, k, sizes).

        Raises:
            InvalidInput and its subclasses (422), ModelNotFound / DatasetNotFound (404): what the request gets
            wrong, found before anything is stored.
        """

    def create(self, spec: SpecT, folder: Path) -> None:
        """Prepare the job's result in its (new, empty) folder before its record is stored. Default: nothing."""

    @abstractmethod
    def run(self, job: JobRecord[SpecT, ProgressT, ResultT], ctx: RunContext[ProgressT]) -> ResultT | None:
        """Compute what is not done yet (NOTE [kind resume]); return the result summary.

        Raises:
            JobStopped: ``ctx.should_stop()`` turned true. Any other exception fails the job with its message.
        """

    def recover(self, job: JobRecord[SpecT, ProgressT, ResultT], folder: Path, done: Callable[[], set[int]]) -> None:
        """Bring a stored job's files up to date at start (a format of an earlier version); ``done()`` reads the
        ids of its tiles recorded as done. Default: nothing."""
