"""The one place where errors become HTTP responses: ``{"error": {"type": ..., "message": ...}}``.

Domain errors (``ntk_service.errors``) carry their own ``http_status`` and ``error_type``; FastAPI's own
errors (validation, unknown route, wrong method) are translated to the same body shape, so a client never has
to parse two formats. Anything unexpected becomes a 500 ``internal_error`` whose message hides internals (the
traceback goes to the log); bad input must never land there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from ntk_service.errors import (
    AuthenticationError,
    Busy,
    DiskEstimateExceeded,
    MalformedRequest,
    MemoryEstimateExceeded,
    NtkServiceError,
)

__all__ = ["error_response", "install_error_handlers", "format_validation_errors"]

logger = logging.getLogger(__name__)

_STATUS_TYPES: Mapping[int, str] = {
    400: "malformed_request",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
    429: "busy",
    503: "service_unavailable",
}


def error_response(
    status: int,
    error_type: str,
    message: str,
    *,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Response:
    """The wire error body ``{"error": {"type", "message", **extra}}`` as a JSON response."""
    body = orjson.dumps({"error": {"type": error_type, "message": message, **(extra or {})}})
    return Response(body, status_code=status, media_type="application/json", headers=dict(headers or {}))


def _headers_for(exc: NtkServiceError) -> dict[str, str]:
    headers: dict[str, str] = {}
    if isinstance(exc, Busy):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if isinstance(exc, AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def _loc_to_field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def format_validation_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """pydantic errors as one line: ``"architecture.family: Field required; seed: Input should be ..."``."""
    return "; ".join(f"{_loc_to_field(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors)


async def _domain_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, NtkServiceError)
    if exc.http_status >= 500 and not isinstance(exc, Busy):
        logger.error("%s %s failed: %s", request.method, request.url.path, exc.message)
    extra = {}
    if isinstance(exc, MemoryEstimateExceeded | DiskEstimateExceeded):
        extra = {"estimate_bytes": exc.estimate_bytes, "budget_bytes": exc.budget_bytes}
    return error_response(exc.http_status, exc.error_type, exc.message, headers=_headers_for(exc), extra=extra)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        reason = (detail.get("ctx") or {}).get("error", "invalid JSON")
        err = MalformedRequest(f"{request.method} {request.url.path}: the body is not valid JSON ({reason})")
        return await _domain_error(request, err)
    message = f"{request.method} {request.url.path}: {format_validation_errors(errors)}"
    return error_response(422, "invalid_input", message)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's Allow header names only the first route's)."""
    methods: set[str] = set()
    for route in [*request.app.router.routes, *getattr(request.app.state, "api_routes", ())]:
        match, _ = route.matches({**request.scope, "method": "OPTIONS-PROBE"})
        if match is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        message = f"no route {request.method} {request.url.path}; the API reference is at /docs"
    elif status == 405:
        allowed = _allowed_methods(request)
        headers = {**(exc.headers or {}), "Allow": ", ".join(allowed)}
        message = f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        return error_response(405, "method_not_allowed", message, headers=headers)
    else:
        message = str(exc.detail)
    error_type = _STATUS_TYPES.get(status, "http_error")
    return error_response(status, error_type, message, headers=exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.exception("%s %s: unexpected error", request.method, request.url.path, exc_info=exc)
    return error_response(
        500,
        "internal_error",
        f"{request.method} {request.url.path}: internal error; the server log has details",
    )


def install_error_handlers(app: FastAPI) -> None:
    """Register the translations above on ``app`` (called once by ``create_app``)."""
    app.add_exception_handler(NtkServiceError, _domain_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
