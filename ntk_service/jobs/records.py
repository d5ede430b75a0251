"""The value types of a job: where it stands (JobStatus), what a kernel job computes (JobSpec), and a job of any
kind as stored (JobRecord).

A JobSpec is frozen at submission with everything resolved (model version, data set hashes, sizes, k, dtype), so
a job that resumes after a restart computes exactly the tiles it would have computed the first time. It holds the
engine's enums (``KernelMode``, ``NtkImplementation``), normalised once when the value is built, whatever spelling
it was given; ``to_dict`` writes their wire values, so the stored form is the one every earlier version wrote.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

import torch

from ntk_service.kernels import NtkOptions
from ntk_service.kernels.modes import KernelMode, parse_mode
from ntk_service.kernels.types import NtkImplementation, parse_implementation

__all__ = ["KERNEL", "TERMINAL_STATUSES", "JobRecord", "JobSpec", "JobStatus"]

KERNEL = "kernel"
"""The kind of a batch kernel job (``JobRecord.kind``; ``jobs/kinds/kernel.py``)."""

SpecT = TypeVar("SpecT")
ProgressT = TypeVar("ProgressT")
ResultT = TypeVar("ResultT")


class JobStatus(StrEnum):
    """Lifecycle of a job: QUEUED → RUNNING → SUCCEEDED | FAILED | CANCELLED (QUEUED may go straight to CANCELLED)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
"""Statuses a job never leaves."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What a kernel job computes, fully resolved at submission.

    Attributes:
        model, version: the registered model version (version resolved from "latest" at submission).
        weights_sha256: hash of that version's weights (names the exact numbers the kernel was computed with).
        x1_dataset, x2_dataset: data set ids; x2_dataset None means x2 = x1 (symmetric job).
        x1_sha256, x2_sha256: content hashes of the data sets (x2_sha256 None when symmetric).
        n, m: examples of x1 and x2 (m == n when symmetric).
        k: outputs per example.
        mode (KernelMode), implementation (NtkImplementation): a wire value is accepted and normalised.
        dtype: "float32" or "float64".
        params: parameter-name globs (a tuple), None = all parameters.
        tile_size: examples per tile side.
        memory_budget_bytes: the engine's budget per tile, fixed at submission so every tile (and every resumed
            run) plans its chunks the same way, which keeps results bitwise reproducible.
        x1_start, x2_start: first data-set row of x1 and x2 (rows ``[start, start + n)`` are used).
        output: the ``compute_ntk`` ``output=`` path (a model returning a mapping), None for a tensor.
        panel_tiles: tiles per panel side (``jobs/panels.py``), fixed at submission so a resumed job cuts the same
            panels and computes the same bits; 1 (a panel per tile) for jobs from before panels.

    Raises:
        UnknownMode, UnknownImplementation: a mode or implementation that does not exist.
    """

    model: str
    version: int
    weights_sha256: str
    x1_dataset: str
    x2_dataset: str | None
    x1_sha256: str
    x2_sha256: str | None
    n: int
    m: int
    k: int
    mode: KernelMode
    implementation: NtkImplementation
    dtype: str
    params: tuple[str, ...] | None
    tile_size: int
    memory_budget_bytes: int | None = None
    x1_start: int = 0
    x2_start: int = 0
    output: str | None = None
    panel_tiles: int = 1

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "mode", parse_mode(self.mode))
        set_field(self, "implementation", parse_implementation(self.implementation))
        set_field(self, "params", None if self.params is None else tuple(self.params))

    @property
    def is_symmetric(self) -> bool:
        return self.x2_dataset is None

    def engine_options(self, *, device: Any = None, allow_tf32: bool = False) -> NtkOptions:
        """How every block of the job is computed: its implementation, dtype and memory budget on ``device``."""
        return NtkOptions(
            implementation=self.implementation,
            dtype=torch.float64 if self.dtype == "float64" else torch.float32,
            memory_budget_bytes=self.memory_budget_bytes,
            device=device,
            allow_tf32=allow_tf32,
        )

    def to_dict(self) -> dict[str, Any]:
        """The stored (JSON) form: wire values of the enums, params as a list."""
        data = asdict(self)
        data["mode"], data["implementation"] = self.mode.value, self.implementation.value
        data["params"] = None if self.params is None else list(self.params)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        return cls(**data)

    def result_attributes(self) -> dict[str, Any]:
        """What produced a result, for its group attributes (see docs/results.md): the model version and weights,
        which data-set rows, mode, implementation, dtype, parameter globs, tile size and memory budget, plus the
        whole spec (``spec``), which a resumed ``compute_ntk_tiled`` compares with its own."""
        x2_rows = None if self.is_symmetric else [self.x2_start, self.x2_start + self.m]
        return {
            "model": self.model,
            "version": self.version,
            "weights_sha256": self.weights_sha256,
            "x1_dataset": self.x1_dataset,
            "x1_sha256": self.x1_sha256,
            "x1_rows": [self.x1_start, self.x1_start + self.n],
            "x2_dataset": self.x2_dataset,
            "x2_sha256": self.x2_sha256,
            "x2_rows": x2_rows,
            "implementation": self.implementation.value,
            "implementation_used": [],
            "params": None if self.params is None else list(self.params),
            "memory_budget_bytes": self.memory_budget_bytes,
            "spec": self.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class JobRecord(Generic[SpecT, ProgressT, ResultT]):
    """A job of any kind as stored: its kind, its typed spec, where it stands, and its typed progress and result.

    Attributes:
        id: the job id (32 hex chars).
        spec: what it computes (the kind's spec type: ``JobSpec`` for a kernel job).
        status: JobStatus.
        tiles_done, tiles_total: progress in tiles, the units a job records as done (a kernel's tiles, a chunk of
            features' rows, a solve's solution).
        created_at, started_at, finished_at: UNIX times (None until they happen).
        error: why the job failed, else None.
        implementation_used: what the engine's AUTO choices resolved to, comma-separated (a kernel job's
            implementations), else None.
        executor: "local" or "ray".
        result_shape: the shape of the whole result, e.g. [N, M, k, k].
        estimate_bytes: disk the result takes when complete.
        result_deleted_at: UNIX time the result was deleted while the record was kept, else None.
        kind: the job kind (``jobs/kinds``): "kernel", "solve", "features". Default: "kernel".
        checkpoint: the kind's progress value as last recorded (a resumed run goes on from it; None before any,
            and for a kernel job, whose progress is its tiles). Default: None.
        result: the kind's result summary once succeeded (None for a kernel job, whose result is its array).
    """

    id: str
    spec: SpecT
    status: JobStatus
    tiles_done: int
    tiles_total: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    implementation_used: str | None
    executor: str
    result_shape: list[int] = field(default_factory=list)
    estimate_bytes: int = 0
    result_deleted_at: float | None = None
    kind: str = KERNEL
    checkpoint: ProgressT | None = None
    result: ResultT | None = None

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def progress(self) -> float:
        """tiles_done / tiles_total (1 for a job without tiles)."""
        return self.tiles_done / self.tiles_total if self.tiles_total else 1.0

    @property
    def implementations(self) -> list[str]:
        """``implementation_used`` as a sorted list (empty before any ran)."""
        return sorted(filter(None, (self.implementation_used or "").split(",")))
