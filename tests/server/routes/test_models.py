"""Model registry routes against a real server: every built-in family, versions, listing, deletion, and a
restart on the same data directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ntk_service import wire
from tests.conftest import SLOW_FACTORY, LiveServer
from tests.reference import reference_ntk
from tests.server.support import TINY_ARCHITECTURES, assert_close_to_reference, decode_theta, rebuild


@pytest.mark.parametrize("family", TINY_ARCHITECTURES)
def test_register_each_family(live_server: LiveServer, family: str) -> None:
    architecture = TINY_ARCHITECTURES[family]
    with live_server.client("write") as client:
        response = client.post("/v1/models", json={"name": f"models-{family}", "architecture": architecture, "seed": 3})
        assert response.status_code == 201, response.text
        assert response.headers["location"] == f"/v1/models/models-{family}"
        record = response.json()
        weights = client.get(f"/v1/models/models-{family}/versions/1/weights").content
    assert record["name"] == f"models-{family}"
    assert record["version"] == 1
    assert record["seed"] == 3
    assert set(record) == {
        "name", "version", "architecture", "seed", "num_params", "input_shape", "input_dtype", "output_dim",
        "parameters", "weights_sha256", "created_at", "label", "inputs", "class_name", "parameter_paths",
    }  # fmt: skip
    paths = record["parameter_paths"]  # every layer of a built-in family has a structure rule
    assert paths["jacrev_parameters"] == 0 and paths["structured_parameters"] == record["num_params"]
    assert {g["path"] for g in paths["groups"]} == {"structured"} and paths["auto"]["n"] == 64
    assert {k: record["architecture"][k] for k in architecture} == architecture
    model = rebuild(record, weights)
    named = list(model.named_parameters())
    assert record["parameters"] == [{"name": n, "shape": list(p.shape)} for n, p in named]
    assert record["num_params"] == sum(p.numel() for _, p in named)
    expected_dtype = "int64" if family == "transformer" else "float32"
    assert record["input_dtype"] == expected_dtype
    x = torch.zeros((1, *record["input_shape"]), dtype=getattr(torch, expected_dtype))
    assert model(x).shape == (1, record["output_dim"])


def test_same_seed_same_weights(live_server: LiveServer) -> None:
    architecture = TINY_ARCHITECTURES["mlp"]
    with live_server.client("write") as client:
        a = client.post("/v1/models", json={"name": "seed-a", "architecture": architecture, "seed": 5}).json()
        b = client.post("/v1/models", json={"name": "seed-b", "architecture": architecture, "seed": 5}).json()
        c = client.post("/v1/models", json={"name": "seed-c", "architecture": architecture, "seed": 6}).json()
    assert a["weights_sha256"] == b["weights_sha256"] != c["weights_sha256"]


def test_architectures_lists_the_families(live_server: LiveServer) -> None:
    with live_server.client("read") as client:
        body = client.get("/v1/architectures").json()
    names = [a["name"] for a in body["data"]]
    assert names == ["mlp", "cnn", "transformer", "sequential", "factory"]
    assert body["count"] == 5
    mlp = body["data"][0]
    assert {f["name"] for f in mlp["fields"]} >= {"input_dim", "hidden", "output_dim", "activation", "bias"}
    assert {f["name"] for f in mlp["fields"]} >= {"parameterization", "w_std", "b_std"}
    # the operator's factories are listed, so a 403 is not the first place a client learns them
    assert body["data"][4]["factories"] == [SLOW_FACTORY]
    layers = {layer["type"]: layer for layer in body["data"][3]["layers"]}
    conv = {f["name"]: f for f in layers["Conv2d"]["fields"]}
    assert conv["kernel_size"]["required"] and conv["padding"]["default"] == 0


def test_versions_list_show_download_delete(live_server: LiveServer) -> None:
    with live_server.client("write") as client:
        record = client.post("/v1/models", json={"name": "lifecycle", "architecture": TINY_ARCHITECTURES["mlp"]}).json()
        v1 = client.get("/v1/models/lifecycle/versions/1/weights").content
        tensors, _ = wire.decode_safetensors(v1)
        upload = client.post(
            "/v1/models/lifecycle/versions",
            content=wire.encode_safetensors({k: v * 2 for k, v in tensors.items()}),
            headers={"Content-Type": wire.MEDIA_SAFETENSORS},
        )
        assert upload.status_code == 201
        assert upload.headers["location"] == "/v1/models/lifecycle/versions/2"
        assert client.get("/v1/models/lifecycle").json()["version"] == 2
        versions = client.get("/v1/models/lifecycle/versions").json()
        assert [v["version"] for v in versions["data"]] == [1, 2]
        assert client.get("/v1/models/lifecycle/versions/1").json()["weights_sha256"] == record["weights_sha256"]
        v2, _ = wire.decode_safetensors(client.get("/v1/models/lifecycle/versions/2/weights").content)
        for name, value in tensors.items():
            np.testing.assert_array_equal(v2[name], value * 2)
        listed = client.get("/v1/models").json()
        assert any(m["name"] == "lifecycle" and m["version"] == 2 for m in listed["data"])
        assert listed["count"] == len(listed["data"])
        assert client.delete("/v1/models/lifecycle").status_code == 204
        assert client.get("/v1/models/lifecycle").status_code == 404
        assert client.get("/v1/models/lifecycle/versions/1/weights").status_code == 404
        again = client.post("/v1/models", json={"name": "lifecycle", "architecture": TINY_ARCHITECTURES["mlp"]})
        assert again.status_code == 201
        assert again.json()["version"] == 1


def test_registry_and_datasets_survive_a_restart(start_server: Callable[..., LiveServer], tmp_path: Path) -> None:
    data_dir = tmp_path / "persist"
    first = start_server(data_dir=data_dir)
    with first.client("write") as client:
        record = client.post("/v1/models", json={"name": "kept", "architecture": TINY_ARCHITECTURES["mlp"]}).json()
        weights, _ = wire.decode_safetensors(client.get("/v1/models/kept/versions/1/weights").content)
        client.post(
            "/v1/models/kept/versions",
            content=wire.encode_safetensors({k: v + 1 for k, v in weights.items()}),
            headers={"Content-Type": wire.MEDIA_SAFETENSORS},
        ).raise_for_status()
        data = np.arange(12, dtype=np.float32).reshape(3, 4)
        dataset = client.post(
            "/v1/datasets",
            content=wire.encode_npy(data),
            headers={"Content-Type": wire.MEDIA_NPY},
            params={"name": "d"},
        ).json()
        before = client.get("/v1/models/kept/versions").json()
    first.stop()

    second = start_server(data_dir=data_dir)
    with second.client("read") as client:
        assert client.get("/v1/models/kept/versions").json() == before
        assert client.get("/v1/models/kept/versions/1").json()["weights_sha256"] == record["weights_sha256"]
        v2, _ = wire.decode_safetensors(client.get("/v1/models/kept/versions/2/weights").content)
        assert client.get(f"/v1/datasets/{dataset['id']}").json() == dataset
        x1 = {"dataset": dataset["id"], "start": 0, "stop": 2}
        theta, meta = decode_theta(client.post("/v1/models/kept/ntk", json={"x1": x1, "mode": "trace"}))
    for name, value in weights.items():
        np.testing.assert_array_equal(v2[name], value + 1)
    assert meta["version"] == "2"
    model = rebuild(record, wire.encode_safetensors(v2))
    assert_close_to_reference(theta, reference_ntk(model, torch.from_numpy(data[:2]), None, "trace"))
