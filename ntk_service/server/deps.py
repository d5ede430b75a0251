"""``Annotated`` dependencies: the lifespan's objects (from ``app.state``) and the auth scopes.

Routes declare what they need by type, e.g. ``def list_models(_: ReadAccess, registry: RegistryDep)``; nothing
here holds state of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ntk_service.config import Scope, Settings
from ntk_service.errors import ServiceUnavailable
from ntk_service.jobs import JobManager
from ntk_service.kernels import SideCache
from ntk_service.registry import DatasetStore, ModelRegistry
from ntk_service.server.auth import KeyRing, Principal
from ntk_service.server.compute import ComputeLimiter
from ntk_service.server.metrics import Metrics

__all__ = [
    "AUTH_DEPENDENCIES",
    "COMPUTE_DEPENDENCIES",
    "ComputeDep",
    "DatasetsDep",
    "JobsDep",
    "MetricsDep",
    "ReadAccess",
    "RegistryDep",
    "SettingsDep",
    "SideCacheDep",
    "WriteAccess",
    "app_state",
]

_bearer = HTTPBearer(
    auto_error=False,
    description="An API key from the operator (NTK_API_KEYS): 'read' lists and computes, 'write' also changes.",
)


def app_state(request: Request, name: str) -> Any:
    """``app.state.<name>``, the lifespan's object.

    Raises:
        ServiceUnavailable: the lifespan has not built it (starting or stopping; 503 with Retry-After).
    """
    value = getattr(request.app.state, name, None)
    if value is None:
        raise ServiceUnavailable(
            f"{request.method} {request.url.path}: the server is not ready (starting or stopping); retry shortly",
            retry_after_s=1,
        )
    return value


def _from_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency returning ``app.state.<name>`` (503 while the lifespan has not built it)."""

    async def get(request: Request) -> Any:
        return app_state(request, name)

    return get


def _authorizer(needed: Scope) -> Any:
    async def authorize(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> Principal:
        keyring: KeyRing = request.app.state.keyring
        token = credentials.credentials if credentials is not None else None
        sent = "authorization" in request.headers  # HTTPBearer gives None for a header without "Bearer <key>"
        return keyring.authorize(token, needed, operation=f"{request.method} {request.url.path}", header_sent=sent)

    return authorize


_read = _authorizer("read")
_write = _authorizer("write")
_limiter = _from_state("limiter")

AUTH_DEPENDENCIES: dict[Callable[..., Any], Scope] = {_read: "read", _write: "write"}
"""The scope each access dependency checks: the OpenAPI pass (``server/openapi.py``) documents 401/403 from it."""

COMPUTE_DEPENDENCIES: frozenset[Callable[..., Any]] = frozenset({_limiter})
"""Dependencies whose routes queue for a compute slot: the OpenAPI pass documents their 429."""

SettingsDep = Annotated[Settings, Depends(_from_state("settings"))]
RegistryDep = Annotated[ModelRegistry, Depends(_from_state("registry"))]
DatasetsDep = Annotated[DatasetStore, Depends(_from_state("datasets"))]
ComputeDep = Annotated[ComputeLimiter, Depends(_limiter)]
SideCacheDep = Annotated[SideCache, Depends(_from_state("side_cache"))]
MetricsDep = Annotated[Metrics, Depends(_from_state("metrics"))]
JobsDep = Annotated[JobManager, Depends(_from_state("jobs"))]
"""The job manager (jobs of every kind): 503 while the lifespan starts it or stops it."""
ReadAccess = Annotated[Principal, Depends(_read)]
"""The caller, holding a ``read`` (or ``write``) key: 401 without a valid key."""
WriteAccess = Annotated[Principal, Depends(_write)]
"""The caller, holding a ``write`` key: 401 without a valid key, 403 with a ``read`` key."""
