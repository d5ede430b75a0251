"""Reading a computing request: the body parsed once into the sides and, for a kernel, the two engine values.

Everything here runs before the model record is read: it needs only the request (and the server's settings for
the *how*). A side is a ``SideSource``: an inline array (N, *input), inline named arrays, or a ``DatasetRef``
to rows of a stored data set; loading and checking it against the model is ``computing.py``'s.

A kernel request (``POST /v1/models/{name}/ntk``) is read into a :class:`KernelCall`: its sides, the version asked
for, and the two values the engine takes, ``KernelSpec`` (what: mode, params, output, groups, rest) and
``NtkOptions`` (how: the request's implementation and dtype, the server's budget, device and TF32 policy). Each
option is validated once: by pydantic for a JSON body, by FastAPI for the query of a binary body (``groups``,
JSON text in the query, by pydantic here); the values are then built from what was validated and never re-parsed.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fastapi import Request
from pydantic import ValidationError

from ntk_service import wire
from ntk_service.config import Settings
from ntk_service.errors import InvalidInput, MalformedRequest, operation_part
from ntk_service.kernels import NtkOptions
from ntk_service.kernels.options import DTYPES
from ntk_service.kernels.spec import KernelSpec, SpecKeywords, resolve_spec
from ntk_service.kernels.types import NtkImplementation
from ntk_service.registry.input_contract import NamedArrays
from ntk_service.server.error_responses import format_validation_errors
from ntk_service.server.group_kernels import check_group_options, parse_groups_query
from ntk_service.server.media import (
    BINARY_TENSOR_TYPES,
    content_type,
    parse_off_loop,
    read_json,
    read_tensors,
    wire_detail,
)
from ntk_service.server.schemas import DatasetRef, KernelOptions, validate_body

__all__ = [
    "INPUT_NAME",
    "KernelCall",
    "SideSource",
    "engine_options",
    "parse_side",
    "parse_sides",
    "read_kernel_request",
    "read_object",
    "split_sides",
]

SideSource = np.ndarray | NamedArrays | DatasetRef
"""Where one side of a request comes from: an inline array (N, *input), inline named arrays, or rows of a stored
data set. (The engine's ``kernels.algorithm.Side`` is another thing: what an implementation keeps from a block of
examples.)"""

INPUT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
"""A named input: a Python identifier (forward's keyword argument), at most 64 characters."""


async def read_object(request: Request, *, expected: str = "") -> dict[str, Any]:
    """The JSON body, which must be an object.

    Args:
        expected: what the object should hold, for the message (e.g. ``" with x1 (and x2, ...)"``).

    Raises:
        UnsupportedMediaType: not application/json (415).
        MalformedRequest: invalid JSON, or not an object (400).
    """
    data = await read_json(request)
    if not isinstance(data, dict):
        raise MalformedRequest(detail=f"expected a JSON object{expected}, got {type(data).__name__}")
    return data


def _named_side(raw: dict[str, Any], *, side: str) -> NamedArrays:
    """``{"name": tensor, ...}``: one wire tensor per forward argument name."""
    if not raw:
        raise InvalidInput(detail=f"{side}: an empty object; send a tensor or an object of named tensors")
    arrays = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not INPUT_NAME.match(name):
            raise InvalidInput(
                detail=f"{side}: input name {str(name)[:80]!r} is not an identifier (letters, digits, _; at most "
                "64); name each tensor after its forward argument"
            )
        arrays[name] = wire_detail(functools.partial(wire.tensor_from_json, value, name=f"{side}[{name!r}]"))
    return arrays


def parse_side(raw: Any, *, side: str) -> SideSource:
    """A JSON side: ``{"dataset": id, "start", "stop"}`` is a :class:`DatasetRef`, an object with ``data`` (or with
    ``shape`` and ``dtype``: one missing its data) a wire tensor, any other object named tensors
    (``{"input_ids": tensor, "attention_mask": tensor}``)."""
    if isinstance(raw, dict) and "dataset" in raw:
        with operation_part(side):
            return validate_body(DatasetRef, raw)
    if isinstance(raw, dict) and "data" not in raw and not {"shape", "dtype"} <= set(raw):
        return _named_side(raw, side=side)
    return wire.tensor_from_json(raw, name=side)


async def parse_sides(
    request: Request, x1: Any, x2: Any, *, extra: dict[str, Any] | None = None
) -> tuple[SideSource, SideSource | None, dict[str, np.ndarray]]:
    """x1, x2 (None: absent) and the ``extra`` JSON tensors of a JSON body, parsed off the loop when it is large."""
    fields = extra or {}

    def parse() -> tuple[SideSource, SideSource | None, dict[str, np.ndarray]]:
        first = parse_side(x1, side="x1")
        second = None if x2 is None else parse_side(x2, side="x2")
        return first, second, {key: wire.tensor_from_json(value, name=key) for key, value in fields.items()}

    return await parse_off_loop(parse, size=len(await request.body()))  # the body is cached by now


def split_sides(tensors: dict[str, np.ndarray], sides: tuple[str, ...]) -> tuple[SideSource | None, ...]:
    """The sides of a safetensors body: a tensor named after the side (``x1``), or named inputs ``x1.<name>``
    (``x1.input_ids``, ``x1.attention_mask``); the first side is required, the others optional (None).

    Raises:
        InvalidInput: the first side missing, a side both whole and named, a name that is not an identifier, or
            tensors of no side (each named in the message).
    """
    found: dict[str, Any] = {}
    for key in sorted(tensors):
        side, dot, name = key.partition(".")
        if side not in sides or (dot and not INPUT_NAME.match(name)):
            raise InvalidInput(
                detail=f"the body has the tensor {key[:80]!r}; expected {' and '.join(sides)} (one tensor "
                f"each) or named inputs like '{sides[0]}.input_ids' (identifiers after the dot)"
            )
        if dot:
            if isinstance(found.get(side), np.ndarray):
                raise InvalidInput(detail=f"the body has both {side!r} and {key!r}; send one or the other")
            found.setdefault(side, {})[name] = tensors[key]
        elif side in found:
            raise InvalidInput(detail=f"the body has both {side!r} and named {side}.* tensors")
        else:
            found[side] = tensors[key]
    if sides[0] not in found:
        raise InvalidInput(
            detail=f"the safetensors body has no tensor {sides[0]!r} nor '{sides[0]}.<name>' tensors (it has "
            f"{sorted(tensors)[:8] or 'none'}); name the tensor {sides[0]!r}"
        )
    return tuple(found.get(side) for side in sides)


def engine_options(
    settings: Settings, *, implementation: NtkImplementation = NtkImplementation.AUTO, dtype: str | None = None
) -> NtkOptions:
    """How the server computes a request's kernel: the request's implementation and dtype, the server's memory
    budget (None: the device's default), device and TF32 policy.

    Raises:
        UnknownDevice: the settings name a device this machine lacks (the app checks it at startup).
    """
    return NtkOptions(
        implementation=implementation,
        dtype=None if dtype is None else DTYPES[dtype],
        memory_budget_bytes=settings.memory_budget_bytes,
        device=torch.device(settings.device),  # checked to exist by NtkOptions (and at startup)
        allow_tf32=settings.allow_tf32,
    )


@dataclass(frozen=True)
class KernelCall:
    """A kernel request (``POST /v1/models/{name}/ntk``), read once by :func:`read_kernel_request`.

    Attributes:
        x1, x2: where the sides come from (x2 None: x2 = x1), not loaded yet.
        version: the model version asked for (None: the latest).
        spec: what to compute (``KernelSpec``).
        options: how (``NtkOptions``).
    """

    x1: SideSource
    x2: SideSource | None
    version: int | None
    spec: KernelSpec
    options: NtkOptions


def _query_options(query: dict[str, Any]) -> KernelOptions:
    """The options of a binary body from its query parameters, which FastAPI has validated already (``mode`` is
    an enum by then); only ``groups``, "modules" or JSON text in the query, is parsed and validated here."""
    fields = dict(query)
    if "groups" in fields:
        try:
            groups = parse_groups_query(fields["groups"])
            checked = KernelOptions.model_validate({"groups": groups})
        except ValidationError as exc:
            raise InvalidInput(detail=format_validation_errors(exc.errors())) from exc
        fields["groups"] = checked.groups
    return KernelOptions.model_construct(**fields)


async def read_kernel_request(request: Request, query: dict[str, Any], settings: Settings) -> KernelCall:
    """The sides, the version and the two engine values of a kernel request, each option validated once: from a
    JSON body, or from a binary body (.npy: x1; safetensors: x1 and optional x2) plus the options in ``query``.

    Args:
        query (dict): the options given as query parameters, validated by FastAPI (name -> value; only those
            given; ``groups`` as its text).
        settings (Settings): the server's, for the how (``engine_options``).

    Raises:
        UnsupportedMediaType, MalformedRequest: not JSON / a tensor body, or a body that does not parse.
        InvalidInput: options in the query beside a JSON body, a JSON body without x1, unexpected tensors in a
            binary body, an option of the wrong value (e.g. ``"mode: Input should be 'full', ..."``), params beside
            groups, an output path outside the grammar.
    """
    if content_type(request) in BINARY_TENSOR_TYPES:
        tensors = await read_tensors(request, npy_name="x1")
        first, x2 = split_sides(tensors, ("x1", "x2"))
        assert first is not None  # split_sides requires the first side
        x1: SideSource = first
        wire_options = _query_options(query)
    else:
        data = await read_object(request, expected=" with x1 (and x2, mode, ...)")
        if query:
            raise InvalidInput(
                detail="with a JSON body, put mode/implementation/params/dtype/version in the body, "
                "not in the query string (query options are for binary bodies)"
            )
        if "x1" not in data:
            raise InvalidInput(detail='the body needs x1 (a tensor or {"dataset": id, "start", "stop"})')
        x1_raw, x2_raw = data.pop("x1"), data.pop("x2", None)
        wire_options = validate_body(KernelOptions, data)
        x1, x2, _ = await parse_sides(request, x1_raw, x2_raw)
    check_group_options(wire_options)
    o = wire_options
    loose = SpecKeywords(mode=o.mode, params=o.params, output=o.output, groups=o.groups, rest=o.rest)
    spec = resolve_spec(None, loose)
    options = engine_options(settings, implementation=o.implementation, dtype=o.dtype)
    return KernelCall(x1, x2, o.version, spec, options)
