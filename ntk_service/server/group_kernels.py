"""Per-layer kernels over HTTP: ``groups`` on ``POST /v1/models/{name}/ntk`` (``compute_ntk_groups``).

A request with ``groups`` ("modules", or ``{"name": ["glob", ...]}``; in the query of a binary body, "modules" or
that object as JSON text) answers one kernel per group:

- JSON: ``{"groups": [{"name", "parameters", "theta"}, ...], "mode", "implementation", "model", "version",
  "elapsed_ms"}``, the groups in the order of the request;
- ``Accept: application/x-safetensors``: one tensor per group, named by the group, with the metadata as strings
  (``groups``: the names in order, as a JSON list; ``parameters``: a JSON object of the names in each group).

A grouped answer is several tensors, so ``application/x-npy`` is not offered (406 naming the two that are). The
answer's schemas (``GroupKernelPublic``, ``KernelGroupsPublic``) are in ``schemas.py`` with the other kernel
schemas (importable from here as before).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from ntk_service import wire
from ntk_service.errors import InvalidInput, format_bytes
from ntk_service.kernels import NtkGroupsResult
from ntk_service.server.media import json_too_large
from ntk_service.server.schemas import GroupKernelPublic, KernelGroupsPublic, KernelOptions

__all__ = [
    "GROUP_RESPONSE_TYPES",
    "MAX_GROUPS_QUERY_LENGTH",
    "GroupKernelPublic",
    "KernelGroupsPublic",
    "check_group_options",
    "encode_groups",
    "parse_groups_query",
]

GROUP_RESPONSE_TYPES = (wire.MEDIA_JSON, wire.MEDIA_SAFETENSORS)
"""What a grouped kernel answer can be, JSON first."""

MAX_GROUPS_QUERY_LENGTH = 16384
"""Longest ``groups`` query value (a JSON object of groups and globs); longer groupings go in a JSON body."""

_RESERVED_NAMES = frozenset({"__metadata__"})
"""Names a safetensors body cannot give a tensor (its header's metadata entry)."""


def parse_groups_query(value: str | None) -> Any:
    """The ``groups`` query value of a binary-body request: "modules", or a JSON object text (None when absent)."""
    if value is None or value == "modules":
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidInput(
            detail=f'groups={value!r} in the query must be "modules" or a JSON object '
            '{"name": ["glob", ...]}, e.g. groups={"head":["head.*"]} (URL-encoded)'
        )
    return parsed


def check_group_options(options: KernelOptions) -> None:
    """Refuse what a grouped request cannot mean before any work: params beside groups, rest without groups, a
    group name a safetensors answer cannot carry."""
    if options.groups is not None and options.params is not None:
        raise InvalidInput(detail="params and groups both select parameters; put the globs in groups")
    if options.rest and options.groups is None:
        raise InvalidInput(detail="rest=true needs groups")
    if isinstance(options.groups, dict):
        bad = sorted(_RESERVED_NAMES & set(options.groups))
        if bad:
            raise InvalidInput(detail=f"group name {bad[0]!r} is reserved by the safetensors format; rename it")


def encode_groups(
    result: NtkGroupsResult, media: str, meta: dict[str, Any], *, cap: int, operation: str | None = None
) -> Response:
    """The group kernels as ``media``: safetensors (a tensor per group) or JSON (406 over ``cap`` bytes)."""
    arrays = {name: theta.detach().cpu().numpy() for name, theta in result.thetas.items()}
    parameters = {name: list(names) for name, names in result.parameters.items()}
    if media == wire.MEDIA_SAFETENSORS:
        metadata = {key: str(value) for key, value in meta.items()}
        metadata["groups"] = json.dumps(list(arrays))
        metadata["parameters"] = json.dumps(parameters)
        return Response(wire.encode_safetensors(arrays, metadata), media_type=media)
    entries = [
        {"name": name, "parameters": parameters[name], "theta": wire.tensor_to_json(theta)}
        for name, theta in arrays.items()
    ]
    body = wire.json_dumps({"groups": entries, **meta})
    if len(body) > cap:
        raise json_too_large(
            format_bytes(len(body)), cap, hint=" (group kernels: safetensors, not npy)", operation=operation
        )
    return Response(body, media_type=wire.MEDIA_JSON)
