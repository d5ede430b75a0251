"""The body of ``POST /v1/datasets``: one array, or several named arrays with one N.

- ``application/x-npy``: one array (as before).
- ``application/x-safetensors``: one tensor per name.
- ``application/x-npz``: ``np.savez`` / ``np.savez_compressed``, one member per name.
- ``application/json``: ``{name: nested list}``, or the wire's tensor object ``{"shape", "dtype", "data"}`` per name.

In the three named formats, an array named ``x`` alone is one plain array (as safetensors bodies always were).

NOTE [hostile uploads]
Everything here is data. An ``.npz`` is a zip read in memory: no member is ever extracted to disk or by its name
(the store names files by the array's position), every member name must be ``<identifier>.npy`` (no ``/``, ``..``,
or anything a path could be made of), the members' declared uncompressed sizes together stay within the body limit
before one byte is inflated (``zipfile`` never inflates past a member's declared size), and each member is read
with ``allow_pickle=False`` (an object array is refused, never unpickled). A safetensors header is checked by
``wire.decode_safetensors`` (sizes against the body, offsets against each other). JSON nested lists must be
rectangular numbers (booleans count as 0/1): strings, nulls, ragged rows and integers beyond int64 are refused,
never turned into object arrays. Names are checked once more by ``DatasetStore.create`` (ASCII identifiers),
the one authority.
"""

from __future__ import annotations

import io
import re
import zipfile
import zlib
from typing import Any

import numpy as np
from starlette.requests import Request

from ntk_service import wire
from ntk_service.errors import InvalidInput, MalformedRequest, PayloadTooLarge
from ntk_service.server.media import parse_off_loop, require_content_type

__all__ = ["DATASET_MEDIA_TYPES", "DATASET_TENSOR", "decode_json_arrays", "decode_npz", "read_dataset"]

DATASET_MEDIA_TYPES = (wire.MEDIA_NPY, wire.MEDIA_SAFETENSORS, wire.MEDIA_NPZ, wire.MEDIA_JSON)
"""What ``POST /v1/datasets`` accepts."""

DATASET_TENSOR = "x"
"""Name of the tensor in a single-array safetensors upload (an .npy upload is one array)."""

_MEMBER = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.npy$")


async def read_dataset(request: Request, *, operation: str, max_bytes: int) -> np.ndarray | dict[str, np.ndarray]:
    """The data set in a request body (see the table above).

    Args:
        request: the request. operation: for messages. max_bytes: the body limit; an .npz may not inflate past it.

    Returns:
        One (N, *example) array, or a dict name -> (N, *example_i) array in the body's order.

    Raises:
        UnsupportedMediaType: another Content-Type (415).
        MalformedRequest: a body that cannot be decoded (400).
        InvalidInput: a bad member name, an object array, a non-numeric or ragged JSON array (422).
        PayloadTooLarge: an .npz whose members inflate past ``max_bytes`` (413).
    """
    media = require_content_type(request, DATASET_MEDIA_TYPES, operation=operation)
    body = await request.body()
    what = f"{operation}: body"

    def decode() -> np.ndarray | dict[str, np.ndarray]:
        if media == wire.MEDIA_NPY:
            return wire.decode_npy(body, name=what)
        if media == wire.MEDIA_SAFETENSORS:
            arrays = wire.decode_safetensors(body, name=what)[0]
        elif media == wire.MEDIA_NPZ:
            arrays = decode_npz(body, name=what, max_bytes=max_bytes)
        else:
            arrays = decode_json_arrays(wire.json_loads(body, name=what), name=what)
        # one array named DATASET_TENSOR is a plain data set in every format (as safetensors bodies always were)
        return arrays[DATASET_TENSOR] if set(arrays) == {DATASET_TENSOR} else arrays

    return await parse_off_loop(decode, size=len(body))


def decode_npz(body: bytes, *, name: str, max_bytes: int) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` body, read in memory (NOTE [hostile uploads]).

    Args:
        body: the archive's bytes. name: what it is called in messages. max_bytes: the most its members may
            inflate to, together.

    Returns:
        member name without ``.npy`` -> array, in archive order.

    Raises:
        MalformedRequest: not a zip, or a corrupt member. InvalidInput: a member name that is not
        ``<identifier>.npy``, a repeated name, an object array. PayloadTooLarge: members over ``max_bytes``.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
    except (zipfile.BadZipFile, ValueError) as exc:
        raise MalformedRequest(
            f"{name}: expected an .npz archive (a zip of .npy members), could not read it: {exc}"
        ) from exc
    with archive:
        infos = archive.infolist()
        names: list[str] = []
        for info in infos:
            match = _MEMBER.fullmatch(info.filename)
            if match is None:
                raise InvalidInput(
                    f"{name}: .npz member {info.filename!r} is not allowed; every member must be <name>.npy with "
                    "<name> an identifier (write it with np.savez(file, input_ids=..., attention_mask=...))"
                )
            if match.group(1) in names:
                raise InvalidInput(f"{name}: .npz member {info.filename!r} appears twice; name each array once")
            names.append(match.group(1))
        total = sum(info.file_size for info in infos)
        if total > max_bytes:
            raise PayloadTooLarge(
                f"{name}: the .npz members inflate to {total} bytes, over the server's limit of {max_bytes} "
                "(NTK_MAX_BODY_BYTES); upload fewer rows per data set"
            )
        out: dict[str, np.ndarray] = {}
        for key, info in zip(names, infos, strict=True):
            try:
                with archive.open(info) as member:
                    array = np.lib.format.read_array(member, allow_pickle=False)
            except ValueError as exc:
                if "allow_pickle" in str(exc):
                    raise InvalidInput(
                        f"{name}: .npz member {key!r} is an object array, which is never loaded; upload numeric "
                        "arrays (float32, float64 or int64)"
                    ) from exc
                raise MalformedRequest(f"{name}: .npz member {key!r} is not a valid .npy array: {exc}") from exc
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error, RuntimeError, NotImplementedError) as exc:
                # corrupt data or CRC, an encrypted member (RuntimeError), an unknown compression method
                raise MalformedRequest(f"{name}: .npz member {key!r} could not be read: {exc}") from exc
            out[key] = wire.to_wire_dtype(array, name=f"{name}[{key!r}]")
    return out


def decode_json_arrays(obj: Any, *, name: str) -> dict[str, np.ndarray]:
    """Named arrays from a JSON object ``{name: nested list}`` (integers or booleans only: int64; any float: float64) or
    ``{name: {"shape", "dtype", "data"}}`` (the wire's tensor object, dtype chosen by the client).

    Raises:
        MalformedRequest: not an object. InvalidInput: an empty object, a value that is not a rectangular array of
        numbers (named).
    """
    example = '{"input_ids": [[101, 7592, 102]], "attention_mask": [[1, 1, 1]]}'
    if not isinstance(obj, dict):
        raise MalformedRequest(f"{name}: expected a JSON object of named arrays like {example}")
    if not obj:
        raise InvalidInput(f"{name}: the object has no arrays; send at least one, like {example}")
    out: dict[str, np.ndarray] = {}
    for key, value in obj.items():
        where = f"{name}[{key!r}]"
        if isinstance(value, dict):
            out[key] = wire.tensor_from_json(value, name=where)
            continue
        if not isinstance(value, list):
            raise InvalidInput(f"{where}: expected a nested list of numbers (N, ...), got {type(value).__name__}")
        out[key] = _nested_list(value, where)
    return out


def _nested_list(value: list[Any], where: str) -> np.ndarray:
    try:
        array = np.array(value)
    except (ValueError, OverflowError) as exc:  # ragged rows
        raise InvalidInput(
            f"{where}: expected a rectangular nested list of numbers, every row as long ({exc})"
        ) from exc
    if array.dtype.kind in "ib":  # booleans (masks) as 0/1, as the wire converts them
        return array.astype(np.int64)
    if array.dtype.kind == "f":
        return array.astype(np.float64)
    kinds = {"U": "strings", "O": "nulls, mixed values or integers beyond int64"}
    got = kinds.get(array.dtype.kind, str(array.dtype))
    raise InvalidInput(f"{where}: expected numbers (integers for ids, floats otherwise), got {got}")
