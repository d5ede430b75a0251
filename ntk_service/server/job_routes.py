"""What the routes of every job kind share: the constants, the event stream, cancel-or-delete, and ``job_router``,
which builds a kind's standard routes (submit, list, show, events, cancel or delete) from its route schema.

    POST   <prefix>              202 + Location: the queued job (its body: the kind's route schema)
    GET    <prefix>              {"data": [job, ...], "count"}, newest first
    GET    <prefix>/{id}         the job: status, progress while it runs, result summary once succeeded
    GET    <prefix>/{id}/events  text/event-stream: a "progress" event per change, one "end" event when finished
    DELETE <prefix>/{id}         cancel a queued or running job; delete a finished one with its files
                                 (?cancel_only=true: only cancel)

A kind's route module (``routes/solve_jobs.py``) is its schema, ``router = job_router(...)`` and the routes only it
has (its result). The kernel job's routes (``routes/jobs.py``) predate this shape and keep their own JSON form, but
share the event stream and the constants.

NOTE [planning off the limiter]
    A submission plans its job at once: it probes the model on one example of each side (milliseconds), in a worker
    thread but outside the compute limiter, so that it is answered while jobs hold every compute slot instead of
    queueing behind a running unit (a panel takes seconds, and a queue full of them would make it a 429). Every unit
    of the job itself, and every other computation of the job routes (a kernel from features), takes a slot.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import anyio.to_thread
import numpy as np
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pydantic import BaseModel
from starlette.responses import Response

from ntk_service import wire
from ntk_service.config import Settings
from ntk_service.errors import JobNotFound, PayloadTooLarge, format_bytes
from ntk_service.jobs import JobManager, JobRecord
from ntk_service.jobs.kinds.base import JobKind
from ntk_service.jobs.records import TERMINAL_STATUSES
from ntk_service.server.deps import JobsDep, ReadAccess, WriteAccess
from ntk_service.server.media import collection_response, json_response, read_json
from ntk_service.server.params import ID_MAX_LENGTH
from ntk_service.server.schemas import openapi_body, validate_body

__all__ = [
    "EVENT_POLL_S",
    "FINISHED",
    "JSON_BYTES_PER_VALUE",
    "RESULT_TYPES",
    "CancelOnly",
    "JobIdPath",
    "JobRouteText",
    "array_response",
    "check_answer_size",
    "job_events",
    "job_router",
    "public_job",
]

EVENT_POLL_S = 0.25
"""How often an open event stream looks for a change of its job (an in-memory counter, no database read unless it
moved); FastAPI itself sends keep-alive comments on a quiet stream."""

FINISHED = frozenset(status.value for status in TERMINAL_STATUSES)
"""The wire values of the statuses a job never leaves."""

JSON_BYTES_PER_VALUE = 24
"""The most bytes orjson writes for one float64 (``-1.2345678901234567e-123,``): a JSON answer is sized by it."""

RESULT_TYPES = (wire.MEDIA_JSON, wire.MEDIA_NPY, wire.MEDIA_SAFETENSORS)
"""A result download, JSON first (the default without ``Accept``)."""

JobIdPath = Annotated[str, Path(max_length=ID_MAX_LENGTH, description="The job's id, as its POST returned it.")]

CancelOnly = Annotated[
    bool, Query(description="Only cancel: a finished job is left as it is. Default: false (a finished job is deleted).")
]


def check_answer_size(media: str, shape: tuple[int, ...], itemsize: int, settings: Settings, operation: str) -> None:
    """Refuse an answer of ``shape`` over the response limit of ``media`` before it is built.

    Raises:
        PayloadTooLarge (413): the size and the limit, and how to ask for less.
    """
    values = math.prod(shape)
    if media == wire.MEDIA_JSON:
        size, limit = values * JSON_BYTES_PER_VALUE, settings.max_json_response_bytes
    else:
        size, limit = values * itemsize, settings.max_binary_response_bytes
    if size > limit:
        raise PayloadTooLarge(
            f"{operation}: the answer {tuple(shape)} is about {format_bytes(size)} as {media}, over the limit of "
            f"{format_bytes(limit)}; ask for fewer rows (start / stop) or a binary Accept type"
        )


def array_response(media: str, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any] | None = None) -> Response:
    """Arrays as ``media``: .npy (the first array alone), safetensors (every array, ``metadata`` as JSON strings) or
    JSON (``{name: tensor, ...}`` and the metadata's fields)."""
    if media == wire.MEDIA_NPY:
        return Response(wire.encode_npy(next(iter(arrays.values()))), media_type=wire.MEDIA_NPY)
    if media == wire.MEDIA_SAFETENSORS:
        meta = {name: wire.json_dumps(value).decode() for name, value in (metadata or {}).items()}
        return Response(wire.encode_safetensors(dict(arrays), meta), media_type=wire.MEDIA_SAFETENSORS)
    return json_response({**(metadata or {}), **{name: wire.tensor_to_json(a) for name, a in arrays.items()}})


async def job_events(
    manager: JobManager, job_id: str, first: dict[str, Any], describe: Callable[[str], dict[str, Any]]
) -> AsyncIterator[ServerSentEvent]:
    """The event stream of a job: ``first`` (its JSON form, found before the response starts, so a wrong id is a
    404) as a "progress" event, again (``describe(job_id)``) at every change, and an "end" event once finished."""
    public = first
    while True:
        seen = manager.version(job_id)
        finished = public["status"] in FINISHED
        yield ServerSentEvent(data=public, event="end" if finished else "progress")
        if finished:
            return
        while manager.version(job_id) == seen:
            await asyncio.sleep(EVENT_POLL_S)
        try:
            public = await anyio.to_thread.run_sync(describe, job_id)
        except JobNotFound:  # finished and deleted between two looks: the stream ends; a GET now says 404
            return


def public_job(manager: JobManager, record: JobRecord[Any, Any, Any]) -> dict[str, Any]:
    """The JSON form of a job of a kind with standard routes: id, job (its kind), status, kind (what it computes),
    spec, progress (while it runs, and as it ended), result (its summary once succeeded), error and UNIX times."""
    kind = manager.kinds[record.kind]
    spec = kind.encode_spec(record.spec)
    progress = manager.progress(record)
    return {
        "id": record.id,
        "job": record.kind,
        "status": record.status.value,
        "kind": spec.get("kind", record.kind),
        "spec": spec,
        "progress": None if progress is None else kind.encode_progress(progress),
        "result": None if record.result is None else kind.encode_result(record.result),
        "error": record.error,
        "created_at": record.created_at,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
    }


@dataclass(frozen=True, slots=True)
class JobRouteText:
    """What a kind's standard routes say in the OpenAPI document.

    Attributes:
        noun: names the routes' operations: ``submit_{noun}_job``, ``list_{noun}_jobs``, ``get_{noun}_job``,
            ``{noun}_job_events``, ``delete_{noun}_job``. tag: the OpenAPI tag.
        progress: what its progress events carry. cancel: what cancelling a running job does. delete: what
            deleting a finished one removes. title: the job in summaries. Default: None, the kind's noun
            ("solve job").
    """

    noun: str
    tag: str
    progress: str
    cancel: str
    delete: str
    title: str | None = None


def job_router(
    kind: JobKind[Any, Any, Any, Any],
    *,
    create: type[BaseModel],
    request_of: Callable[[Any], Any],
    text: JobRouteText,
    prefix: str | None = None,
) -> APIRouter:
    """A kind's standard routes (module docstring) under ``prefix``.

    Args:
        kind: the job kind (``jobs/kinds``). create: the route schema of the POST body. request_of: the kind's
            typed request from a validated body. text: the summaries and names.
        prefix: the routes' path. Default: None, the kind's route (e.g. "/v1/solve-jobs").

    Returns:
        An APIRouter; add the kind's own routes (its result) to it.
    """
    prefix = kind.route if prefix is None else prefix
    title = kind.noun if text.title is None else text.title
    router = APIRouter(prefix=prefix, tags=[text.tag])
    not_found: dict[int | str, dict[str, Any]] = {404: {"description": f"No {title} with this id."}}

    def describe(manager: JobManager, job_id: str) -> dict[str, Any]:
        return public_job(manager, manager.get(job_id, kind))

    async def existing(job_id: JobIdPath, manager: JobsDep) -> dict[str, Any]:
        """The job's JSON form; 404 before any response starts. Declared after the access dependency, so a caller
        without a key learns nothing about which jobs exist (dependencies resolve in parameter order)."""
        return await anyio.to_thread.run_sync(describe, manager, job_id)

    @router.post(
        "",
        status_code=202,
        name=f"submit_{text.noun}_job",
        summary=f"Submit a {title}",
        openapi_extra=openapi_body(create),
        responses={404: {"description": "The model, version or a data set does not exist."}},
    )
    async def submit(request: Request, _: WriteAccess, manager: JobsDep) -> Response:
        operation = f"submit {title}"
        body = validate_body(create, await read_json(request, operation=operation), operation=operation)
        # NOTE [planning off the limiter]
        record = await anyio.to_thread.run_sync(lambda: manager.create(request_of(body)))
        return json_response(
            public_job(manager, record), status_code=202, headers={"Location": f"{prefix}/{record.id}"}
        )

    @router.get("", name=f"list_{text.noun}_jobs", summary=f"List {title}s")
    async def list_jobs(_: ReadAccess, manager: JobsDep) -> Response:
        records = await anyio.to_thread.run_sync(manager.list, kind)
        return collection_response([public_job(manager, record) for record in records])

    @router.get("/{job_id}", name=f"get_{text.noun}_job", summary=f"A {title} and its progress", responses=not_found)
    async def get_job(job_id: JobIdPath, _: ReadAccess, job: dict[str, Any] = Depends(existing)) -> Response:
        return json_response(job)

    @router.get(
        "/{job_id}/events",
        name=f"{text.noun}_job_events",
        response_class=EventSourceResponse,
        summary=f"A {title}'s progress as Server-Sent Events until it ends",
        description=f'A "progress" event (data: the job as JSON, {text.progress}) at every change, then one "end" '
        "event.",
        responses=not_found,
    )
    async def events(
        job_id: JobIdPath, _: ReadAccess, manager: JobsDep, job: dict[str, Any] = Depends(existing)
    ) -> AsyncIterator[ServerSentEvent]:
        async for event in job_events(manager, job_id, job, lambda job_id: describe(manager, job_id)):
            yield event

    @router.delete(
        "/{job_id}",
        name=f"delete_{text.noun}_job",
        summary=f"Cancel a queued or running {title}; delete a finished one and {text.delete}",
        description=f"A queued or running job is cancelled ({text.cancel}). A finished job is removed with "
        f"{text.delete} (its bytes return to the disk budget), unless cancel_only=true.",
        responses={**not_found, 409: {"description": "Its result is being read; retry when the read is done."}},
    )
    async def delete(job_id: JobIdPath, _: WriteAccess, manager: JobsDep, cancel_only: CancelOnly = False) -> Response:
        def act() -> dict[str, Any]:
            record = manager.get(job_id, kind)
            if cancel_only or not record.is_finished:
                return public_job(manager, manager.cancel(job_id, kind))
            return {"id": job_id, "deleted": "job", "freed_bytes": manager.delete(job_id, kind=kind).freed_bytes}

        return json_response(await anyio.to_thread.run_sync(act))

    return router
