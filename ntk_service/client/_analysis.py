"""Client methods for the analysis routes: ``predict``, ``spectrum``, ``compare`` (numpy results in dataclasses).

The server computes the kernels itself (float64) and returns only what they say, so these requests stay small
whatever N is. Infinite values travel as the string "inf" and come back as ``math.inf``.

    >>> pred = client.predict("mlp", x_train, y_train, x_test, times=[0, 100, math.inf], learning_rate=0.1)
    ... # doctest: +SKIP
    >>> pred.test.shape                    # (T, M, k)                                          # doctest: +SKIP
    >>> client.spectrum("mlp", x, top=20).eigenvalues                                          # doctest: +SKIP
    >>> client.compare("mlp", x, versions=[1, 2, 3]).distance   # (3, 3)                        # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast
from urllib.parse import quote

import numpy as np

from ntk_service import wire
from ntk_service._tensors import is_torch_tensor
from ntk_service.client._base import BaseClient, _named_side_json
from ntk_service.client._types import (
    AlignmentVariantName,
    AnalysisModeName,
    FlowName,
    ImplementationName,
    JobSpectrumMethodName,
    LossName,
    RidgeScaleName,
    SpectrumMethodName,
)

__all__ = [
    "AnalysisClient",
    "JobKernelDistance",
    "JobKernelSpectrum",
    "KernelComparison",
    "KernelSpectrum",
    "LinearizedPrediction",
]


@dataclass(frozen=True)
class LinearizedPrediction:
    """``/predict``: the linearized network's outputs at each time, and the kernel facts used.

    Attributes:
        times: (T,) times or step counts (``inf`` allowed). train: (T, N, k). test: (T, M, k) or None.
        f0_train: (N, k) and f0_test: (M, k) or None, the network's own outputs (float64).
        lambda_min, lambda_max: of the training kernel as used. frozen_modes: modes with λ ≤ tol that did not move.
        path: how it was computed. max_learning_rate: the stable limit of gradient descent for the loss
            (cross-entropy: the descent-lemma bound 4N / λmax).
        kernel_ms, analysis_ms: server time computing the kernels (and f0) and the analysis.
        rtol, atol: the ODE solver's tolerances where one ran (cross-entropy gradient flow), else None.
    """

    times: np.ndarray
    train: np.ndarray
    test: np.ndarray | None
    f0_train: np.ndarray
    f0_test: np.ndarray | None
    lambda_min: float
    lambda_max: float
    frozen_modes: int
    path: str
    max_learning_rate: float
    model: str
    version: int
    kernel_ms: float
    analysis_ms: float
    rtol: float | None = None
    atol: float | None = None


@dataclass(frozen=True)
class KernelSpectrum:
    """``/spectrum``: eigenvalues (descending, signed) of Θ(x, x) and its ranks.

    Attributes:
        eigenvalues: (r,). n: the matrix size (N·k full, N trace). method: "eigh" or "lanczos".
        condition_number: ``inf`` when λmin ≤ tol·λmax; None for a partial spectrum. lambda_min: None if partial.
        ranks: entropy, participation_ratio, stable_rank, numerical_rank (None where not computable).
        effective_dof: ridge -> tr(K(K + λI)⁻¹) for the ridges asked for.
    """

    eigenvalues: np.ndarray
    n: int
    method: Literal["eigh", "lanczos"]
    lambda_max: float
    lambda_min: float | None
    condition_number: float | None
    ranks: dict[str, float | int | None]
    effective_dof: dict[float, float]
    model: str
    version: int
    kernel_ms: float
    analysis_ms: float


@dataclass(frozen=True)
class KernelComparison:
    """``/compare``: how the kernel on a probe set moved across versions.

    Attributes:
        versions: (model, version) pairs in request order. distance: (V, V) kernel distances (Fort et al.).
        relative_change: (V,) ‖K_v − K_first‖ / ‖K_first‖. alignment: (V,) per version, or None without y.
    """

    versions: list[tuple[str, int]]
    distance: np.ndarray
    relative_change: np.ndarray
    alignment: np.ndarray | None
    variant: AlignmentVariantName | None
    kernel_ms: float
    analysis_ms: float


@dataclass(frozen=True)
class JobKernelSpectrum:
    """``/v1/jobs/{id}/spectrum``: eigenvalues (descending) of a finished job's stored kernel.

    Attributes:
        eigenvalues: (r,). n: the matrix size. method: "lanczos" (row reads) or "eigh" (loaded whole).
        lambda_min, condition_number: None for a partial (top-r) spectrum.
    """

    eigenvalues: np.ndarray
    n: int
    method: Literal["eigh", "lanczos"]
    lambda_max: float
    lambda_min: float | None
    condition_number: float | None
    analysis_ms: float


@dataclass(frozen=True)
class JobKernelDistance:
    """``/v1/jobs/{id}/distance``: kernel distance (Fort et al.) and ‖K_other − K‖ / ‖K‖ between two jobs."""

    distance: float
    relative_change: float
    analysis_ms: float


def _inf(value: Any) -> float:
    return math.inf if value == "inf" else float(value)


def _side(value: Any, name: str) -> Any:
    """A JSON tensor, named tensors (a mapping without ``dataset``, for a model taking several inputs), or a data set
    slice ``{"dataset": id, "start": i, "stop": j}`` as given."""
    if isinstance(value, Mapping):
        if "dataset" not in value and not set(value) & {"start", "stop"}:
            return _named_side_json(value, name)
        if "dataset" not in value or set(value) - {"dataset", "start", "stop"}:
            raise ValueError(
                f"{name}: a data set slice is {{'dataset': id, 'start': i, 'stop': j}}; got {sorted(value)}"
            )
        return {key: value[key] for key in ("dataset", "start", "stop") if value.get(key) is not None}
    if is_torch_tensor(value):
        value = value.detach().cpu().numpy()
    return wire.tensor_to_json(np.asarray(value))


def _targets(y: Any, loss: str) -> np.ndarray:
    """y_train as sent: float64 targets, or for cross-entropy the labels' own dtype (integers travel as int64;
    anything else reaches the server as it is and is refused there with the reason)."""
    if is_torch_tensor(y):
        y = y.detach().cpu().numpy()
    return np.asarray(y) if loss == "cross_entropy" else np.asarray(y, dtype=np.float64)


def _tensor(body: Mapping[str, Any], key: str) -> np.ndarray:
    return wire.tensor_from_json(body[key], name=key)


def _kernel_fields(
    mode: str, implementation: str, params: Sequence[str] | None, version: int | None, output: str | None = None
) -> dict[str, Any]:
    fields: dict[str, Any] = {"mode": mode, "implementation": implementation}
    if params is not None:
        fields["params"] = list(params)
    if version is not None:
        fields["version"] = version
    if output is not None:
        fields["output"] = output
    return fields


class AnalysisClient(BaseClient):
    """``predict``, ``spectrum`` and ``compare`` (mixed into ``Client``)."""

    def predict(
        self,
        model: str,
        x_train: Any,
        y_train: Any,
        x_test: Any = None,
        *,
        times: Sequence[float],
        learning_rate: float,
        loss: LossName = "mse",
        flow: FlowName = "gradient_flow",
        ridge: float = 0.0,
        ridge_scale: RidgeScaleName = "absolute",
        mode: AnalysisModeName = "full",
        implementation: ImplementationName = "auto",
        params: Sequence[str] | None = None,
        version: int | None = None,
        output: str | None = None,
    ) -> LinearizedPrediction:
        """``POST /v1/models/{model}/predict``: the linearized network trained on (x_train, y_train).

        Args:
            x_train: (N, *input) array or data set slice. y_train: (N, k) targets, or (N,) integer class
                indices for loss="cross_entropy". x_test: (M, *input) or None.
            times: times of gradient flow, or integer step counts of gradient descent; ``math.inf`` allowed
                (not for cross-entropy).
            learning_rate: η of the optimizer on ``loss``. loss: "mse" (``MSELoss()``) | "sum" | "half_mse" |
                "cross_entropy" (``CrossEntropyLoss()``).
            flow: "gradient_flow" | "gradient_descent". ridge, ridge_scale: λ and "absolute" | "relative".
            mode: "full" | "trace" (trace / k ⊗ I_k). implementation, params, version, output: as for ``ntk``
                (``output`` selects f of a model returning a dict, e.g. "logits[:, 0]").

        Returns:
            LinearizedPrediction: train (T, N, k), test (T, M, k) or None, f0, λmin/λmax, the path.

        Raises:
            ShapeMismatch (y_train's shape), InvalidInput (times < 0, ...), UnstableLearningRate (gradient descent
            above the limit: the message gives it), MemoryEstimateExceeded, ModelNotFound; for cross-entropy,
            InvalidInput (labels not integers in [0, k), inf times) and ResourceLimit (a run over the work limit).
        """
        body: dict[str, Any] = {
            "x_train": _side(x_train, "x_train"),
            "y_train": wire.tensor_to_json(_targets(y_train, loss)),
            "times": [_json_time(t) for t in times],
            "learning_rate": learning_rate,
            "loss": loss,
            "flow": flow,
            "ridge": ridge,
            "ridge_scale": ridge_scale,
            **_kernel_fields(mode, implementation, params, version, output),
        }
        if x_test is not None:
            body["x_test"] = _side(x_test, "x_test")
        out = self._send_json("POST", f"/v1/models/{quote(model, safe='')}/predict", body)
        return LinearizedPrediction(
            times=np.array([_inf(t) for t in out["times"]]),
            train=_tensor(out, "train"),
            test=None if out.get("test") is None else _tensor(out, "test"),
            f0_train=_tensor(out, "f0_train"),
            f0_test=None if out.get("f0_test") is None else _tensor(out, "f0_test"),
            lambda_min=float(out["lambda_min"]),
            lambda_max=float(out["lambda_max"]),
            frozen_modes=int(out["frozen_modes"]),
            path=str(out["path"]),
            max_learning_rate=_inf(out["max_learning_rate"]),
            model=str(out["model"]),
            version=int(out["version"]),
            kernel_ms=float(out["kernel_ms"]),
            analysis_ms=float(out["analysis_ms"]),
            rtol=None if out.get("rtol") is None else float(out["rtol"]),
            atol=None if out.get("atol") is None else float(out["atol"]),
        )

    def spectrum(
        self,
        model: str,
        x: Any,
        *,
        top: int | None = None,
        method: SpectrumMethodName = "auto",
        ridges: Sequence[float] = (),
        mode: AnalysisModeName = "full",
        implementation: ImplementationName = "auto",
        params: Sequence[str] | None = None,
        version: int | None = None,
        output: str | None = None,
    ) -> KernelSpectrum:
        """``POST /v1/models/{model}/spectrum``: eigenvalues and ranks of Θ(x, x).

        Args:
            x: (N, *input) array or data set slice. top: only the top eigenvalues (None: all).
            method: "auto" | "eigh" | "lanczos" | "operator" (Lanczos on the matrix-free operator: top only, the
                kernel never formed). ridges: λ values for ``effective_dof`` (needs top=None).
            mode, implementation, params, version, output: as for ``ntk``.
        """
        body: dict[str, Any] = {
            "x": _side(x, "x"),
            "top": top,
            "method": method,
            "ridges": list(ridges),
            **_kernel_fields(mode, implementation, params, version, output),
        }
        out = self._send_json("POST", f"/v1/models/{quote(model, safe='')}/spectrum", body)
        condition = out.get("condition_number")
        return KernelSpectrum(
            eigenvalues=_tensor(out, "eigenvalues"),
            n=int(out["n"]),
            method=cast(Literal["eigh", "lanczos"], str(out["method"])),
            lambda_max=float(out["lambda_max"]),
            lambda_min=None if out.get("lambda_min") is None else float(out["lambda_min"]),
            condition_number=None if condition is None else _inf(condition),
            ranks=dict(out["ranks"]),
            effective_dof={float(item["ridge"]): float(item["value"]) for item in out.get("effective_dof", [])},
            model=str(out["model"]),
            version=int(out["version"]),
            kernel_ms=float(out["kernel_ms"]),
            analysis_ms=float(out["analysis_ms"]),
        )

    def compare(
        self,
        model: str,
        x: Any,
        *,
        versions: Sequence[int | Mapping[str, Any]],
        y: Any = None,
        variant: AlignmentVariantName | None = None,
        mode: AnalysisModeName = "full",
        implementation: ImplementationName = "auto",
        params: Sequence[str] | None = None,
    ) -> KernelComparison:
        """``POST /v1/models/{model}/compare``: the kernel on probe inputs x across versions (checkpoints).

        Args:
            x: (N, *input) probe inputs or a data set slice.
            versions: versions of ``model`` (ints), or ``{"model": name, "version": v}`` of another model with the
                same architecture.
            y: labels (N,) of an integer dtype or targets (N, c), for the per-version alignment. variant: the
                alignment variant (required with y): "uncentered" | "centered" | "centered_vec_y" | "rayleigh".
            mode, implementation, params: as for ``ntk``.

        Raises:
            InvalidInput: versions of different architectures, y without a variant (or the reverse).
        """
        body: dict[str, Any] = {
            "x": _side(x, "x"),
            "versions": [v if isinstance(v, int) else dict(v) for v in versions],
            "variant": variant,
            **_kernel_fields(mode, implementation, params, None),
        }
        if y is not None:
            body["y"] = wire.tensor_to_json(np.asarray(y))
        out = self._send_json("POST", f"/v1/models/{quote(model, safe='')}/compare", body)
        aligned = out.get("alignment")
        return KernelComparison(
            versions=[(str(v["model"]), int(v["version"])) for v in out["versions"]],
            distance=_tensor(out, "distance"),
            relative_change=np.asarray(out["relative_change"], dtype=np.float64),
            alignment=None if aligned is None else np.asarray(aligned, dtype=np.float64),
            variant=out.get("variant"),
            kernel_ms=float(out["kernel_ms"]),
            analysis_ms=float(out["analysis_ms"]),
        )

    # ---- a finished job's stored kernel ----

    def job_spectrum(
        self, job_id: str, *, top: int | None = 20, method: JobSpectrumMethodName = "auto"
    ) -> JobKernelSpectrum:
        """The top eigenvalues of a finished job's kernel (Lanczos over row reads; ``top=None``: all, dense).

        Raises:
            JobNotFound, JobNotFinished (409), ShapeMismatch (a job with x2), MemoryEstimateExceeded.
        """
        out = self._send_json("POST", _job_path(job_id, "spectrum"), {"top": top, "method": method})
        condition = out.get("condition_number")
        return JobKernelSpectrum(
            eigenvalues=_tensor(out, "eigenvalues"),
            n=int(out["n"]),
            method=cast(Literal["eigh", "lanczos"], str(out["method"])),
            lambda_max=float(out["lambda_max"]),
            lambda_min=None if out.get("lambda_min") is None else float(out["lambda_min"]),
            condition_number=None if condition is None else _inf(condition),
            analysis_ms=float(out["analysis_ms"]),
        )

    def job_alignment(self, job_id: str, y: Any, *, variant: AlignmentVariantName) -> float:
        """The alignment of a finished job's kernel with labels (N,) int or targets (N, c), streamed by rows."""
        body = {"y": wire.tensor_to_json(np.asarray(y)), "variant": variant}
        return float(self._send_json("POST", _job_path(job_id, "alignment"), body)["alignment"])

    def job_distance(self, job_id: str, other: str) -> JobKernelDistance:
        """Kernel distance and relative change between two finished jobs' kernels (same shape), streamed."""
        out = self._send_json("POST", _job_path(job_id, "distance"), {"other": other})
        return JobKernelDistance(
            distance=float(out["distance"]),
            relative_change=float(out["relative_change"]),
            analysis_ms=float(out["analysis_ms"]),
        )


def _job_path(job_id: str, what: str) -> str:
    return f"/v1/jobs/{quote(job_id, safe='')}/{what}"


def _json_time(value: float) -> float | str:
    """A time for the wire: ``inf`` as "inf"."""
    return "inf" if value == math.inf else float(value)
