"""Schemas of the analysis routes (``/predict``, ``/spectrum``, ``/compare``): options validated by pydantic,
tensors (x_train, y_train, x, y) decoded by ``wire`` beside them (documentation types below only).

Infinity has no JSON number: times, condition numbers and limits that are infinite travel as the string "inf".
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from ntk_service import wire
from ntk_service.analysis import Spectrum
from ntk_service.kernels.types import NtkImplementation
from ntk_service.server.params import ID_MAX_LENGTH, INT64_MAX, VersionInt
from ntk_service.server.schemas import MAX_OUTPUT_PATH, SIDE_FORMS, DatasetRef, Globs, TensorJson

__all__ = [
    "MAX_COMPARE_VERSIONS",
    "MAX_RIDGE",
    "MAX_TIMES",
    "AnalysisKernelOptions",
    "CompareOptions",
    "CompareRequest",
    "PredictOptions",
    "PredictRequest",
    "SpectrumOptions",
    "SpectrumRequest",
    "VersionRef",
    "json_float",
    "spectrum_fields",
]

MAX_TIMES = 1000
"""Times per /predict request: the response holds T·(N + M)·k values."""

MAX_COMPARE_VERSIONS = 32
"""Versions per /compare request: each kernel is kept in memory for the pairwise distances."""

MAX_RIDGE = 1e100
"""Largest ridge: far past any useful regularization (predictions equal f0 to every digit long before), and far
enough from float64's 1.8e308 that a relative ridge times the kernel's scale stays finite (1e308 made the stable
learning rate NaN, sent as null)."""

Inf = Literal["inf"]

VersionNumber = Annotated[int, WithJsonSchema({"type": "integer", "minimum": 1, "maximum": INT64_MAX})]
"""A version of this model in ``/compare``'s versions; the range is checked by CompareOptions' validator, so a bad
one gets one plain message rather than one per member of the ``int | VersionRef`` union."""


def json_float(value: float) -> float | str:
    """A float for JSON: ``inf`` as the string "inf" (JSON has no infinity)."""
    return "inf" if value == math.inf else value


def spectrum_fields(s: Spectrum) -> dict[str, Any]:
    """The fields every spectrum answer (of a model's kernel or of a job's) starts with."""
    return {
        "eigenvalues": wire.tensor_to_json(s.eigenvalues),
        "n": s.n,
        "method": s.method,
        "lambda_max": s.lambda_max,
        "lambda_min": s.lambda_min,
        "condition_number": None if s.condition_number is None else json_float(s.condition_number),
    }


class AnalysisKernelOptions(BaseModel):
    """How Θ is computed for an analysis (always float64: NOTE [layout] in ``analysis/layout.py``)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["full", "trace"] = Field(
        default="full",
        description="full: the (N·k, N·k) kernel; trace: the (N, N) sum over outputs, read as (trace / k) ⊗ I_k.",
    )
    implementation: NtkImplementation = Field(
        default=NtkImplementation.AUTO, description="How to compute (all give the same numbers); auto picks by cost."
    )
    params: Globs | None = Field(default=None, description="Glob patterns over parameter names; null = all.")
    version: VersionInt | None = Field(default=None, description="Model version. Default: the latest.")
    output: str | None = Field(
        default=None,
        max_length=MAX_OUTPUT_PATH,
        description="For a model returning a dict: the tensor f is (as `output` of /ntk), e.g. "
        '"logits[:, 2, :4]"; k = its size per example. null: the model returns one tensor.',
        examples=["logits[:, 0]"],
    )


class PredictOptions(AnalysisKernelOptions):
    """``/predict`` options beside the tensors x_train, y_train, x_test."""

    times: list[float | Inf] = Field(
        min_length=1,
        max_length=MAX_TIMES,
        description='Times (or integer step counts); "inf" for convergence.',
        examples=[[0, 10, 100, "inf"]],
    )
    learning_rate: float = Field(gt=0, description="η of the optimizer on `loss`.", examples=[0.1])
    loss: Literal["mse", "sum", "half_mse", "cross_entropy"] = Field(
        default="mse",
        description="mse = MSELoss(), sum = MSELoss(reduction='sum'), half_mse = ½·mean, cross_entropy = "
        "CrossEntropyLoss() on int64 class indices y_train (N,) (function-space dynamics; no inf times).",
    )
    flow: Literal["gradient_flow", "gradient_descent"] = Field(
        default="gradient_flow",
        description="gradient_flow: continuous time (times); gradient_descent: integer step counts.",
    )
    ridge: float = Field(
        default=0.0,
        ge=0,
        json_schema_extra={"maximum": MAX_RIDGE},  # checked by _bounded_ridge, whose message reads 1e+100
        description="λ added to the kernel's diagonal (relative: times its mean).",
    )
    ridge_scale: Literal["absolute", "relative"] = Field(
        default="absolute", description="absolute: λ as given; relative: λ times the mean of the kernel's diagonal."
    )

    @field_validator("times")
    @classmethod
    def _non_negative(cls, times: list[float | str]) -> list[float | str]:
        bad = [t for t in times if not isinstance(t, str) and not (t >= 0)]
        if bad:
            raise ValueError(f'times must be ≥ 0 (or "inf"), got {bad}')
        return times

    @field_validator("ridge")
    @classmethod
    def _bounded_ridge(cls, ridge: float) -> float:
        if ridge > MAX_RIDGE:
            raise ValueError(
                f"ridge must be ≤ {MAX_RIDGE:g}, got {ridge:g}; far smaller ridges already give f0 to every digit"
            )
        return ridge

    def time_values(self) -> list[float]:
        return [math.inf if isinstance(t, str) else float(t) for t in self.times]


class PredictRequest(PredictOptions):
    """``POST /v1/models/{name}/predict`` (documentation; the route decodes tensors with ``wire``)."""

    x_train: TensorJson | DatasetRef = Field(description="Training inputs (N, *input): " + SIDE_FORMS)
    y_train: TensorJson = Field(description="(N, k) targets; for loss='cross_entropy', (N,) int64 class indices.")
    x_test: TensorJson | DatasetRef | None = Field(
        default=None, description="Test inputs (M, *input), as x_train; null: training outputs only."
    )


class SpectrumOptions(AnalysisKernelOptions):
    """``/spectrum`` options beside the tensor x."""

    top: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="Only the top eigenvalues (at most n are returned). Default: all."
    )
    method: Literal["auto", "eigh", "lanczos", "operator"] = Field(
        default="auto",
        description="eigh: dense, every eigenvalue; lanczos: the top ones of the dense kernel; operator: the top "
        "ones by Lanczos on the matrix-free operator (the kernel is never formed: memory O(P + n·top), for N whose "
        "kernel does not fit; each Lanczos step is one VJP and one JVP pass over x); auto: eigh or lanczos by size.",
    )
    ridges: list[float] = Field(
        default_factory=list, max_length=64, description="λ > 0 values for effective_dof (needs top = null)."
    )

    @field_validator("ridges")
    @classmethod
    def _positive(cls, ridges: list[float]) -> list[float]:
        if any(not (r > 0 and math.isfinite(r)) for r in ridges):
            raise ValueError(f"ridges must be finite and > 0, got {ridges}")
        return ridges


class SpectrumRequest(SpectrumOptions):
    """``POST /v1/models/{name}/spectrum`` (documentation)."""

    x: TensorJson | DatasetRef = Field(description="Inputs (N, *input) of Θ(x, x): " + SIDE_FORMS)


class VersionRef(BaseModel):
    """A version of another model, for comparing kernels across models of one architecture."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="The other model's registered name.")
    version: VersionInt | None = Field(default=None, description="Its version. Default: the latest.")


class CompareOptions(BaseModel):
    """``/compare`` options beside the tensors x and (optional) y."""

    model_config = ConfigDict(extra="forbid")

    versions: list[VersionNumber | VersionRef] = Field(
        min_length=1,
        max_length=MAX_COMPARE_VERSIONS,
        description="Versions of this model (ints) or {model, version} of others with the same architecture.",
    )
    mode: Literal["full", "trace"] = Field(default="full", description="As for /predict.")
    implementation: NtkImplementation = Field(
        default=NtkImplementation.AUTO, description="How to compute (all give the same numbers); auto picks by cost."
    )
    params: Globs | None = Field(default=None, description="Glob patterns over parameter names; null = all.")
    variant: Literal["uncentered", "centered", "centered_vec_y", "rayleigh"] | None = Field(
        default=None, description="Alignment variant; required with y."
    )

    @field_validator("versions")
    @classmethod
    def _positive(cls, versions: list[int | VersionRef]) -> list[int | VersionRef]:
        bad = [v for v in versions if isinstance(v, int) and not 1 <= v <= INT64_MAX]
        if bad:
            raise ValueError(f"versions must be ≥ 1 and ≤ 2**63 - 1, got {bad}")
        return versions


class CompareRequest(CompareOptions):
    """``POST /v1/models/{name}/compare`` (documentation)."""

    x: TensorJson | DatasetRef = Field(description="Probe inputs (N, *input): " + SIDE_FORMS)
    y: TensorJson | None = Field(default=None, description="Labels (N,) int64 or targets (N, c).")
