"""Batch kernel jobs from Python: submit, wait with a progress bar, download results or slices, cancel.

    >>> job = client.submit_job("mlp", x1=dataset_id, mode="trace")       # doctest: +SKIP
    >>> job = client.wait(job)                  # a live progress bar with ETA on stderr
    >>> theta = client.job_result(job["id"], rows=(0, 512))               # (512, N)

``wait`` follows the server's event stream (``GET /v1/jobs/{id}/events``) and falls back to polling when the
connection drops (a restarting server), so it survives a server restart in the middle of a job.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO, cast
from urllib.parse import quote

import httpx
import numpy as np

from ntk_service import wire
from ntk_service.client._base import BaseClient, _decode_json, _decode_tensors
from ntk_service.client._results import FETCH_BLOCK_BYTES, RemoteResult, download_to, download_zarr, fetch_npy
from ntk_service.client._types import DtypeName, ImplementationName, JobDeletion, JobInfo, JobModeName
from ntk_service.errors import JobFailed, JobNotFinished, NtkServiceError, ServiceUnavailable

__all__ = ["FINISHED", "JobsClient", "format_progress"]

FINISHED = frozenset({"succeeded", "failed", "cancelled"})
"""Job statuses that never change again."""

_RECONNECT_WAIT_S = 1.0
"""Pause before reconnecting to the event stream (or polling) after the connection dropped."""

_BAR_WIDTH = 30

_ACCEPT = {"safetensors": wire.MEDIA_SAFETENSORS, "npy": wire.MEDIA_NPY, "json": wire.MEDIA_JSON}


def format_progress(job: Mapping[str, Any]) -> str:
    """One line: ``[#########.....]  12/21 tiles  57%  ETA 3s  running``."""
    done, total = int(job.get("tiles_done", 0)), int(job.get("tiles_total", 0)) or 1
    filled = round(_BAR_WIDTH * done / total)
    eta = job.get("eta_s")
    eta_text = "ETA --" if eta is None else f"ETA {_duration(float(eta))}"
    return (
        f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {done:>{len(str(total))}}/{total} tiles "
        f"{100 * done / total:3.0f}%  {eta_text}  {job.get('status', '')}"
    )


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _segment(value: str) -> str:
    return quote(str(value), safe="")


def _job_id(job: str | Mapping[str, Any]) -> str:
    return _segment(str(job if isinstance(job, str) else job["id"]))


def _range(value: Any, name: str) -> str | None:
    """``"a:b"`` from ``"a:b"``, ``(a, b)`` or ``slice(a, b)``; None stays None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, slice):
        if value.step not in (None, 1):
            raise ValueError(f"{name}: slices with a step are not supported, got {value}")
        start, stop = value.start, value.stop
    else:
        start, stop = value
    return f"{'' if start is None else int(start)}:{'' if stop is None else int(stop)}"


class JobsClient(BaseClient):
    """The job methods of ``Client`` (see the module docstring)."""

    def _job_side(self, value: Any, name: str) -> dict[str, Any]:
        if isinstance(value, str):
            return {"dataset": value}
        if isinstance(value, Mapping):
            if "dataset" not in value or not set(value) <= {"dataset", "start", "stop"}:
                raise ValueError(
                    f"{name}: a job side is a data set id or {{'dataset': id, 'start': row, 'stop': row}}; "
                    f"got keys {sorted(value)}"
                )
            return {k: (str(v) if k == "dataset" else int(v)) for k, v in value.items() if v is not None}
        raise TypeError(f"{name}: pass a data set id (upload arrays first with upload_dataset); got {type(value)}")

    def submit_job(
        self,
        model: str,
        x1: str | Mapping[str, str],
        x2: str | Mapping[str, str] | None = None,
        *,
        mode: JobModeName = "full",
        implementation: ImplementationName = "auto",
        dtype: DtypeName = "float32",
        params: Sequence[str] | None = None,
        version: int | None = None,
        tile_size: int | None = None,
        panel_tiles: int | None = None,
        output: str | None = None,
    ) -> JobInfo:
        """Submit a batch kernel job over whole data sets (write scope).

        Args:
            model (str): the model's name.
            x1 (str | dict): data set id of x1 (N examples), or ``{"dataset": id}``, or
                ``{"dataset": id, "start": a, "stop": b}`` for rows ``[a, b)`` of it.
            x2 (str | dict | None): data set id of x2 (M examples); None means x2 = x1, and only the tiles on and
                above the diagonal are computed. Default: None.
            mode, implementation, dtype, params, version: as for ``ntk``. Default: "full", "auto", "float32",
                all parameters, the latest version.
            tile_size (int | None): examples per tile side. Default: the server's (NTK_JOB_TILE_SIZE).
            panel_tiles (int | None): tiles per panel side, the unit of work (docs/jobs.md). Default: the server's
                cost model (NTK_JOB_PANEL_SECONDS of work per panel).
            output (str | None): where the model returns a mapping, the output to differentiate (``"logits"``,
                ``"logits[:, 0]"``, as ``compute_ntk``'s ``output=``). Default: None (the model returns a tensor).

        Returns:
            The job record (``id``, ``status``, ``tiles_total``, ``result_shape``, ...).

        Raises:
            ModelNotFound, DatasetNotFound, InvalidInput, DiskEstimateExceeded (413, with the estimate).
        """
        body = {
            "model": model,
            "version": version,
            "x1": self._job_side(x1, "x1"),
            "x2": None if x2 is None else self._job_side(x2, "x2"),
            "mode": mode,
            "implementation": implementation,
            "dtype": dtype,
            "params": None if params is None else list(params),
            "tile_size": tile_size,
            "panel_tiles": panel_tiles,
            "output": output,
        }
        return cast(
            JobInfo, dict(self._send_json("POST", "/v1/jobs", {k: v for k, v in body.items() if v is not None}))
        )

    def get_job(self, job_id: str) -> JobInfo:
        """The job's record with progress (``tiles_done``, ``progress``, ``eta_s``). Raises ``JobNotFound``."""
        return cast(JobInfo, dict(self._get_json(f"/v1/jobs/{_segment(job_id)}")))

    def list_jobs(self) -> list[JobInfo]:
        """All jobs, newest first."""
        body = self._get_json("/v1/jobs")
        return [cast(JobInfo, dict(item)) for item in body["data"]]

    def cancel_job(self, job_id: str) -> JobInfo:
        """Cancel a job (write scope): running tiles finish, no new tile starts; a finished job is left as it is.
        Returns the record."""
        response = self._request(
            "DELETE", f"/v1/jobs/{_segment(job_id)}", params={"cancel_only": "true"}, accept=wire.MEDIA_JSON
        )
        return cast(JobInfo, dict(_decode_json(response)))

    def delete_job(self, job: str | Mapping[str, Any], *, keep_record: bool = False) -> JobDeletion | JobInfo:
        """Delete a finished job's result from the server's disk (write scope); a running job is cancelled instead.

        Args:
            job: the job id or record.
            keep_record (bool): keep the job's record (``result_deleted_at`` set). Default: False.

        Returns:
            ``{"id", "deleted": "job" | "result", "freed_bytes"}`` (or the cancelled job's record).

        Raises:
            JobNotFound: no such job (e.g. deleted already). ResultNotFound: its result was deleted already.
            Conflict: its result is being read right now (a download, or a running job that uses it).
        """
        params = {"keep_record": "true" if keep_record else None}
        response = self._request("DELETE", f"/v1/jobs/{_job_id(job)}", params=params, accept=wire.MEDIA_JSON)
        return cast("JobDeletion | JobInfo", dict(_decode_json(response)))

    def wait(
        self,
        job: str | Mapping[str, Any],
        *,
        progress: bool = True,
        timeout: float | None = None,
        stream: TextIO | None = None,
    ) -> JobInfo:
        """Block until the job finishes, optionally drawing a progress bar with ETA.

        Args:
            job: the job id or record.
            progress (bool): draw the bar on ``stream``. Default: True.
            timeout (float | None): give up after this many seconds. Default: wait as long as it takes.
            stream (TextIO | None): where the bar goes. Default: sys.stderr.

        Returns:
            The finished job's record (status "succeeded" or "cancelled").

        Raises:
            JobFailed: the job failed (its error message).
            TimeoutError: ``timeout`` passed first (the job keeps running; wait again or cancel it).
        """
        job_id = str(job if isinstance(job, str) else job["id"])
        out = stream or sys.stderr
        deadline = None if timeout is None else time.monotonic() + timeout
        record = self.get_job(job_id)
        try:
            while record.get("status") not in FINISHED:
                if progress:
                    out.write("\r" + format_progress(record))
                    out.flush()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"wait: job {job_id} still {record.get('status')} after {timeout} s")
                record = self._follow_events(job_id, record, out if progress else None, deadline)
        finally:
            if progress:
                out.write("\r" + format_progress(record) + "\n")
                out.flush()
        if record["status"] == "failed":
            raise JobFailed(f"job {job_id} failed: {record.get('error')}")
        return record

    def _follow_events(self, job_id: str, last: JobInfo, out: TextIO | None, deadline: float | None) -> JobInfo:
        """Read the event stream until the job ends (or the stream breaks); returns the latest record."""
        record = last
        read_timeout = None if deadline is None else max(1.0, deadline - time.monotonic())
        try:
            with self._http.stream(
                "GET",
                f"/v1/jobs/{_segment(job_id)}/events",
                headers={"Accept": "text/event-stream"},
                timeout=httpx.Timeout(30.0, read=read_timeout),
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    return self.get_job(job_id)  # raises the mapped error (e.g. JobNotFound)
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        record = cast(JobInfo, dict(json.loads(line[5:])))
                        if out is not None:
                            out.write("\r" + format_progress(record))
                            out.flush()
                        if record.get("status") in FINISHED:
                            return record
                        if deadline is not None and time.monotonic() > deadline:
                            return record
        except (httpx.TransportError, ServiceUnavailable):
            time.sleep(_RECONNECT_WAIT_S)  # the server restarts: its jobs resume, so keep following
        try:
            return self.get_job(job_id)
        except ServiceUnavailable:
            return record

    def job_result(
        self,
        job_id: str,
        rows: str | tuple[int | None, int | None] | slice | None = None,
        cols: str | tuple[int | None, int | None] | slice | None = None,
        *,
        as_torch: bool = False,
    ) -> Any:
        """The kernel of a succeeded job, whole or the block ``rows × cols``.

        Args:
            job_id (str): the job id.
            rows: row range as ``"a:b"``, ``(a, b)`` or ``slice(a, b)``. Default: all N rows.
            cols: column range, same forms. Default: all M columns (none for a per-example mode).
            as_torch (bool): return a torch tensor. Default: False (numpy).

        Returns:
            theta: the mode's shape (``vocabulary.MODES``) for rows b-a and columns d-c: e.g. (b-a, d-c, k, k)
            full, (b-a, d-c) trace, (b-a, k, k) example_diagonal.

        Raises:
            JobNotFinished: 409 while the job has not succeeded. JobNotFound. InvalidInput: a bad range.
        """
        params = {"rows": _range(rows, "rows"), "cols": _range(cols, "cols")}
        if self.transport_format == "npy":  # streamed into the array: held once, not as a body and an array
            theta = fetch_npy(self, _segment(job_id), params)
            if as_torch:
                import torch  # lazily: the client imports without torch

                return torch.from_numpy(theta)
            return theta
        response = self._request(
            "GET", f"/v1/jobs/{_segment(job_id)}/result", params=params, accept=_ACCEPT[self.transport_format]
        )
        if response.headers.get("content-type", "").startswith(wire.MEDIA_JSON):
            theta = wire.tensor_from_json(_decode_json(response).get("theta"), name="theta")
        else:
            tensors, _ = _decode_tensors(response, npy_name="theta")
            if "theta" not in tensors:
                raise NtkServiceError(f"job result: no tensor 'theta' in the response (got {sorted(tensors)})")
            theta = tensors["theta"]
        if as_torch:
            import torch  # lazily: the client imports without torch

            return torch.from_numpy(np.ascontiguousarray(theta))
        return theta

    def download_result(
        self,
        job: str | Mapping[str, Any],
        path: str | Path,
        *,
        rows: str | tuple[int | None, int | None] | slice | None = None,
        cols: str | tuple[int | None, int | None] | slice | None = None,
    ) -> np.ndarray:
        """Stream a succeeded job's kernel (or the block ``rows × cols``) to a ``.npy`` file, chunk by chunk.

        Neither side holds the whole result in memory: the server sends it row block by row block, this writes each
        chunk as it arrives (to ``<path>.part``, renamed to ``path`` once complete).

        Args:
            job: the job id or record.
            path: the ``.npy`` file to write.
            rows, cols: as for ``job_result``. Default: the whole result.

        Returns:
            The file as a read-only ``np.memmap``: (N, M) trace, (N, M, k, k) full, ...

        Raises:
            JobNotFinished, JobNotFound, ResultNotFound, InvalidInput (a bad range); NtkServiceError when the
            download is cut off (nothing is left at ``path``).
        """
        params = {"rows": _range(rows, "rows"), "cols": _range(cols, "cols")}
        return download_to(self, _job_id(job), Path(path), params)

    def download_zarr(self, job: str | Mapping[str, Any], path: str | Path) -> Path:
        """Stream a succeeded job's result group, zipped, to ``path`` (``GET /v1/jobs/{id}/zarr``): the same Zarr
        group as on the server's disk, with its dimension names and attributes (docs/results.md).

        Open it with ``xarray.open_zarr(zarr.storage.ZipStore(path, mode="r"))`` (a symmetric result holds only the
        tiles on and above the diagonal there), or with ``client.result_array(job).to_xarray(path)``, which
        downloads and mirrors in one call.

        Args:
            job: the job id or record.
            path: the zip file to write (``<path>.part`` until complete).

        Returns:
            Path: ``path``.

        Raises:
            JobNotFinished, JobNotFound, ResultNotFound; NtkServiceError when the download is cut off.
        """
        return download_zarr(self, _job_id(job), Path(path))

    def result_array(self, job: str | Mapping[str, Any], *, fetch_block_bytes: int = FETCH_BLOCK_BYTES) -> RemoteResult:
        """A succeeded job's kernel as a lazy array: ``remote[a:b, c:d]`` fetches only that block (``?rows=&cols=``),
        mirrored below the diagonal by the server for symmetric jobs.

        Args:
            job: the job id or record.
            fetch_block_bytes (int): the most a strided slice (``remote[::10, ::10]``) fetches at a time, at least
                one row. Default: ``FETCH_BLOCK_BYTES`` (64 MiB).

        Returns:
            RemoteResult: shape (N, M, k, k) full, (N, M) trace, ...; indexing returns numpy.

        Raises:
            JobNotFinished: the job has not succeeded. JobNotFound.
        """
        record = self.get_job(_job_id(job))
        if record.get("status") != "succeeded":
            raise JobNotFinished(
                f"result_array: job {record['id']} is {record.get('status')}; wait for it (client.wait(job)) first"
            )
        return RemoteResult(self, record, fetch_block_bytes=fetch_block_bytes)
