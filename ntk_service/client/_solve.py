"""Solve and features jobs from Python: kernel ridge, GP mean or linearized predictions at t = ∞ on stored data
sets, and sketched NTK features Φ (N, k, D) with kernels from them.

    >>> job = client.submit_solve_job("mlp", kind="kernel_ridge", train=x_id, targets=y_id, test=t_id,
    ...                               ridge=1e-3, heldout={"inputs": v_id, "targets": vy_id})  # doctest: +SKIP
    >>> job = client.wait_solve_job(job["id"])     # prints solver / steps / residual / held-out accuracy on stderr
    >>> result = client.solve_job_result(job["id"])
    >>> result.converged, result.alpha.shape, result.predictions.shape  # True, (N, k), (M, k)

    >>> job = client.submit_features_job("mlp", dataset=x_id, dim=512, seed=0)          # doctest: +SKIP
    >>> client.wait_features_job(job["id"])
    >>> phi = client.features_result(job["id"])                       # (N, k, 512)
    >>> theta = client.feature_kernel(job["id"], other_id, mode="trace")  # (N, M) ≈ Θ_trace

A solve that did not converge is a succeeded job whose result says so: ``SolveJobResult.converged`` is False and
``stop_reason`` says why; ``solve_job_result(..., require_converged=True)`` raises instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO, cast
from urllib.parse import quote

import numpy as np

from ntk_service import wire
from ntk_service.client._base import _decode_tensors
from ntk_service.client._job_routes import JobRoute, JobRoutesClient, rows_body
from ntk_service.errors import NtkServiceError
from ntk_service.vocabulary import SolverName

__all__ = ["SolveJobResult", "SolveJobsClient", "format_solve_progress"]

SolveKindName = Literal["kernel_ridge", "gp_mean", "linearized"]


@dataclass(frozen=True)
class SolveJobResult:
    """A finished solve job's arrays and report.

    Attributes:
        alpha: (N, k) float64 weights. predictions: (M, k) float64 test predictions, or None without test rows.
        converged: every column reached rtol. stop_reason: "converged", "max_passes", "stagnated: ...", ...
        iterations (the solver's steps), products, passes: the cost. residual: the final relative residual per
            column. time_s: the solve's wall time. preconditioner: its name.
        solver: the method that produced alpha. attempts: every method auto tried ({"solver", "stop_reason",
            "passes", "time_s"}). epochs: block epochs. heldout_metric, heldout_curve: [(passes, value), ...].
        memory_bytes: the solver's estimate. peak_rss_bytes: the server process's peak resident memory (None
            where unknown). report: the whole report as sent.
    """

    alpha: np.ndarray
    predictions: np.ndarray | None
    converged: bool
    stop_reason: str
    iterations: int
    residual: list[float]
    products: int
    passes: float
    time_s: float
    preconditioner: str
    solver: str = "pcg"
    attempts: list[dict[str, Any]] = field(default_factory=list)
    epochs: int = 0
    heldout_metric: str | None = None
    heldout_curve: list[tuple[float, float]] = field(default_factory=list)
    memory_bytes: int = 0
    peak_rss_bytes: int | None = None
    report: dict[str, Any] = field(default_factory=dict)


def format_solve_progress(job: Mapping[str, Any]) -> str:
    """One line: ``running  block  it 120  epoch 3  residual 3.1e-05  passes 12.5  heldout 0.9312  12.4s`` (the
    held-out metric's last value where the job has a held-out set; ``running  rows 512/2048`` for a features
    job)."""
    p = job.get("progress") or {}
    if job.get("job") == "features":
        return f"{job.get('status', '')}  rows {p.get('rows_done', 0)}/{p.get('rows_total', '?')}"
    residual = p.get("residual")
    residual_text = "--" if residual is None else f"{float(residual):.2e}"
    parts = [str(job.get("status", ""))]
    if p.get("solver"):
        parts.append(str(p["solver"]))
    parts.append(f"it {p.get('iterations', 0)}")
    if p.get("epochs"):
        parts.append(f"epoch {p['epochs']}")
    parts += [f"residual {residual_text}", f"passes {float(p.get('passes', 0.0)):.1f}"]
    if p.get("heldout") is not None:
        parts.append(f"heldout {float(p['heldout']):.4g}")
    parts.append(f"{float(p.get('elapsed_s', 0.0)):.1f}s")
    return "  ".join(parts)


def _heldout(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    held = dict(value)
    for side in ("inputs", "targets"):
        if side not in held:
            raise ValueError(f"submit_solve_job: heldout needs {side!r} (a data set id or rows), got {sorted(held)}")
        held[side] = rows_body(held[side])
    return held


_SOLVE_ROUTE: JobRoute[dict[str, Any]] = JobRoute("/v1/solve-jobs", format_solve_progress)
_FEATURES_ROUTE: JobRoute[dict[str, Any]] = JobRoute("/v1/feature-jobs", format_solve_progress)


class SolveJobsClient(JobRoutesClient):
    """The ``/v1/solve-jobs`` methods of ``Client``."""

    def submit_solve_job(
        self,
        model: str,
        *,
        kind: SolveKindName,
        train: str | Mapping[str, Any],
        targets: str | Mapping[str, Any],
        test: str | Mapping[str, Any] | None = None,
        version: int | None = None,
        mode: Literal["full", "trace"] = "full",
        dtype: Literal["float32", "float64"] = "float64",
        ridge: float | None = None,
        rtol: float | None = None,
        max_iterations: int | None = None,
        preconditioner: Literal["auto", "nystrom", "none"] | None = None,
        landmarks: int | None = None,
        progress_every: int | None = None,
        params: list[str] | None = None,
        examples_per_chunk: int | None = None,
        solver: SolverName | None = None,
        heldout: Mapping[str, Any] | None = None,
        block_size: int | None = None,
        inner_steps: int | None = None,
        max_passes: float | None = None,
        max_seconds: float | None = None,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """Queue a solve job (POST /v1/solve-jobs).

        Args:
            model: the registered model. kind: "kernel_ridge", "gp_mean" or "linearized" (t = ∞).
            train, targets, test: a data set id, or {"dataset", "start", "stop"}; targets (N, k) or (N,) aligned
                with the train rows; test None: alpha only.
            ridge: λ > 0 (required by the server; e.g. 1e-3 × the kernel's mean diagonal).
            solver: "auto" (the server's default), "dense", "pcg" or "block" (docs/analysis.md).
            heldout: {"inputs": id or rows, "targets": id or rows, "metric": "accuracy" | "mse", "patience",
                "every"}: scored per epoch, its curve in the progress and the result. Default: None.
            version, mode, dtype, rtol, max_iterations, preconditioner, landmarks, progress_every, params,
                examples_per_chunk, block_size, inner_steps, max_passes, max_seconds, seed: as the route's fields
                (None: the server's default).

        Returns:
            dict: the queued job (id, status, spec, progress None).

        Raises:
            InvalidInput / ShapeMismatch (422): a bad ridge, kind, solver option, rows or targets shape (the
            message names the field). MemoryEstimateExceeded: the solve's estimate is over the server's budget.
            ModelNotFound / DatasetNotFound (404).
        """
        body = {
            "kind": kind,
            "model": model,
            "version": version,
            "train": rows_body(train),
            "targets": rows_body(targets),
            "test": rows_body(test),
            "mode": mode,
            "dtype": dtype,
            "ridge": ridge,
            "rtol": rtol,
            "max_iterations": max_iterations,
            "preconditioner": preconditioner,
            "landmarks": landmarks,
            "progress_every": progress_every,
            "params": params,
            "examples_per_chunk": examples_per_chunk,
            "solver": solver,
            "heldout": _heldout(heldout),
            "block_size": block_size,
            "inner_steps": inner_steps,
            "max_passes": max_passes,
            "max_seconds": max_seconds,
            "seed": seed,
        }
        return self._submit_job(_SOLVE_ROUTE, body)

    def estimate_ridge(
        self,
        model: str,
        x_train: Any,
        y_train: Any,
        *,
        mode: Literal["full", "trace"] = "full",
        ridges: list[float] | None = None,
        rank: int | None = None,
        version: int | None = None,
    ) -> dict[str, Any]:
        """GCV and leave-one-out error along a grid of ridges (POST /v1/models/{name}/ridge-estimate; no solve).

        Args:
            model: the registered model. x_train: (N, *input) array, or {"dataset", "start", "stop"}.
            y_train: (N, k) targets. mode: "full" or "trace". ridges: absolute λ's (None: 1e-6 … 1 × the mean
                diagonal). rank: the Nyström rank cap (None: adaptive). version: None, the latest.

        Returns:
            dict: ridges, gcv, loo (lists), best_gcv, best_loo (the λ to pass to a solve), method, rank, floor,
            mean_diagonal.

        Raises:
            InvalidInput / ShapeMismatch (422): a ridge ≤ 0, y_train not (N, k).
        """
        x = dict(x_train) if isinstance(x_train, Mapping) else wire.tensor_to_json(np.asarray(x_train))
        body = {"x_train": x, "y_train": wire.tensor_to_json(np.asarray(y_train, dtype=np.float64)), "mode": mode,
                "ridges": ridges, "rank": rank, "version": version}  # fmt: skip
        path = f"/v1/models/{quote(model, safe='')}/ridge-estimate"
        return cast(dict[str, Any], self._send_json("POST", path, {k: v for k, v in body.items() if v is not None}))

    def solve_job(self, job_id: str) -> dict[str, Any]:
        """The job (GET /v1/solve-jobs/{id}): status, progress {iterations, residual, products, passes,
        elapsed_s}, result (the CG report) once finished, error."""
        return self._job(_SOLVE_ROUTE, job_id)

    def cancel_solve_job(self, job_id: str) -> dict[str, Any]:
        """Cancel a queued or running solve (DELETE /v1/solve-jobs/{id}?cancel_only=true); returns the job (a
        finished one unchanged)."""
        return self._cancel_job(_SOLVE_ROUTE, job_id)

    def delete_solve_job(self, job_id: str) -> dict[str, Any]:
        """Delete a finished solve job and its arrays; {"id", "deleted", "freed_bytes"} (a queued or running job
        is cancelled and returned instead, as DELETE /v1/solve-jobs/{id} does).

        Raises:
            JobNotFound: no such solve job.
        """
        return self._delete_job(_SOLVE_ROUTE, job_id)

    def wait_solve_job(
        self,
        job_id: str,
        *,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
        progress: TextIO | Literal["stderr"] | None = "stderr",
    ) -> dict[str, Any]:
        """Follow the job until it finishes, writing ``format_solve_progress`` lines to ``progress``: a stream,
        "stderr" (the default: ``sys.stderr`` as it is at the call) or None (quiet).

        It reads the server's event stream (``GET /v1/solve-jobs/{id}/events``: a line per CG report, no polling
        delay) and falls back to polling every ``poll_s`` seconds when the stream breaks (a restarting server or
        a proxy that cuts long responses): the job keeps running on the server meanwhile.

        Returns:
            dict: the finished job (succeeded or cancelled).

        Raises:
            JobFailed: the job failed (its error in the message). ServiceUnavailable: timeout_s passed first.
        """
        return self._wait_job(_SOLVE_ROUTE, job_id, poll_s, timeout_s, progress)

    def solve_job_result(self, job_id: str, *, require_converged: bool = False) -> SolveJobResult:
        """Download a succeeded solve job's alpha and predictions (safetensors, the report in its metadata).

        Args:
            job_id: the job. require_converged: raise when the solve did not converge. Default: False (the
                result says ``converged=False``).

        Returns:
            SolveJobResult: alpha (N, k), predictions (M, k) or None, and the report.

        Raises:
            JobNotFinished (409): the job has not succeeded. NtkServiceError: require_converged and not converged.
        """
        path = f"/v1/solve-jobs/{quote(job_id, safe='')}/result"
        response = self._request("GET", path, accept=wire.MEDIA_SAFETENSORS)
        arrays, metadata = _decode_tensors(response, npy_name="alpha")
        report = json.loads(metadata["result"])
        if require_converged and not report["converged"]:
            raise NtkServiceError(
                f"solve_job_result: solve job {job_id} did not converge ({report['stop_reason']}, residual "
                f"{max(report['residual']):.3g} after {report['iterations']} steps of {report.get('solver', 'cg')}); "
                "use solver='auto', raise max_passes or max_iterations, or a larger ridge"
            )
        return SolveJobResult(
            alpha=arrays["alpha"],
            predictions=arrays.get("predictions"),
            converged=bool(report["converged"]),
            stop_reason=str(report["stop_reason"]),
            iterations=int(report["iterations"]),
            residual=[float(r) for r in report["residual"]],
            products=int(report["products"]),
            passes=float(report["passes"]),
            time_s=float(report["time_s"]),
            preconditioner=str(report["preconditioner"]),
            solver=str(report.get("solver", "pcg")),
            attempts=[dict(a) for a in report.get("attempts", ())],
            epochs=int(report.get("epochs", 0)),
            heldout_metric=report.get("heldout_metric"),
            heldout_curve=[(float(p), float(v)) for p, v in report.get("heldout_curve", ())],
            memory_bytes=int(report.get("memory_bytes", 0)),
            peak_rss_bytes=report.get("peak_rss_bytes"),
            report=report,
        )

    # ---- features jobs ----

    def submit_features_job(
        self,
        model: str,
        *,
        dataset: str | Mapping[str, Any],
        dim: int,
        seed: int = 0,
        version: int | None = None,
        params: list[str] | None = None,
        dtype: Literal["float32", "float64"] = "float32",
        rows_per_chunk: int | None = None,
        sketch: Literal["structured", "gaussian"] | None = None,
    ) -> dict[str, Any]:
        """Queue a features job (POST /v1/feature-jobs): Φ (N, k, D) of the rows, stored as zarr on the server.

        Args:
            model: the registered model. dataset: a data set id or {"dataset", "start", "stop"}. dim: D.
            seed: the sketch's draw (the same seed, D, params and sketch give the same Φ). version, params, dtype,
                rows_per_chunk: as the route's fields. sketch: "structured" (a Kronecker sketch of the weights'
                δ ⊗ a, much faster) or "gaussian" (Φ = J R / √D). Default: None, the server's default
                ("structured"). Kernels from two jobs need the same model version, dim, seed, params and sketch.

        Returns:
            dict: the queued job.

        Raises:
            InvalidInput (422): D over the limits, rows out of range. ModelNotFound / DatasetNotFound (404).
        """
        body = {
            "model": model,
            "version": version,
            "dataset": rows_body(dataset),
            "dim": dim,
            "seed": seed,
            "params": params,
            "dtype": dtype,
            "rows_per_chunk": rows_per_chunk,
            "sketch": sketch,
        }
        return self._submit_job(_FEATURES_ROUTE, body)

    def features_job(self, job_id: str) -> dict[str, Any]:
        """The features job (GET /v1/feature-jobs/{id}), progress {rows_done, rows_total}."""
        return self._job(_FEATURES_ROUTE, job_id)

    def cancel_features_job(self, job_id: str) -> dict[str, Any]:
        """Cancel a queued or running features job (it stops between chunks); returns the job."""
        return self._cancel_job(_FEATURES_ROUTE, job_id)

    def delete_features_job(self, job_id: str) -> dict[str, Any]:
        """Delete a finished features job and its stored Φ; {"id", "deleted", "freed_bytes"} (a queued or running
        job is cancelled and returned instead, as DELETE /v1/feature-jobs/{id} does).

        Raises:
            JobNotFound: no such features job. Conflict: its Φ is being read (retry).
        """
        return self._delete_job(_FEATURES_ROUTE, job_id)

    def wait_features_job(
        self,
        job_id: str,
        *,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
        progress: TextIO | Literal["stderr"] | None = "stderr",
    ) -> dict[str, Any]:
        """As ``wait_solve_job`` for a features job."""
        return self._wait_job(_FEATURES_ROUTE, job_id, poll_s, timeout_s, progress)

    def features_result(self, job_id: str, *, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Φ[rows] (rows, k, D) of a succeeded features job, as .npy.

        Raises:
            JobNotFinished (409): not succeeded. PayloadTooLarge (413): more rows than one answer may hold.
        """
        params = {} if rows is None else {"start": rows[0], "stop": rows[1]}
        path = f"/v1/feature-jobs/{quote(job_id, safe='')}/result"
        response = self._request("GET", path, accept=wire.MEDIA_NPY, params=params)
        phi: np.ndarray = _decode_tensors(response, npy_name="phi")[0]["phi"]
        return phi

    def feature_kernel(
        self,
        x1_job: str,
        x2_job: str | None = None,
        *,
        mode: Literal["full", "trace"] = "full",
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """Φ1[rows] Φ2[cols]ᵀ of two features jobs (POST /v1/feature-jobs/kernel), float64.

        Returns:
            (r, c, k, k) FULL or (r, c) TRACE: an unbiased estimate of Θ for jobs of the same seed, D and params.
        """

        def side(job: str, span: tuple[int, int] | None) -> dict[str, Any]:
            return {"job": job} | ({} if span is None else {"start": span[0], "stop": span[1]})

        body = {"x1": side(x1_job, rows), "x2": side(x2_job or x1_job, cols), "mode": mode}
        response = self._request("POST", "/v1/feature-jobs/kernel", json=body, accept=wire.MEDIA_NPY)
        theta: np.ndarray = _decode_tensors(response, npy_name="theta")[0]["theta"]
        return theta
