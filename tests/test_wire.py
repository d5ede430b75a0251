"""Wire codecs: round trips per dtype and shape, normalisation, and the errors bad bodies get."""

from __future__ import annotations

import io
import struct

import numpy as np
import orjson
import pytest

from ntk_service.errors import InvalidInput, MalformedRequest
from ntk_service.wire import (
    WIRE_DTYPES,
    decode_npy,
    decode_safetensors,
    encode_npy,
    encode_safetensors,
    json_dumps,
    json_loads,
    tensor_from_json,
    tensor_to_json,
    to_wire_dtype,
)

SHAPES = [(), (0,), (3,), (2, 3), (2, 0, 4), (2, 3, 1, 2)]


def _sample(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(sum(shape) + len(shape))
    if dtype == "int64":
        return rng.integers(-(2**40), 2**40, size=shape, dtype=np.int64)
    return rng.standard_normal(size=shape).astype(dtype)


def _json_round_trip(array: np.ndarray) -> np.ndarray:
    return tensor_from_json(orjson.loads(json_dumps(tensor_to_json(array))), name="x1")


def _npy_round_trip(array: np.ndarray) -> np.ndarray:
    return decode_npy(encode_npy(array))


def _safetensors_round_trip(array: np.ndarray) -> np.ndarray:
    tensors, metadata = decode_safetensors(encode_safetensors({"x": array}, {"k": "v"}))
    assert metadata == {"k": "v"}
    return tensors["x"]


@pytest.mark.parametrize("round_trip", [_json_round_trip, _npy_round_trip, _safetensors_round_trip])
@pytest.mark.parametrize("dtype", WIRE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_is_exact(round_trip, dtype: str, shape: tuple[int, ...]) -> None:
    array = _sample(shape, dtype)
    out = round_trip(array)
    assert out.dtype == np.dtype(dtype)
    assert out.shape == shape
    assert out.flags.c_contiguous and out.flags.writeable
    np.testing.assert_array_equal(out, array)


def test_json_float32_text_round_trips_bitwise() -> None:
    # orjson writes the shortest float32 repr; parsing back as float32 must give the same bits.
    array = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    out = _json_round_trip(array)
    assert out.tobytes() == array.tobytes()


def test_tensor_to_json_is_flat_row_major() -> None:
    array = np.arange(6, dtype=np.float64).reshape(2, 3)
    assert orjson.loads(json_dumps(tensor_to_json(array))) == {
        "shape": [2, 3],
        "dtype": "float64",
        "data": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    }
    fortran = np.asfortranarray(array)
    assert orjson.loads(json_dumps(tensor_to_json(fortran)))["data"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    ("given", "expected"),
    [("int32", "int64"), ("uint8", "int64"), ("bool", "int64"), ("float16", "float32"), (">f8", "float64")],
)
def test_to_wire_dtype_converts_losslessly(given: str, expected: str) -> None:
    array = np.array([[0, 1], [1, 0]], dtype=given)
    out = to_wire_dtype(array)
    assert out.dtype == np.dtype(expected) and out.dtype.isnative
    np.testing.assert_array_equal(out, array.astype(expected))


@pytest.mark.parametrize("dtype", ["complex64", "U3", "O", [("a", "f4"), ("b", "i4")]])
def test_to_wire_dtype_refuses_non_numeric(dtype: object) -> None:
    with pytest.raises(InvalidInput, match="cannot travel on the wire"):
        to_wire_dtype(np.zeros(2, dtype=dtype))


def test_to_wire_dtype_refuses_uint64_beyond_int64() -> None:
    with pytest.raises(InvalidInput, match="do not fit int64"):
        to_wire_dtype(np.array([2**63], dtype=np.uint64))


def test_big_endian_npy_is_normalised() -> None:
    array = np.arange(12, dtype=">f4").reshape(3, 4)
    buffer = io.BytesIO()
    np.save(buffer, array)
    out = decode_npy(buffer.getvalue())
    assert out.dtype == np.dtype("float32") and out.dtype.isnative
    np.testing.assert_array_equal(out, array)


def test_fortran_order_npy_is_read_in_its_order() -> None:
    array = np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3))
    buffer = io.BytesIO()
    np.save(buffer, array)
    out = decode_npy(buffer.getvalue())
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, array)


def test_npy_version_2_header() -> None:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.ones((2, 2), dtype=np.float32), version=(2, 0))
    np.testing.assert_array_equal(decode_npy(buffer.getvalue()), np.ones((2, 2)))


def test_npy_object_array_is_refused_without_unpickling() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidInput, match="object or structured dtype"):
        decode_npy(buffer.getvalue(), name="x1")


def test_npy_structured_array_is_refused() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]))
    with pytest.raises(InvalidInput, match="object or structured dtype"):
        decode_npy(buffer.getvalue())


@pytest.mark.parametrize("body", [b"", b"not an npy file at all", b"\x93NUMPY\x01\x00garbage"])
def test_npy_garbage_is_malformed(body: bytes) -> None:
    with pytest.raises(MalformedRequest, match="x1: expected an application/x-npy body"):
        decode_npy(body, name="x1")


def test_npy_forged_header_is_refused_before_allocating() -> None:
    buffer = io.BytesIO()
    header = {"descr": "<f8", "fortran_order": False, "shape": (10**13,)}
    np.lib.format.write_array_header_1_0(buffer, header)
    forged = buffer.getvalue() + np.zeros(4).tobytes()
    with pytest.raises(MalformedRequest, match=r"declares shape \(10000000000000,\).*truncated or corrupt"):
        decode_npy(forged)


def test_npy_truncated_body_is_malformed() -> None:
    body = encode_npy(np.zeros((3, 3), dtype=np.float32))
    with pytest.raises(MalformedRequest, match="but the body holds"):
        decode_npy(body[:-4])


def test_safetensors_many_tensors_and_no_metadata() -> None:
    tensors = {
        "x1": _sample((2, 3), "float32"),
        "x2": _sample((4, 3), "float32"),
        "ids": _sample((5,), "int64"),
    }
    out, metadata = decode_safetensors(encode_safetensors(tensors))
    assert metadata == {}
    assert out.keys() == tensors.keys()
    for key, value in tensors.items():
        np.testing.assert_array_equal(out[key], value)


@pytest.mark.parametrize("body", [b"", b"garbage!", struct.pack("<Q", 2**40) + b"{}", struct.pack("<Q", 2) + b"{x"])
def test_safetensors_garbage_is_malformed(body: bytes) -> None:
    with pytest.raises(MalformedRequest, match="weights: expected an application/x-safetensors body"):
        decode_safetensors(body, name="weights")


def test_safetensors_truncated_data_is_malformed() -> None:
    body = encode_safetensors({"x": np.zeros((4, 4), dtype=np.float32)})
    with pytest.raises(MalformedRequest, match="could not read it"):
        decode_safetensors(body[:-8])


def test_encode_safetensors_is_read_by_the_safetensors_library() -> None:
    """Our writer (one copy, no safetensors call) against the format's own reader, and its writer's bytes read by
    ours: mixed dtypes, a non-contiguous and a big-endian array, an empty tensor, metadata and none."""
    import safetensors.numpy

    rng = np.random.default_rng(0)
    tensors = {
        "theta": rng.standard_normal((5, 3, 2, 2)).astype(np.float32),
        "b": rng.standard_normal((7, 4)).T,  # float64, Fortran-ordered view
        "ids": np.arange(6, dtype=">i8").reshape(2, 3),  # big-endian
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    for metadata in ({"mode": "full", "elapsed_ms": "1.5"}, None):
        body = encode_safetensors(tensors, metadata)
        (size,) = struct.unpack("<Q", body[:8])
        assert size % 8 == 0
        read = safetensors.numpy.load(body)
        assert set(read) == set(tensors)
        for key, array in tensors.items():
            assert read[key].dtype == array.dtype.newbyteorder("=")
            np.testing.assert_array_equal(read[key], array)
        theirs = safetensors.numpy.save({k: np.ascontiguousarray(v, v.dtype.newbyteorder("=")) for k, v in
                                         tensors.items()}, metadata=metadata)  # fmt: skip
        ours, meta = decode_safetensors(theirs)
        assert meta == (metadata or {})
        for key, array in tensors.items():
            np.testing.assert_array_equal(ours[key], array)


def test_encode_safetensors_refuses_the_header_key_as_a_name() -> None:
    with pytest.raises(TypeError, match="__metadata__"):
        encode_safetensors({"__metadata__": np.zeros(1)})


def test_encode_safetensors_refuses_non_string_metadata() -> None:
    with pytest.raises(TypeError, match="metadata must map str to str"):
        encode_safetensors({"x": np.zeros(1)}, {"version": 3})  # type: ignore[dict-item]


# ---- strict JSON tensors ----


@pytest.mark.parametrize(
    ("obj", "error", "pattern"),
    [
        ([1, 2, 3], MalformedRequest, r"x1: expected a tensor object like .*got a list"),
        ({"shape": [2], "data": [1, 2]}, MalformedRequest, r"x1: tensor object is missing 'dtype'"),
        ({"shape": "2", "dtype": "float32", "data": [1, 2]}, MalformedRequest, r"x1.shape: expected a list"),
        (
            {"shape": [2.0], "dtype": "float32", "data": [1, 2]},
            MalformedRequest,
            r"x1.shape: expected a list",
        ),
        ({"shape": [True], "dtype": "float32", "data": [1]}, MalformedRequest, r"x1.shape: expected a list"),
        ({"shape": [-1], "dtype": "float32", "data": []}, InvalidInput, r"x1.shape: dimensions must be >= 0"),
        ({"shape": [2], "dtype": 32, "data": [1, 2]}, MalformedRequest, r"x1.dtype: expected a string"),
        (
            {"shape": [2], "dtype": "float16", "data": [1, 2]},
            InvalidInput,
            r"x1.dtype: expected one of \['float32', 'float64', 'int64'\], got 'float16'",
        ),
        (
            {"shape": [2], "dtype": "float32", "data": "12"},
            MalformedRequest,
            r"x1.data: expected a flat list",
        ),
        (
            {"shape": [2, 3], "dtype": "float32", "data": [1, 2, 3]},
            InvalidInput,
            r"x1.data: shape \[2, 3\] needs 6 values .*got 3",
        ),
        (
            {"shape": [2], "dtype": "float32", "data": [1, "a"]},
            InvalidInput,
            r'x1.data\[1\]: expected a number, got "a"',
        ),
        (
            {"shape": [2], "dtype": "float32", "data": [1, None]},
            InvalidInput,
            r"x1.data\[1\]: .*got null .*NaN",
        ),
        (
            {"shape": [2], "dtype": "float32", "data": [True, False]},
            InvalidInput,
            r"x1.data\[0\]: .*got true",
        ),
        ({"shape": [2], "dtype": "float32", "data": [[1], [2]]}, InvalidInput, r"x1.data\[0\]: .*got \[1\]"),
        (
            {"shape": [2], "dtype": "int64", "data": [1, 2.5]},
            InvalidInput,
            r"x1.data\[1\]: dtype int64 needs",
        ),
        ({"shape": [1], "dtype": "int64", "data": [2**70]}, InvalidInput, r"beyond the int64 range"),
        ({"shape": [1], "dtype": "int64", "data": [2**63]}, InvalidInput, r"do not fit int64"),
        ({"shape": [1], "dtype": "float32", "data": [1e300]}, InvalidInput, r"beyond the float32 range"),
    ],
)
def test_tensor_from_json_errors(obj: object, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        tensor_from_json(obj, name="x1")


def test_tensor_from_json_accepts_ints_for_floats_and_huge_ints_as_float64() -> None:
    out = tensor_from_json({"shape": [3], "dtype": "float64", "data": [1, 2.5, 2**70]}, name="x1")
    np.testing.assert_array_equal(out, [1.0, 2.5, float(2**70)])


# ---- shapes numpy cannot describe, even when they hold no values (the fuzzer's 500) ----

_BEYOND_NUMPY = [59, 0, 5401, 10325661109373530, 3]
"""Zero values, yet numpy's np.zeros(shape) raises "array is too big": the product of the non-zero dimensions
times the item size overflows 2**63."""


def test_empty_json_tensor_with_a_shape_beyond_numpy_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match=r"y_train.shape: \[59,0,5401,10325661109373530,3\] of int64 .*2\*\*63"):
        tensor_from_json({"shape": _BEYOND_NUMPY, "dtype": "int64", "data": []}, name="y_train")
    with pytest.raises(InvalidInput, match="at most 64 dimensions, got 65"):
        tensor_from_json({"shape": [0] * 65, "dtype": "float32", "data": []}, name="x1")
    # The bound is numpy's own: the largest empty shape numpy holds still decodes.
    largest = [0, 2**63 // 8 - 1]
    assert tensor_from_json({"shape": largest, "dtype": "int64", "data": []}, name="x1").shape == tuple(largest)


def test_empty_npy_and_safetensors_with_a_shape_beyond_numpy_are_invalid_input() -> None:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": (0, 2**62, 2**62)})
    with pytest.raises(InvalidInput, match=r"x1: .npy header shape: .* of float32 is beyond the largest array"):
        decode_npy(buffer.getvalue(), name="x1")
    header = orjson.dumps({"x": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}})
    with pytest.raises(InvalidInput, match=r"weights\['x'\].shape: .* of F32 is beyond the largest array"):
        decode_safetensors(struct.pack("<Q", len(header)) + header, name="weights")


def test_json_dumps_handles_any_array_layout_and_numpy_scalars() -> None:
    body = json_dumps({"a": np.arange(4, dtype=">i8")[::2], "b": np.float32(1.5), "c": np.int64(3)})
    assert orjson.loads(body) == {"a": [0, 2], "b": 1.5, "c": 3}


def test_json_loads_errors_are_malformed() -> None:
    assert json_loads(b'{"a": 1}') == {"a": 1}
    with pytest.raises(MalformedRequest, match="request: expected a JSON document"):
        json_loads(b"{nope", name="request")
