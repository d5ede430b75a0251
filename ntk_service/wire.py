"""Tensor codecs for the wire: JSON objects, ``.npy`` bodies and safetensors bodies (numpy only).

Three encodings of a tensor travel over HTTP (docs/http-api.md, "Conventions"):

* JSON ``{"shape": [2, 3], "dtype": "float32", "data": [flat, row-major]}`` for small payloads;
* ``application/x-npy``: one array, as written by ``numpy.save`` (never pickled);
* ``application/x-safetensors``: named tensors plus string metadata.

Every tensor that leaves a decoder or enters an encoder has one of ``WIRE_DTYPES`` and native byte order, so
both sides of the wire agree on what a tensor is. Integer and boolean arrays become ``int64`` and ``float16``
becomes ``float32`` (both lossless); anything else (complex, strings, objects, structured records) is refused.

Big tensors never go through pydantic: validating a (256, 256, 10, 10) kernel as ``list[float]`` costs ~1 s on
top of the 0.9 s of orjson (measured when the wire format was chosen), so routes parse bodies with these functions
and serialize with ``json_dumps``.

Decoders raise ``MalformedRequest`` (400) when the body cannot be parsed at all and ``InvalidInput`` (422)
when it parses but its values are wrong; messages name the field, what was expected and what came.

Example::

    >>> x = np.zeros((2, 3), dtype=np.float32)
    >>> tensor_from_json(tensor_to_json(x), name="x1").shape
    (2, 3)
    >>> decode_npy(encode_npy(x)).dtype
    dtype('float32')
"""

from __future__ import annotations

import io
import json
import math
import struct
from typing import Any

import numpy as np
import orjson

from ntk_service.errors import InvalidInput, MalformedRequest

__all__ = [
    "MEDIA_JSON",
    "MEDIA_NPY",
    "MEDIA_NPZ",
    "MEDIA_SAFETENSORS",
    "WIRE_DTYPES",
    "decode_npy",
    "decode_safetensors",
    "encode_npy",
    "encode_safetensors",
    "json_dumps",
    "json_loads",
    "tensor_from_json",
    "tensor_to_json",
    "to_wire_dtype",
]

MEDIA_JSON = "application/json"
MEDIA_NPY = "application/x-npy"
MEDIA_SAFETENSORS = "application/x-safetensors"
MEDIA_NPZ = "application/x-npz"
"""A numpy ``.npz`` archive (``np.savez`` or ``np.savez_compressed``) of named arrays: data-set uploads only."""

WIRE_DTYPES = ("float32", "float64", "int64")
"""The dtypes a tensor may have on the wire: float inputs and kernels, and int64 token ids."""

_NPY_MAX_HEADER_BYTES = 10_000
"""numpy's own default cap on an .npy header; a longer header is a malformed or hostile body."""

_SAFETENSORS_MAX_HEADER_BYTES = 100 * 2**20
"""The safetensors format's own cap on the JSON header (100 MiB)."""

_SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8,
}  # fmt: skip
"""Bytes per element of each safetensors dtype, to check a header's shapes before the loader allocates."""

_SAFETENSORS_DTYPE = {"float32": "F32", "float64": "F64", "int64": "I64"}
"""The safetensors name of each wire dtype (``WIRE_DTYPES``)."""

_MAX_DIMS = 64
"""The most dimensions a wire tensor may have: numpy's own limit (``np.zeros([0] * 65)`` raises)."""

_MAX_ARRAY_BYTES = np.iinfo(np.intp).max
"""numpy's bound on the product of an array's non-zero dimensions times the item size, even when a zero dimension
makes the array empty: ``np.zeros((0, 2**62, 4))`` raises "array is too big"."""


def to_wire_dtype(array: np.ndarray, *, name: str = "tensor") -> np.ndarray:
    """Return ``array`` as a C-contiguous, native-byte-order array with a dtype in ``WIRE_DTYPES``.

    Args:
        array (np.ndarray): any numeric array.
        name (str): what the array is called in error messages. Default: ``"tensor"``.

    Returns:
        The same values, shape unchanged: float32/float64/int64 kept; bool and (u)int* as int64; float16 as
        float32. No copy when the array already qualifies.

    Raises:
        InvalidInput: complex, string, object or structured dtypes, or uint64 values beyond the int64 range.
    """
    dtype = array.dtype
    target: np.dtype[Any]
    if dtype.fields is not None or dtype.hasobject or dtype.kind not in "biuf":
        raise InvalidInput(
            f"{name}: dtype {dtype} cannot travel on the wire; expected one of {', '.join(WIRE_DTYPES)} "
            "(or an integer, bool or float16 array, converted losslessly); convert it with .astype('float32')"
        )
    if dtype.kind == "f":
        target = np.dtype(np.float64) if dtype.itemsize >= 8 else np.dtype(np.float32)
        if dtype.itemsize > 8:
            raise InvalidInput(
                f"{name}: dtype {dtype} (extended precision) cannot travel on the wire; expected float32 or "
                "float64; convert it with .astype('float64')"
            )
    else:
        target = np.dtype(np.int64)
        if dtype.kind == "u" and dtype.itemsize == 8 and array.size and int(array.max()) > np.iinfo(np.int64).max:
            raise InvalidInput(f"{name}: uint64 values above {np.iinfo(np.int64).max} do not fit int64")
    return np.asarray(array, dtype=target.newbyteorder("="), order="C")


def tensor_to_json(array: np.ndarray) -> dict[str, Any]:
    """Encode an array as the wire's JSON tensor object.

    Args:
        array (np.ndarray): any numeric array (see ``to_wire_dtype`` for accepted dtypes).

    Returns:
        ``{"shape": [...], "dtype": "float32", "data": [...]}`` with ``data`` flat in row-major order, as a
        1-D numpy array: serialize it with ``json_dumps`` (orjson writes numpy arrays natively, ~10x faster
        than ``tolist``). Non-finite floats become ``null`` in JSON, which decoders refuse: use a binary
        format for them.

    Raises:
        InvalidInput: the dtype cannot travel on the wire.
    """
    wire = to_wire_dtype(np.asarray(array), name="tensor_to_json")
    return {"shape": list(wire.shape), "dtype": str(wire.dtype), "data": wire.reshape(-1)}


def tensor_from_json(obj: object, *, name: str) -> np.ndarray:
    """Decode the wire's JSON tensor object strictly.

    Args:
        obj (object): the parsed JSON value, expected
            ``{"shape": [int, ...], "dtype": str, "data": [number, ...]}``.
        name (str): the field it came from (e.g. ``"x1"``), used in error messages.

    Returns:
        A writable, C-contiguous array of that shape and dtype (one of ``WIRE_DTYPES``).

    Raises:
        MalformedRequest: not an object, or ``shape`` / ``dtype`` / ``data`` missing or of the wrong JSON
            type.
        InvalidInput: a dtype outside ``WIRE_DTYPES``, ``len(data) != prod(shape)``, non-numbers in ``data``,
            non-integers in an int64 tensor, values out of the dtype's range.
    """
    example = '{"shape": [2, 3], "dtype": "float32", "data": [1, 2, 3, 4, 5, 6]}'
    if not isinstance(obj, dict):
        raise MalformedRequest(
            f"{name}: expected a tensor object like {example}, got {_json_type(obj)}; "
            "for large tensors send an application/x-npy or application/x-safetensors body instead"
        )
    missing = [key for key in ("shape", "dtype", "data") if key not in obj]
    if missing:
        raise MalformedRequest(
            f"{name}: tensor object is missing {', '.join(repr(k) for k in missing)}; expected {example}"
        )
    shape, dtype, data = obj["shape"], obj["dtype"], obj["data"]
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise MalformedRequest(f"{name}.shape: expected a list of integers like [2, 3], got {_json_preview(shape)}")
    if not isinstance(dtype, str):
        raise MalformedRequest(
            f"{name}.dtype: expected a string, one of {list(WIRE_DTYPES)}, got {_json_preview(dtype)}"
        )
    if dtype not in WIRE_DTYPES:
        raise InvalidInput(f"{name}.dtype: expected one of {list(WIRE_DTYPES)}, got {dtype!r}")
    _check_shape(shape, dtype, np.dtype(dtype).itemsize, name=f"{name}.shape")
    if not isinstance(data, list):
        raise MalformedRequest(
            f"{name}.data: expected a flat list of numbers in row-major order, got {_json_type(data)}"
        )
    expected = math.prod(shape)
    if len(data) != expected:
        raise InvalidInput(
            f"{name}.data: shape {shape} needs {expected} values (the product of the shape), "
            f"got {len(data)}; "
            "data must be the flat, row-major list of all values"
        )
    return _numbers_to_array(data, dtype, shape, name=name)


def _check_shape(shape: tuple[int, ...] | list[int], dtype: str, itemsize: int, *, name: str) -> None:
    """Check that numpy can represent an array of this shape, before anything is allocated.

    Besides non-negative dimensions and at most ``_MAX_DIMS`` of them, numpy requires the product of the non-zero
    dimensions times the item size to fit a signed 64-bit integer, *even when a zero dimension leaves the array
    empty*: a body of no values may still declare such a shape, and numpy then raises a bare ``ValueError``.

    Args:
        shape (tuple[int, ...] | list[int]): the declared dimensions (Python ints).
        dtype (str): the declared dtype's name, for the message.
        itemsize (int): its bytes per element.
        name (str): the field, for the message (e.g. ``"y_train.shape"``).

    Raises:
        InvalidInput: a negative dimension, more than ``_MAX_DIMS`` dimensions, or a shape beyond numpy's size bound.
    """
    if len(shape) > _MAX_DIMS:
        raise InvalidInput(f"{name}: at most {_MAX_DIMS} dimensions, got {len(shape)}")
    if any(d < 0 for d in shape):
        raise InvalidInput(f"{name}: dimensions must be >= 0, got {_json_preview(list(shape))}")
    if math.prod(d for d in shape if d) * itemsize > _MAX_ARRAY_BYTES:
        raise InvalidInput(
            f"{name}: {_json_preview(list(shape))} of {dtype} is beyond the largest array numpy can describe: the "
            f"non-zero dimensions times {itemsize} bytes must stay below 2**63, even when a 0 dimension leaves the "
            "array empty; send the shape of the data you have"
        )


def _numbers_to_array(data: list[Any], dtype: str, shape: list[int], *, name: str) -> np.ndarray:
    if not data:
        return np.zeros(shape, dtype=dtype)
    try:
        raw = np.array(data)
    except (ValueError, TypeError, OverflowError):
        raw = np.array(data, dtype=object)
    if raw.ndim != 1 or raw.dtype.kind not in "iuf":
        index, bad = next(
            ((i, v) for i, v in enumerate(data) if isinstance(v, bool) or not isinstance(v, int | float)),
            (-1, None),
        )
        if index < 0 and dtype == "int64":
            # Only Python ints too large for 64 bits produce an object array of plain numbers.
            raise InvalidInput(f"{name}.data: integer values beyond the int64 range")
        if index < 0:
            raw = np.array([float(v) for v in data])
            return _cast_float(raw, dtype, shape, name=name)
        hint = " (NaN and infinities are not valid JSON; send them in a binary format)" if bad is None else ""
        raise InvalidInput(
            f"{name}.data[{index}]: expected a number, got {_json_preview(bad)}{hint}; "
            "data must be a flat list of numbers"
        )
    if dtype == "int64":
        if raw.dtype.kind == "f":
            index, value = next((i, v) for i, v in enumerate(data) if isinstance(v, float))
            raise InvalidInput(
                f"{name}.data[{index}]: dtype int64 needs integers, got {value!r}; "
                "send integers (no decimal point) or declare dtype float32"
            )
        if raw.dtype.kind == "u" and int(raw.max()) > np.iinfo(np.int64).max:
            raise InvalidInput(f"{name}.data: values above {np.iinfo(np.int64).max} do not fit int64")
        return raw.astype(np.int64).reshape(shape)
    return _cast_float(raw, dtype, shape, name=name)


def _cast_float(raw: np.ndarray, dtype: str, shape: list[int], *, name: str) -> np.ndarray:
    with np.errstate(over="raise"):
        try:
            out = raw.astype(dtype)
        except FloatingPointError:
            raise InvalidInput(f"{name}.data: values beyond the {dtype} range") from None
    return out.reshape(shape)


def encode_npy(array: np.ndarray) -> bytes:
    """Encode one array as an ``application/x-npy`` body (numpy's .npy format, never pickled).

    Args:
        array (np.ndarray): any numeric array (see ``to_wire_dtype``).

    Returns:
        The .npy bytes, C order, native-endian dtype from ``WIRE_DTYPES``.

    Raises:
        InvalidInput: the dtype cannot travel on the wire.
    """
    buffer = io.BytesIO()
    np.save(buffer, to_wire_dtype(np.asarray(array), name="encode_npy"), allow_pickle=False)
    return buffer.getvalue()


def decode_npy(body: bytes, *, name: str = "body") -> np.ndarray:
    """Decode an ``application/x-npy`` body without ever unpickling.

    The header is checked against the body length before anything is allocated, so a forged header cannot make
    the server allocate more than the body it received.

    Args:
        body (bytes): the .npy bytes (format version 1.0 or 2.0).
        name (str): what the body is called in error messages. Default: ``"body"``.

    Returns:
        A writable, C-contiguous, native-endian array with a dtype in ``WIRE_DTYPES`` (see ``to_wire_dtype``).

    Raises:
        MalformedRequest: not a .npy file, a broken header, or a data length that does not match the header.
        InvalidInput: object, structured, string or complex dtypes.
    """
    stream = io.BytesIO(body)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            header = np.lib.format.read_array_header_1_0(stream, max_header_size=_NPY_MAX_HEADER_BYTES)
        elif version == (2, 0):
            header = np.lib.format.read_array_header_2_0(stream, max_header_size=_NPY_MAX_HEADER_BYTES)
        else:
            raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]} (expected 1.0 or 2.0)")
    except (ValueError, EOFError, OSError, SyntaxError, TypeError) as exc:
        raise MalformedRequest(
            f"{name}: expected an application/x-npy body written by numpy.save, could not read it: {exc}"
        ) from exc
    shape, fortran_order, dtype = header
    if dtype.hasobject or dtype.fields is not None:
        raise InvalidInput(
            f"{name}: .npy arrays of object or structured dtype ({dtype}) are refused; "
            f"send a plain numeric array of {', '.join(WIRE_DTYPES)}"
        )
    _check_shape(shape, str(dtype), dtype.itemsize, name=f"{name}: .npy header shape")
    offset = stream.tell()
    count = math.prod(shape)
    if len(body) - offset != count * dtype.itemsize:
        raise MalformedRequest(
            f"{name}: .npy header declares shape {shape} of {dtype} ({count * dtype.itemsize} bytes), "
            f"but the body holds {len(body) - offset}; the file is truncated or corrupt"
        )
    flat = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    array = flat.reshape(shape, order="F" if fortran_order else "C")
    wire = to_wire_dtype(array, name=name)
    # frombuffer views the immutable request bytes; hand out a writable array (torch.from_numpy warns).
    return wire if wire.flags.writeable else wire.copy()


def encode_safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """Encode named tensors and string metadata as an ``application/x-safetensors`` body.

    Args:
        tensors (dict[str, np.ndarray]): name -> numeric array (see ``to_wire_dtype``).
        metadata (dict[str, str] | None): string key/value pairs stored in the header. Default: none.

    Returns:
        The safetensors bytes.

    Raises:
        InvalidInput: a tensor's dtype cannot travel on the wire.
        TypeError: a tensor name or a metadata key/value is not a string.
    """
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"encode_safetensors: metadata must map str to str, got {key!r}: {value!r}")
    header: dict[str, Any] = {} if not metadata else {"__metadata__": metadata}
    blocks: list[Any] = []
    offset = 0
    for key, array in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"encode_safetensors: tensor names must be strings, got {key!r}")
        if key == "__metadata__":
            raise TypeError("encode_safetensors: '__metadata__' is the header's own key, not a tensor name")
        wire = to_wire_dtype(np.asarray(array), name=key)
        header[key] = {"dtype": _SAFETENSORS_DTYPE[wire.dtype.name], "shape": list(wire.shape),
                       "data_offsets": [offset, offset + wire.nbytes]}  # fmt: skip
        little = np.ascontiguousarray(wire, dtype=wire.dtype.newbyteorder("<"))  # safetensors is little-endian
        blocks.append(little.reshape(-1).view(np.uint8))  # a view: the join below is the only copy
        offset += wire.nbytes
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    return b"".join([struct.pack("<Q", len(text)), text, *blocks])


def decode_safetensors(body: bytes, *, name: str = "body") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Decode an ``application/x-safetensors`` body.

    Args:
        body (bytes): the safetensors bytes.
        name (str): what the body is called in error messages. Default: ``"body"``.

    Returns:
        ``(tensors, metadata)``: name -> writable C-contiguous array with a dtype in ``WIRE_DTYPES``, and the
        header's string metadata (empty if none).

    Raises:
        MalformedRequest: not a safetensors file (bad header, truncated data, overlapping offsets).
        InvalidInput: a dtype numpy cannot hold (bfloat16, float8) or that cannot travel on the wire.
    """
    import safetensors.numpy

    metadata = _safetensors_metadata(body, name=name)
    try:
        tensors = safetensors.numpy.load(body)
    except TypeError as exc:  # a dtype numpy has no counterpart for, e.g. bfloat16
        raise InvalidInput(
            f"{name}: safetensors tensor dtype not supported ({exc}); expected {', '.join(WIRE_DTYPES)}"
        ) from exc
    except Exception as exc:  # safetensors raises its own SafetensorError (and others) on garbage
        raise MalformedRequest(f"{name}: expected an application/x-safetensors body, could not read it: {exc}") from exc
    out = {}
    for key, array in tensors.items():
        wire = to_wire_dtype(array, name=f"{name}[{key!r}]")
        out[key] = wire if wire.flags.writeable else wire.copy()
    return out, metadata


def _safetensors_metadata(body: bytes, *, name: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors header (the numpy loader drops it), after checking the declared shapes
    (an empty tensor may declare one numpy cannot describe: ``_check_shape``)."""
    problem = f"{name}: expected an application/x-safetensors body (8-byte header length, then a JSON header)"
    if len(body) < 8:
        raise MalformedRequest(f"{problem}, got {len(body)} bytes")
    (size,) = struct.unpack("<Q", body[:8])
    if size > min(len(body) - 8, _SAFETENSORS_MAX_HEADER_BYTES):
        raise MalformedRequest(f"{problem}; the header claims {size} bytes but the body has {len(body) - 8}")
    try:
        header = json.loads(body[8 : 8 + size])
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedRequest(f"{problem}; the header is not valid JSON: {exc}") from exc
    for key, entry in header.items() if isinstance(header, dict) else ():
        shape = entry.get("shape") if isinstance(entry, dict) and key != "__metadata__" else None
        kind = str(entry.get("dtype")) if isinstance(entry, dict) else ""
        if isinstance(shape, list) and all(_is_int(d) for d in shape) and kind in _SAFETENSORS_ITEMSIZE:
            _check_shape(shape, kind, _SAFETENSORS_ITEMSIZE[kind], name=f"{name}[{key!r}].shape")
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise MalformedRequest(f"{name}: safetensors __metadata__ must map strings to strings")
    return dict(metadata)


def json_dumps(obj: Any) -> bytes:
    """Serialize to JSON bytes with orjson, writing numpy arrays and scalars natively.

    Args:
        obj (Any): JSON-able values, numpy arrays and numpy scalars (any layout or byte order).

    Returns:
        UTF-8 JSON bytes. NaN and infinities become ``null`` (orjson's rule; JSON has no such numbers).
    """
    return orjson.dumps(obj, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY)


def json_loads(body: bytes | str, *, name: str = "body") -> Any:
    """Parse JSON bytes with orjson.

    Raises:
        MalformedRequest: the body is not valid JSON (the message carries orjson's position).
    """
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedRequest(f"{name}: expected a JSON document, could not parse it: {exc}") from exc


def _json_default(obj: Any) -> Any:
    # orjson serializes only C-contiguous, native-endian arrays of plain dtypes; others land here.
    if isinstance(obj, np.ndarray):
        return to_wire_dtype(obj, name="json_dumps") if obj.dtype.kind in "biuf" else obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"json_dumps: cannot serialize {type(obj).__name__}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    for kind, label in names.items():
        if isinstance(value, kind):
            return label
    return "a number" if isinstance(value, int | float) else type(value).__name__


def _json_preview(value: object) -> str:
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
