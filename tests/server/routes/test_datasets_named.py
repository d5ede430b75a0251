"""Data sets of named arrays against a real server: upload as JSON, .npz and safetensors (and through the client),
listing and showing them, and hostile uploads refused with a 4xx and nothing written outside the data directory."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ntk_service import wire
from ntk_service.client import Client
from tests.conftest import LiveServer

IDS = np.array([[101, 7592, 102], [101, 2088, 102]], dtype=np.int64)
MASK = np.array([[1, 1, 1], [1, 1, 0]], dtype=np.int64)


def _npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def _post(live_server: LiveServer, body: bytes, media: str) -> tuple[int, dict]:
    with live_server.client("write") as client:
        response = client.post("/v1/datasets", content=body, headers={"Content-Type": media})
    return response.status_code, response.json()


def _expected_arrays(pixels_dtype: str = "float64") -> list[dict]:
    return [
        {"name": "input_ids", "shape": [2, 3], "dtype": "int64"},
        {"name": "attention_mask", "shape": [2, 3], "dtype": "int64"},
        {"name": "pixels", "shape": [2, 1, 2], "dtype": pixels_dtype},
    ]


@pytest.mark.parametrize("media", [wire.MEDIA_JSON, wire.MEDIA_NPZ, wire.MEDIA_SAFETENSORS])
def test_named_upload_show_list(live_server: LiveServer, media: str) -> None:
    pixels = np.array([[[0.5, -1.0]], [[2.0, 0.25]]])
    arrays = {"input_ids": IDS, "attention_mask": MASK, "pixels": pixels}
    if media == wire.MEDIA_JSON:
        body = json.dumps({k: v.tolist() for k, v in arrays.items()}).encode()
    elif media == wire.MEDIA_NPZ:
        body = _npz(**arrays)
    else:
        body = wire.encode_safetensors(arrays)
    status, record = _post(live_server, body, media)
    assert status == 201, record
    assert (record["shape"], record["dtype"]) == ([2], "mapping")
    got = record["arrays"]
    if media == wire.MEDIA_SAFETENSORS:  # safetensors orders its tensors itself, not as the writer gave them
        got = sorted(got, key=_expected_arrays().index)
    assert got == _expected_arrays()
    with live_server.client("read") as client:
        assert client.get(f"/v1/datasets/{record['id']}").json() == record
        assert record in client.get("/v1/datasets").json()["data"]


def test_json_tensor_objects_choose_their_dtype(live_server: LiveServer) -> None:
    body = {"input_ids": IDS.tolist(), "pixels": {"shape": [2, 2], "dtype": "float32", "data": [1, 2, 3, 4]}}
    status, record = _post(live_server, json.dumps(body).encode(), wire.MEDIA_JSON)
    assert status == 201, record
    assert [a["dtype"] for a in record["arrays"]] == ["int64", "float32"]


def test_client_and_rows_of_a_named_data_set(live_server: LiveServer) -> None:
    with Client(live_server.url, api_key=live_server.write_key) as client:
        record = client.upload_dataset({"input_ids": IDS, "attention_mask": MASK}, name="prompts")
        assert record["name"] == "prompts" and [a["name"] for a in record["arrays"]] == ["input_ids", "attention_mask"]
        assert client.get_dataset(record["id"]) == record
        one = client.upload_dataset(np.zeros((2, 3), np.float32))  # a single array: exactly as before
        assert "arrays" not in one and one["shape"] == [2, 3]


@pytest.mark.parametrize(
    ("body", "media", "status", "fragment"),
    [
        (b'{"input_ids": [[1, 2], [3]]}', wire.MEDIA_JSON, 422, "rectangular nested list"),
        (b'{"input_ids": [["a", "b"]]}', wire.MEDIA_JSON, 422, "got strings"),
        (b'{"input_ids": [[1, null]]}', wire.MEDIA_JSON, 422, "got nulls"),
        (b'{"../x": [[1, 2]]}', wire.MEDIA_JSON, 422, "array name '../x' is not allowed"),
        (b"{}", wire.MEDIA_JSON, 422, "no arrays"),
        (b"[[1, 2]]", wire.MEDIA_JSON, 400, "expected a JSON object of named arrays"),
        (b'{"a": [[1, 2]], "b": [[1, 2], [3, 4]]}', wire.MEDIA_JSON, 422, "got 'a': 1, 'b': 2"),
        (b"not a zip", wire.MEDIA_NPZ, 400, "expected an .npz archive"),
        (b"x", "text/plain", 415, "expected Content-Type"),
    ],
)
def test_bad_bodies_are_refused(live_server: LiveServer, body: bytes, media: str, status: int, fragment: str) -> None:
    got, error = _post(live_server, body, media)
    assert got == status, error
    assert fragment in error["error"]["message"]


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("members", "status", "fragment"),
    [
        ({"ok.npy": _npy(np.array([{"evil": 1}, None], dtype=object))}, 422, "object array, which is never loaded"),
        ({"../../escape.npy": _npy(np.zeros((2, 2)))}, 422, "member '../../escape.npy' is not allowed"),
        ({"sub/dir.npy": _npy(np.zeros((2, 2)))}, 422, "member 'sub/dir.npy' is not allowed"),
        ({"/abs.npy": _npy(np.zeros((2, 2)))}, 422, "is not allowed"),
        ({"ids.txt": b"1 2 3"}, 422, "member 'ids.txt' is not allowed"),
        ({"big.npy": _npy(np.zeros((2, 2 * 2**20 // 8 + 1)))}, 413, "inflate to"),  # a zip bomb, in small
        ({"bad.npy": b"\x93NUMPY garbage"}, 400, "is not a valid .npy array"),
    ],
)
def test_hostile_npz_is_refused_and_writes_nothing(
    live_server: LiveServer, members: dict[str, bytes], status: int, fragment: str
) -> None:
    before = _files(live_server.data_dir.parent)
    got, error = _post(live_server, _zip(members), wire.MEDIA_NPZ)
    assert got == status, error
    assert fragment in error["error"]["message"]
    after = _files(live_server.data_dir.parent)
    new = {p for p in after - before if "-server-" not in p.name and not p.name.startswith("registry.sqlite3")}
    assert new == set()  # nothing written: not escape.npy, not a data set file
    assert not (live_server.data_dir.parent.parent / "escape.npy").exists()


def _tampered(kind: str) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, input_ids=np.arange(1000, dtype=np.int64).reshape(10, 100))
    body = bytearray(buffer.getvalue())
    local, central = body.find(b"PK\x03\x04"), body.find(b"PK\x01\x02")
    if kind == "corrupt":  # deflate stream garbled
        body[local + 80] ^= 0xFF
        body[local + 81] ^= 0xFF
    elif kind == "encrypted":  # the general-purpose flag's encryption bit
        body[local + 6] |= 1
        body[central + 8] |= 1
    else:  # a compression method zipfile does not know
        body[local + 8] = body[central + 10] = 99
    return bytes(body)


@pytest.mark.parametrize("kind", ["corrupt", "encrypted", "unknown-method"])
def test_a_tampered_npz_is_a_400(live_server: LiveServer, kind: str) -> None:
    got, error = _post(live_server, _tampered(kind), wire.MEDIA_NPZ)
    assert got == 400, error
    assert "member 'input_ids' could not be read" in error["error"]["message"] or "not a valid .npy" in str(error)


def test_safetensors_header_lying_about_sizes_is_refused(live_server: LiveServer) -> None:
    real = wire.encode_safetensors({"input_ids": IDS, "attention_mask": MASK})
    (size,) = struct.unpack("<Q", real[:8])
    header = json.loads(real[8 : 8 + size])
    header["input_ids"]["shape"] = [2000, 3]  # claims 48 kB of data the body does not hold
    header["input_ids"]["data_offsets"] = [0, 2000 * 3 * 8]
    raw = json.dumps(header).encode()
    body = struct.pack("<Q", len(raw)) + raw + real[8 + size :]
    got, error = _post(live_server, body, wire.MEDIA_SAFETENSORS)
    assert got == 400, error
    assert "safetensors" in error["error"]["message"]
    huge = struct.pack("<Q", 2**40) + real[8:]  # a header length beyond the body
    got, error = _post(live_server, huge, wire.MEDIA_SAFETENSORS)
    assert got == 400 and "the header claims" in error["error"]["message"]
