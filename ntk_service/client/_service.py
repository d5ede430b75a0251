"""``Client.info()``: which server computes, on what, within which limits (for provenance records)."""

from __future__ import annotations

from typing import Literal, TypedDict, cast

from ntk_service.client._base import BaseClient

__all__ = ["ServerInfo", "ServerLimits", "ServiceClient"]


class ServerLimits(TypedDict):
    """The limits a request meets (bytes; None: the server decides per request)."""

    max_body_bytes: int
    max_json_response_bytes: int
    memory_budget_bytes: int | None
    compute_concurrency: int
    max_queue: int
    job_tile_size: int
    job_disk_budget_bytes: int | None


class ServerInfo(TypedDict):
    """``GET /v1/info``: versions, executor, device and limits."""

    version: str
    torch: str
    numpy: str
    python: str
    executor: Literal["local", "ray"]
    device: str
    limits: ServerLimits


class ServiceClient(BaseClient):
    """The service-level methods (mixed into ``Client``)."""

    def info(self) -> ServerInfo:
        """``GET /v1/info`` (read scope): server and torch versions, executor, device and limits.

        Returns:
            e.g. ``{"version": "0.1.0", "torch": "2.13.0+cpu", "executor": "local", "device": "cpu", ...}``.
        """
        return cast(ServerInfo, self._get_json("/v1/info"))
