"""Liveness, readiness and metrics: no authentication, no work on the event loop beyond a few microseconds."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ntk_service.errors import ServiceUnavailable
from ntk_service.server.deps import MetricsDep
from ntk_service.server.media import json_response
from ntk_service.server.metrics import CONTENT_TYPE_LATEST

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
async def healthz() -> Response:
    return json_response({"status": "ok"})


@router.get("/readyz", summary="Readiness: registry and data sets are open (503 until then); names the compute device")
async def readyz(request: Request) -> Response:
    if not getattr(request.app.state, "ready", False):
        raise ServiceUnavailable("readyz: the server is starting or stopping; retry shortly", retry_after_s=1)
    return json_response({"status": "ready", "device": str(request.app.state.device)})


@router.get("/metrics", summary="Prometheus metrics (text exposition format)")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
