"""The value types of a batch job: what was asked (JobSpec), where it stands (JobStatus), and both (JobRecord).

A JobSpec is frozen at submission with everything resolved (model version, data set hashes, sizes, k, dtype), so
a job that resumes after a restart computes exactly the tiles it would have computed the first time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["TERMINAL_STATUSES", "JobRecord", "JobSpec", "JobStatus"]


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
    """What a job computes, fully resolved at submission.

    Attributes:
        model, version: the registered model version (version resolved from "latest" at submission).
        weights_sha256: hash of that version's weights (names the exact numbers the kernel was computed with).
        x1_dataset, x2_dataset: data set ids; x2_dataset None means x2 = x1 (symmetric job).
        x1_sha256, x2_sha256: content hashes of the data sets (x2_sha256 None when symmetric).
        n, m: examples of x1 and x2 (m == n when symmetric).
        k: outputs per example.
        mode, implementation, dtype: wire values of KernelMode, NtkImplementation, "float32"|"float64".
        params: parameter-name globs, None = all parameters.
        tile_size: examples per tile side.
        memory_budget_bytes: the engine's budget per tile, fixed at submission so every tile (and every resumed
            run) plans its chunks the same way, which keeps results bitwise reproducible.
        x1_start, x2_start: first data-set row of x1 and x2 (rows ``[start, start + n)`` are used).
        output: the ``compute_ntk`` ``output=`` path (a model returning a mapping), None for a tensor.
        panel_tiles: tiles per panel side (``jobs/panels.py``), fixed at submission so a resumed job cuts the same
            panels and computes the same bits; 1 (a panel per tile) for jobs from before panels.
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
    mode: str
    implementation: str
    dtype: str
    params: list[str] | None
    tile_size: int
    memory_budget_bytes: int | None = None
    x1_start: int = 0
    x2_start: int = 0
    output: str | None = None
    panel_tiles: int = 1

    @property
    def is_symmetric(self) -> bool:
        return self.x2_dataset is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
            "implementation": self.implementation,
            "implementation_used": [],
            "params": self.params,
            "memory_budget_bytes": self.memory_budget_bytes,
            "spec": self.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job as stored: its spec and its state.

    Attributes:
        id: the job id (32 hex chars).
        spec: the JobSpec.
        status: JobStatus.
        tiles_done, tiles_total: progress in tiles.
        created_at, started_at, finished_at: UNIX times (None until they happen).
        error: why the job failed, else None.
        implementation_used: the implementation the tiles ran (AUTO resolved by the first tile), else None.
        executor: "local" or "ray".
        result_shape: the shape of the whole kernel, e.g. [N, M, k, k].
        estimate_bytes: disk the stored tiles take (uncompressed).
        result_deleted_at: UNIX time the result was deleted while the record was kept, else None.
    """

    id: str
    spec: JobSpec
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

    @property
    def is_finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def progress(self) -> float:
        return self.tiles_done / self.tiles_total if self.tiles_total else 1.0
