"""What the client does the same way for every job kind with the standard routes (``server/job_routes.py``):
submit, get, list, cancel, delete and follow a job until it ends.

A kind is a ``JobRoute`` (its path, how a progress line reads, the type of its records); the public methods of
``Client`` (``solve_job``, ``wait_attribution_job``, ...) are a docstring and one call into ``JobRoutesClient``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TextIO, TypeVar, cast
from urllib.parse import quote

import httpx

from ntk_service import wire
from ntk_service.client._base import BaseClient, _decode_json
from ntk_service.errors import JobFailed, ServiceUnavailable

__all__ = ["FINISHED", "JobRoute", "JobRoutesClient", "rows_body"]

FINISHED = frozenset({"succeeded", "failed", "cancelled"})
"""The statuses a job never leaves."""

J = TypeVar("J")


@dataclass(frozen=True, slots=True)
class JobRoute(Generic[J]):
    """A job kind's routes as the client sees them.

    Attributes:
        path: where its jobs are, e.g. "/v1/solve-jobs". describe: a job as one progress line (``wait``).
        J: the type of its job records (a ``TypedDict`` or ``dict[str, Any]``).
    """

    path: str
    describe: Callable[[Mapping[str, Any]], str]

    def item(self, job_id: str) -> str:
        """The path of one job."""
        return f"{self.path}/{quote(job_id, safe='')}"


def rows_body(value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A data set id or ``{"dataset", "start", "stop"}`` as the routes' rows object (None stays None)."""
    if value is None or isinstance(value, Mapping):
        return None if value is None else dict(value)
    return {"dataset": value}


class JobRoutesClient(BaseClient):
    """The standard job routes' calls, shared by every kind's public methods."""

    def _submit_job(self, route: JobRoute[J], body: Mapping[str, Any]) -> J:
        """POST the body (fields that are None left out: the server's defaults) and return the queued job."""
        return cast(J, self._send_json("POST", route.path, {k: v for k, v in body.items() if v is not None}))

    def _job(self, route: JobRoute[J], job_id: str) -> J:
        return cast(J, self._get_json(route.item(job_id)))

    def _jobs(self, route: JobRoute[J]) -> list[J]:
        return cast(list[J], self._get_json(route.path)["data"])

    def _cancel_job(self, route: JobRoute[J], job_id: str) -> J:
        response = self._request("DELETE", route.item(job_id), params={"cancel_only": "true"}, accept=wire.MEDIA_JSON)
        return cast(J, _decode_json(response))

    def _delete_job(self, route: JobRoute[Any], job_id: str) -> dict[str, Any]:
        return cast(dict[str, Any], self._send_json("DELETE", route.item(job_id)))

    def _wait_job(
        self,
        route: JobRoute[J],
        job_id: str,
        poll_s: float,
        timeout_s: float | None,
        progress: TextIO | Literal["stderr"] | None,
    ) -> J:
        """Follow the job until it finishes (its event stream; polling every ``poll_s`` s while the stream is
        broken), writing ``route.describe`` lines to ``progress`` when they change.

        Raises:
            JobFailed: the job failed. ServiceUnavailable: ``timeout_s`` passed first.
        """
        # "stderr" is looked up now, not bound when the module was imported: the stream may have been replaced since
        out = sys.stderr if progress == "stderr" else progress
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        shown = [""]

        def show(job: dict[str, Any]) -> None:
            line = route.describe(job)
            if out is not None and line != shown[0]:
                out.write(line + "\n")
                out.flush()
                shown[0] = line

        while True:
            job = cast(dict[str, Any], self._job(route, job_id))
            show(job)
            if job["status"] not in FINISHED:
                job = self._follow(f"{route.item(job_id)}/events", job, show, deadline)
            if job["status"] in FINISHED:
                if job["status"] == "failed":
                    raise JobFailed(f"wait: {job.get('job', 'solve')} job {job_id} failed: {job.get('error')}")
                return cast(J, job)
            if deadline is not None and time.monotonic() > deadline:
                raise ServiceUnavailable(
                    f"wait: job {job_id} is still {job['status']} after {timeout_s} s; wait again "
                    "or pass a larger timeout_s"
                )
            time.sleep(poll_s)

    def _follow(
        self, path: str, job: dict[str, Any], show: Callable[[dict[str, Any]], None], deadline: float | None
    ) -> dict[str, Any]:
        """Read the job's event stream until it ends, the deadline passes or the stream breaks; the latest job."""
        read_timeout = None if deadline is None else max(1.0, deadline - time.monotonic())
        try:
            with self._http.stream(
                "GET", path, headers={"Accept": "text/event-stream"}, timeout=httpx.Timeout(30.0, read=read_timeout)
            ) as response:
                if response.status_code >= 400:
                    return job  # the caller's next GET raises the mapped error
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        job = dict(json.loads(line[5:]))
                        show(job)
                        if job["status"] in FINISHED or (deadline is not None and time.monotonic() > deadline):
                            return job
        except httpx.TransportError:
            pass  # polled instead: the caller sleeps poll_s and asks again
        return job
