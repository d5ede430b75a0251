"""The value types of a job: where it stands (JobStatus), what a kernel job computes (JobSpec), and a job of any
kind as stored (JobRecord).

A JobSpec is frozen at submission with everything resolved (model version, data set hashes, sizes, k, dtype), so
a job that resumes after a restart computes exactly the tiles it would have computed the first time. It holds the
engine's own values: a ``KernelSpec`` (what: mode, params, output) and an ``NtkOptions`` (how: implementation,
dtype, memory budget), each normalised once when the spec is built, so a panel hands them to ``compute_ntk`` as
they are. ``to_dict`` stores them through their own ``to_json``; ``from_dict`` reads that and the flat form of
earlier versions (loose mode, implementation, dtype, params and output strings).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar, cast

from ntk_service.errors import InvalidInput, UnknownMode, operation_name
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.options import NtkOptions
from ntk_service.kernels.spec import KernelSpec, SpecKeywords, refuse_fields, resolve_spec
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


_LOOSE_KERNEL = ("mode", "params", "output")
_LOOSE_OPTIONS = ("implementation", "dtype", "memory_budget_bytes")
_JOB_DTYPE = "float32"


@dataclass(frozen=True, slots=True, init=False)
class JobSpec:
    """What a kernel job computes, fully resolved at submission.

    Attributes:
        model, version: the registered model version (version resolved from "latest" at submission).
        weights_sha256: hash of that version's weights (names the exact numbers the kernel was computed with).
        x1_dataset, x2_dataset: data set ids; x2_dataset None means x2 = x1 (symmetric job).
        x1_sha256, x2_sha256: content hashes of the data sets (x2_sha256 None when symmetric).
        n, m: examples of x1 and x2 (m == n when symmetric).
        k: outputs per example.
        tile_size: examples per tile side.
        kernel (KernelSpec): what every panel computes: a contracted mode (the modes a job stores), the
            parameter globs and the output path. Default: ``KernelSpec()`` (full, every parameter, a tensor).
        options (NtkOptions): how every panel computes it: the implementation, the dtype ("float32" when the
            options leave it to the model) and the memory budget per panel, fixed at submission so every panel
            (and every resumed run) plans its chunks the same way, which keeps results bitwise reproducible. No
            device and no TF32: where a panel runs is the executor's (``NtkOptions.replace(device=...)``).
            Default: ``NtkOptions(dtype="float32")``.
        x1_start, x2_start: first data-set row of x1 and x2 (rows ``[start, start + n)`` are used). Default: 0.
        panel_tiles: tiles per panel side (``jobs/panels.py``), fixed at submission so a resumed job cuts the same
            panels and computes the same bits; 1 (a panel per tile) for jobs from before panels. Default: 1.
        mode, params, output, implementation, dtype, memory_budget_bytes: keywords of the constructor only, the
            shorthands of earlier versions for ``kernel`` and ``options`` (give those or these, not both); read
            back as properties of the same names.

    Raises:
        UnknownMode: a mode that does not exist or that a job cannot store (a derived mode).
        UnknownImplementation, InvalidInput: an implementation, dtype, budget or output of the wrong form; loose
            keywords together with ``kernel`` or ``options``; options that name a device or TF32; a kernel spec
            with groups or a layer (which a job does not compute).
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
    tile_size: int
    kernel: KernelSpec
    options: NtkOptions
    x1_start: int
    x2_start: int
    panel_tiles: int

    def __init__(
        self,
        *,
        model: str,
        version: int,
        weights_sha256: str,
        x1_dataset: str,
        x2_dataset: str | None,
        x1_sha256: str,
        x2_sha256: str | None,
        n: int,
        m: int,
        k: int,
        tile_size: int,
        kernel: KernelSpec | None = None,
        options: NtkOptions | None = None,
        x1_start: int = 0,
        x2_start: int = 0,
        panel_tiles: int = 1,
        mode: KernelMode | str | None = None,
        params: Sequence[str] | None = None,
        output: str | None = None,
        implementation: NtkImplementation | str | None = None,
        dtype: str | None = None,
        memory_budget_bytes: int | None = None,
    ) -> None:
        set_field = object.__setattr__
        for name, value in (
            ("model", model), ("version", version), ("weights_sha256", weights_sha256),
            ("x1_dataset", x1_dataset), ("x2_dataset", x2_dataset), ("x1_sha256", x1_sha256),
            ("x2_sha256", x2_sha256), ("n", n), ("m", m), ("k", k), ("tile_size", tile_size),
            ("x1_start", x1_start), ("x2_start", x2_start), ("panel_tiles", panel_tiles),
        ):  # fmt: skip
            set_field(self, name, value)
        with operation_name("jobs"):
            set_field(self, "kernel", _job_kernel(kernel, SpecKeywords(mode=mode, params=params, output=output)))
            loose = {"implementation": implementation, "dtype": dtype, "memory_budget_bytes": memory_budget_bytes}
            set_field(self, "options", _job_options(options, loose))

    @property
    def mode(self) -> KernelMode:
        """The kernel's mode (a contracted mode: the constructor refuses the others)."""
        return cast(KernelMode, self.kernel.mode)

    @property
    def params(self) -> tuple[str, ...] | None:
        """The kernel's parameter globs (None: every parameter)."""
        return cast("tuple[str, ...] | None", self.kernel.params)

    @property
    def output(self) -> str | None:
        """The kernel's ``output=`` path (None: forward returns a tensor)."""
        return self.kernel.output

    @property
    def implementation(self) -> NtkImplementation:
        return self.options.implementation

    @property
    def dtype(self) -> str:
        """ "float32" or "float64", the name of the options' dtype (what a result array stores)."""
        return str(self.options.dtype).removeprefix("torch.")

    @property
    def memory_budget_bytes(self) -> int | None:
        return self.options.memory_budget_bytes

    @property
    def is_symmetric(self) -> bool:
        return self.x2_dataset is None

    def engine_options(self, *, device: Any = None, allow_tf32: bool = False) -> NtkOptions:
        """How every block of the job is computed on ``device``: ``options`` itself when it runs where the model
        is without TF32, else a copy naming the device (built once per run by the executors, not per panel)."""
        if device is None and not allow_tf32:
            return self.options
        return self.options.replace(device=device, allow_tf32=allow_tf32)

    def to_dict(self) -> dict[str, Any]:
        """The stored (JSON) form: the resolved fields, ``kernel`` and ``options`` as their own ``to_json``."""
        data = {name: getattr(self, name) for name in _PLAIN_FIELDS}
        data["kernel"], data["options"] = self.kernel.to_json(), self.options.to_json()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """The spec ``to_dict`` wrote, or the flat form of earlier versions (``mode``, ``implementation``,
        ``dtype``, ``params``, ``output`` and ``memory_budget_bytes`` beside the other fields).

        Raises:
            InvalidInput: a field that is not one, or a value the constructor refuses.
        """
        fields = dict(data)
        unknown = sorted(set(fields) - set(_PLAIN_FIELDS) - {"kernel", "options", *_LOOSE_KERNEL, *_LOOSE_OPTIONS})
        if unknown:
            raise InvalidInput(f"jobs: a stored kernel job spec has unknown fields {unknown}")
        if "kernel" in fields:
            fields["kernel"] = KernelSpec.from_json(fields["kernel"])
        if "options" in fields:
            fields["options"] = NtkOptions.from_json(fields["options"])
        return cls(**fields)

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


_PLAIN_FIELDS = (
    "model", "version", "weights_sha256", "x1_dataset", "x2_dataset", "x1_sha256", "x2_sha256", "n", "m", "k",
    "tile_size", "x1_start", "x2_start", "panel_tiles",
)  # fmt: skip
"""The fields of a JobSpec besides ``kernel`` and ``options``, stored as they are."""


def _job_kernel(kernel: KernelSpec | None, loose: SpecKeywords) -> KernelSpec:
    """A job's kernel spec from ``kernel`` or the loose keywords: a contracted mode, no groups, no layer."""
    given = [name for name, value in loose._asdict().items() if value is not None]
    if kernel is not None and given:
        raise InvalidInput(
            detail=f"{', '.join(given)} given together with kernel=; pass one or the other, e.g. "
            f"kernel=kernel.replace({', '.join(f'{name}=...' for name in given)})"
        )
    spec = resolve_spec(kernel, loose)
    if not isinstance(spec.mode, KernelMode):
        valid = ", ".join(repr(m.value) for m in KernelMode)
        raise UnknownMode(
            detail=f"mode {spec.mode.value!r} is a derived mode, which a job does not store; use one of {valid}"
        )
    refuse_fields(spec, ("groups", "rest", "layer"))
    return spec


def _job_options(options: NtkOptions | None, loose: dict[str, Any]) -> NtkOptions:
    """A job's engine options from ``options`` or the loose keywords: no device, no TF32, a dtype (float32 if
    none)."""
    given = {name: value for name, value in loose.items() if value is not None}
    if options is None:
        if "implementation" in given:  # NtkOptions would name compute_ntk in the message
            given["implementation"] = parse_implementation(given["implementation"], operation="jobs")
        options = NtkOptions(**given)
    elif not isinstance(options, NtkOptions):
        raise InvalidInput(detail=f"options must be an NtkOptions, got {type(options).__name__}")
    elif given:
        raise InvalidInput(
            detail=f"{', '.join(sorted(given))} given together with options=; pass one or the other, e.g. "
            f"options=options.replace({', '.join(f'{name}=...' for name in given)})"
        )
    if options.device is not None or options.allow_tf32:
        raise InvalidInput(
            detail="a job's options name no device and no TF32: where its panels run is the executor's "
            "(LocalExecutor(device=..., allow_tf32=...), RayExecutor)"
        )
    return options if options.dtype is not None else options.replace(dtype=_JOB_DTYPE)


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
