"""Tensors of a torch.export archive read from their raw payloads only: never an entry marked ``use_pickle``.

    >>> state_dict, params = read_tensors(entries, "weights")   # fqn -> tensor, names of parameters
    >>> constants, _ = read_tensors(entries, "constants")

Each payload's declared dtype (plain numeric types), layout (strided), device (cpu), sizes, strides and storage
offset are checked against its byte count before ``torch.frombuffer`` + ``as_strided`` make a tensor of it; views
of one payload share its storage, as torch's loader keeps them (tied weights). NOTE [archive threat model] in
exported.py says why.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from ntk_service.errors import InvalidInput
from ntk_service.registry.archive import ArchiveEntries

__all__ = ["MAX_JSON_BYTES", "read_json", "read_tensors"]

MAX_JSON_BYTES = 64 << 20
"""Largest graph JSON (models/model.json): a ResNet-50's is about 1 MB; this bounds json and the deserializer."""

_MODEL = "model"
_DTYPES: dict[int, torch.dtype] = {
    7: torch.float32,
    8: torch.float64,
    6: torch.float16,
    13: torch.bfloat16,
    5: torch.int64,
    4: torch.int32,
    12: torch.bool,
    1: torch.uint8,
}
"""Serialized ScalarType codes (torch/_export/serde/schema.py) a payload may hold."""
_STRIDED = 7
_PAYLOAD_NAME = {"weights": re.compile(r"^weight_\d{1,9}$"), "constants": re.compile(r"^tensor_\d{1,9}$")}


def read_json(entries: ArchiveEntries, name: str, limit: int) -> Any:
    if name not in entries.infos:
        raise InvalidInput(
            detail=f"the archive has no {entries.root}/{name}; send the file torch.export.save wrote for one "
            "ExportedProgram"
        )
    if entries.size(name) > limit:
        raise InvalidInput(detail=f"{name} has {entries.size(name):,} bytes, more than the limit of {limit:,}")
    try:
        return json.loads(entries.read(name).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidInput(detail=f"{name} is not valid JSON ({exc})") from exc


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, Mapping) and set(value) == {"as_int"} and type(value["as_int"]) is int:
        return int(value["as_int"])
    raise InvalidInput(detail=f"{what} is {value!r}; stored tensors need integer sizes, strides and offsets")


def _payload_tensor(meta: Any, payload: bytes, where: str, cache: dict[str, torch.Tensor], path: str) -> torch.Tensor:
    """One stored tensor from its raw bytes, after checking its declared layout against them."""
    if not isinstance(meta, Mapping):
        raise InvalidInput(detail=f"{where} has no tensor_meta; only raw tensor payloads are read")
    dtype = _DTYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise InvalidInput(
            detail=f"{where} has dtype code {meta.get('dtype')!r}; stored tensors may be "
            + ", ".join(str(d).removeprefix("torch.") for d in _DTYPES.values())
        )
    if meta.get("layout") != _STRIDED:
        raise InvalidInput(detail=f"{where} has layout {meta.get('layout')!r}; only strided tensors are read")
    device = meta.get("device")
    if not isinstance(device, Mapping) or device.get("type") != "cpu":
        raise InvalidInput(detail=f"{where} is on device {device!r}; export the module on the CPU")
    sizes = [_as_int(s, f"{where}: a size") for s in meta.get("sizes") or []]
    strides = [_as_int(s, f"{where}: a stride") for s in meta.get("strides") or []]
    offset = _as_int(meta.get("storage_offset"), f"{where}: the storage offset")
    if len(sizes) != len(strides) or any(n < 0 for n in sizes) or any(s < 0 for s in strides) or offset < 0:
        raise InvalidInput(
            detail=f"{where} declares sizes {sizes}, strides {strides}, offset {offset}; they must be "
            "non-negative with one stride per size"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(payload) % itemsize:
        raise InvalidInput(
            detail=f"{where}: its payload has {len(payload)} bytes, not a multiple of the {itemsize}-byte "
            f"{str(dtype).removeprefix('torch.')}"
        )
    numel = len(payload) // itemsize
    needed = 0 if 0 in sizes else offset + 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    if needed > numel:
        raise InvalidInput(
            detail=f"{where} declares sizes {sizes}, strides {strides} and offset {offset}, which need "
            f"{needed * itemsize:,} bytes, but its payload has {len(payload):,}; the sizes do not match the bytes"
        )
    flat = cache.get(path)
    if flat is None:
        flat = torch.frombuffer(bytearray(payload), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
        cache[path] = flat
    if flat.dtype != dtype:
        raise InvalidInput(detail=f"{where} reads payload {path} as another dtype than a tensor before it")
    return torch.as_strided(flat, sizes, strides, offset) if math.prod(sizes) else flat.new_empty(sizes)


def read_tensors(entries: ArchiveEntries, kind: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors of ``data/<kind>/model_<kind>_config.json``; returns them and the names of parameters."""
    config_name = f"data/{kind}/{_MODEL}_{kind}_config.json"
    config = read_json(entries, config_name, MAX_JSON_BYTES)
    items = config.get("config") if isinstance(config, Mapping) else None
    if not isinstance(items, Mapping):
        raise InvalidInput(detail=f"{config_name} has no 'config' object")
    tensors: dict[str, torch.Tensor] = {}
    params: set[str] = set()
    cache: dict[str, torch.Tensor] = {}
    for fqn, payload_meta in items.items():
        where = f"{kind[:-1]} {fqn!r}"
        if not isinstance(payload_meta, Mapping):
            raise InvalidInput(detail=f"{where} has no payload description")
        path = payload_meta.get("path_name")
        if payload_meta.get("use_pickle") is not False:
            raise InvalidInput(
                detail=f"{where} is marked use_pickle (a pickled tensor subclass or object); the service "
                "never unpickles uploads. Export plain tensors (no tensor subclasses, no custom objects)"
            )
        if not isinstance(path, str) or not _PAYLOAD_NAME[kind].match(path):
            hint = "custom and opaque objects are refused" if kind == "constants" else "weights are weight_<i>"
            raise InvalidInput(
                detail=f"{where} points at payload {path!r}; only raw tensors are read ({hint}). Export a "
                "module whose state is plain tensors"
            )
        payload = entries.read(f"data/{kind}/{path}")
        tensor = _payload_tensor(payload_meta.get("tensor_meta"), payload, where, cache, path)
        tensors[str(fqn)] = tensor
        if payload_meta.get("is_param") is True:
            params.add(str(fqn))
    return tensors, params
