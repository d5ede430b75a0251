"""Data set routes against a real server: upload as .npy or safetensors, list, show, delete (named arrays:
test_datasets_named.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ntk_service import wire
from tests.conftest import LiveServer


@pytest.mark.parametrize("media", [wire.MEDIA_NPY, wire.MEDIA_SAFETENSORS])
def test_upload_show_list_delete(live_server: LiveServer, media: str) -> None:
    data = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float64)
    body = wire.encode_npy(data) if media == wire.MEDIA_NPY else wire.encode_safetensors({"x": data})
    with live_server.client("write") as client:
        response = client.post("/v1/datasets", content=body, headers={"Content-Type": media}, params={"name": "five"})
        assert response.status_code == 201, response.text
        record = response.json()
        assert response.headers["location"] == f"/v1/datasets/{record['id']}"
        assert record["shape"] == [5, 3]
        assert record["dtype"] == "float64"
        assert record["name"] == "five"
        assert len(record["sha256"]) == 64
        assert client.get(f"/v1/datasets/{record['id']}").json() == record
        listed = client.get("/v1/datasets").json()
        assert record in listed["data"]
        assert listed["count"] == len(listed["data"])
        assert client.delete(f"/v1/datasets/{record['id']}").status_code == 204
        assert client.get(f"/v1/datasets/{record['id']}").status_code == 404


def test_safetensors_upload_of_other_names_is_a_named_data_set(live_server: LiveServer) -> None:
    """Tensor 'x' alone is one array (above); any other names make a data set of named arrays."""
    body = wire.encode_safetensors({"inputs": np.zeros((2, 2), np.float32)})
    with live_server.client("write") as client:
        response = client.post("/v1/datasets", content=body, headers={"Content-Type": wire.MEDIA_SAFETENSORS})
    assert response.status_code == 201, response.text
    record = response.json()
    assert (record["shape"], record["dtype"]) == ([2], "mapping")
    assert record["arrays"] == [{"name": "inputs", "shape": [2, 2], "dtype": "float32"}]
