"""The types of the client's arguments and results, for a notebook or an editor to complete.

The records the server sends (models, data sets, jobs) are ``TypedDict``\\ s: at run time they are the plain dicts
the client always returned, so ``record["version"]``, ``json.dumps(record)`` and the CLI's printing work as before,
while an editor completes their keys and knows their types. The option values are ``Literal``\\ s of the wire
values; the engine's enums (``KernelMode.TRACE``, ...) are ``str`` enums and pass as those values.

``tests/client/test_types.py`` checks every record type against the server's own response (its keys) and its
OpenAPI document (the fields and the ``Literal`` values).
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict, final

from ntk_service.vocabulary import ContractedModeName, ImplementationName, ModeName, OperatorModeName

__all__ = [
    "AlignmentVariantName",
    "AnalysisModeName",
    "DatasetArrayInfo",
    "DatasetInfo",
    "DatasetSlice",
    "DtypeName",
    "HealthStatus",
    "FamilyKernelName",
    "FlowName",
    "ImplementationName",
    "JobDeletion",
    "JobInfo",
    "JobModeName",
    "JobSide",
    "JobStatusName",
    "KernelModeName",
    "LossName",
    "InputLeafInfo",
    "InputSpecInfo",
    "ModelInfo",
    "OperatorModeName",
    "ParameterShape",
    "RidgeScaleName",
    "JobSpectrumMethodName",
    "SpectrumMethodName",
]

KernelModeName = ModeName
"""A kernel mode, a row of ``ntk_service.vocabulary.MODES`` (its shape there): e.g. "full" (N, M, k, k), "trace"
(N, M), "pseudo" (N, M) = (1/k) Σ_ab Θ_ab."""

JobModeName = ContractedModeName
"""The modes a batch job stores (the contracted modes: every kernel mode but "pseudo")."""

AnalysisModeName = Literal["full", "trace"]
"""The modes an analysis (predict, spectrum, compare) computes Θ in."""


DtypeName = Literal["float32", "float64"]
"""A compute dtype."""


FamilyKernelName = Literal["ntk", "nngp"]
"""Which kernel ``monte_carlo`` averages."""

LossName = Literal["mse", "sum", "half_mse", "cross_entropy"]
"""The training loss of ``predict``: "mse" is torch's ``MSELoss()``, "sum" ``MSELoss(reduction="sum")``, "half_mse"
half of "mse", "cross_entropy" ``CrossEntropyLoss()`` on integer class indices."""

FlowName = Literal["gradient_flow", "gradient_descent"]
"""Continuous-time gradient flow (times) or gradient descent (integer step counts)."""

RidgeScaleName = Literal["absolute", "relative"]
"""The ridge λ as given, or times the mean of the kernel's diagonal."""

SpectrumMethodName = Literal["auto", "eigh", "lanczos", "operator"]
"""How a model's spectrum is computed: dense eigh, Lanczos for the top eigenvalues (of the dense kernel, or of the
matrix-free operator: "operator"), or by size."""

JobSpectrumMethodName = Literal["auto", "eigh", "lanczos"]
"""How a stored job result's spectrum is computed: dense eigh, Lanczos over row reads, or by size."""

AlignmentVariantName = Literal["uncentered", "centered", "centered_vec_y", "rayleigh"]
"""The kernel-target alignment variant."""

JobStatusName = Literal["queued", "running", "succeeded", "failed", "cancelled"]
"""Where a job stands; the last three never change again."""


class DatasetSlice(TypedDict, total=False):
    """Rows ``start:stop`` of an uploaded data set, in place of an inline array (``dataset`` is required)."""

    dataset: str
    start: int
    stop: int


class ParameterShape(TypedDict):
    """One parameter tensor of a model, in ``named_parameters()`` order."""

    name: str
    shape: list[int]


class InputLeafInfo(TypedDict):
    """One named input of a model taking several tensors."""

    name: str
    shape: list[int]
    dtype: str
    vocab_size: int | None


class InputSpecInfo(TypedDict):
    """The inputs of a model taking several tensors: "mapping" (keyword arguments) or "tuple" (positional)."""

    kind: str
    leaves: list[InputLeafInfo]


class ModelInfo(TypedDict):
    """One version of a registered model (``register_model``, ``get_model``, ``list_models``, ...)."""

    name: str
    version: int
    architecture: dict[str, object]
    seed: int | None
    num_params: int
    input_shape: list[int]
    input_dtype: str
    output_dim: int
    parameters: list[ParameterShape]
    weights_sha256: str
    created_at: str
    label: str | None
    inputs: InputSpecInfo | None
    class_name: str | None
    parameter_paths: dict[str, object] | None


class DatasetArrayInfo(TypedDict):
    """One array of a data set of named arrays."""

    name: str
    shape: list[int]
    dtype: str


class _DatasetFields(TypedDict):
    id: str
    name: str | None
    shape: list[int]
    dtype: str
    sha256: str
    size_bytes: int
    created_at: str


class DatasetInfo(_DatasetFields, total=False):
    """An uploaded data set (``upload_dataset``, ``get_dataset``, ``list_datasets``); a data set of named arrays has
    shape (N,), dtype "mapping" and ``arrays`` (a single array has no ``arrays`` key)."""

    arrays: list[DatasetArrayInfo]


class JobSide(TypedDict):
    """The rows of a data set one side of a job covers."""

    dataset: str
    start: int
    stop: int


@final  # final, so that ``"freed_bytes" in answer`` tells the two answers of ``delete_job`` apart
class JobInfo(TypedDict):
    """A batch kernel job and where it stands (``submit_job``, ``get_job``, ``wait``, ...)."""

    id: str
    status: JobStatusName
    model: str
    version: int
    x1: JobSide
    x2: JobSide | None
    mode: JobModeName
    implementation: ImplementationName
    implementation_used: list[str]
    dtype: DtypeName
    params: list[str] | None
    tile_size: int
    panel_tiles: int
    output: str | None
    tiles_done: int
    tiles_total: int
    progress: float
    eta_s: float | None
    error: str | None
    result_shape: list[int]
    estimate_bytes: int
    result_path: NotRequired[str | None]
    executor: str
    created_at: str
    started_at: str | None
    finished_at: str | None
    result_deleted_at: str | None


@final
class JobDeletion(TypedDict):
    """What ``delete_job`` removed from a finished job: "job" (record and result) or "result" (record kept)."""

    id: str
    deleted: Literal["result", "job"]
    freed_bytes: int


class HealthStatus(TypedDict):
    """``GET /healthz``."""

    status: Literal["ok"]
