"""Liveness, readiness, metrics and ``GET /v1/info``: nothing here does more than microseconds of work on the event
loop (the metrics render, which reads the job store, runs in a worker thread)."""

from __future__ import annotations

import platform
from typing import Literal

import anyio.to_thread
import numpy as np
import torch
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import PlainTextResponse, Response

from ntk_service import __version__
from ntk_service.errors import ServiceUnavailable
from ntk_service.server.deps import MetricsDep, ReadAccess, SettingsDep
from ntk_service.server.media import json_response
from ntk_service.server.metrics import CONTENT_TYPE_LATEST

__all__ = ["HealthPublic", "InfoLimits", "InfoPublic", "ReadyPublic", "router"]

router = APIRouter(tags=["health"])

DEVICE = "cpu"
"""The default device (NTK_DEVICE), the example OpenAPI shows; the answers say the device the server resolved."""


class InfoLimits(BaseModel):
    """The limits a request meets (bytes unless named otherwise; null: the server decides per request)."""

    max_body_bytes: int = Field(description="Largest request body (413 above).")
    max_json_response_bytes: int = Field(description="Largest JSON kernel response (406 above: use a binary type).")
    memory_budget_bytes: int | None = Field(description="Peak memory one kernel may plan for; null: a share of RAM.")
    compute_concurrency: int = Field(description="Kernel computations running at once.")
    max_queue: int = Field(description="Kernel requests that may wait for a slot before 429.")
    job_tile_size: int = Field(description="Examples per tile side when a job names none.")
    job_disk_budget_bytes: int | None = Field(description="Largest job result on disk; null: 90% of free space.")


class InfoPublic(BaseModel):
    """What a client records for provenance: which server computed a kernel, on what."""

    version: str = Field(description="ntk-service version.", examples=[__version__])
    torch: str = Field(description="torch version the engine runs.", examples=["2.13.0+cpu"])
    numpy: str = Field(description="numpy version.", examples=["2.4.6"])
    python: str = Field(description="Python version.", examples=["3.11.7"])
    executor: Literal["local", "ray"] = Field(description="Where job tiles run.")
    device: str = Field(description="Where kernels are computed.", examples=[DEVICE])
    limits: InfoLimits


class HealthPublic(BaseModel):
    """``GET /healthz``: the process answers."""

    status: Literal["ok"] = Field(description='Always "ok" (no answer at all means not alive).', examples=["ok"])


class ReadyPublic(BaseModel):
    """``GET /readyz``: registry and data sets are open."""

    status: Literal["ready"] = Field(description='"ready" (503 with an error body until then).', examples=["ready"])
    device: str = Field(description="Where kernels are computed.", examples=[DEVICE])


@router.get("/healthz", response_model=HealthPublic, summary="Liveness: the process answers")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get(
    "/readyz",
    response_model=ReadyPublic,
    responses={503: {}},
    summary="Readiness: registry and data sets are open (503 until then); names the compute device",
)
async def readyz(request: Request) -> Response:
    if not getattr(request.app.state, "ready", False) or request.app.state.drain.is_set:
        raise ServiceUnavailable("readyz: the server is starting or stopping; retry shortly", retry_after_s=1)
    return json_response({"status": "ready", "device": str(request.app.state.device)})


@router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text exposition format)")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(await anyio.to_thread.run_sync(metrics.render), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/info", response_model=InfoPublic, summary="Server and torch versions, limits, executor, device")
async def get_info(request: Request, _: ReadAccess, settings: SettingsDep) -> Response:
    info = InfoPublic(
        version=__version__,
        torch=torch.__version__,
        numpy=np.__version__,
        python=platform.python_version(),
        executor=settings.executor,
        device=str(request.app.state.device),  # what NTK_DEVICE resolved to, as /readyz says
        limits=InfoLimits(
            max_body_bytes=settings.max_body_bytes,
            max_json_response_bytes=settings.max_json_response_bytes,
            memory_budget_bytes=settings.memory_budget_bytes,
            compute_concurrency=settings.compute_concurrency,
            max_queue=settings.max_queue,
            job_tile_size=settings.job_tile_size,
            job_disk_budget_bytes=settings.job_disk_budget_bytes,
        ),
    )
    return json_response(info.model_dump(mode="json"))
