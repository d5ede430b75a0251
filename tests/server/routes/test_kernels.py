"""Kernels over HTTP against a real server, in every mode and response type, checked against the float64
reference on the model rebuilt from the downloaded weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ntk_service import wire
from ntk_service.vocabulary import CONTRACTED_MODES
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server.support import (
    FORMATS,
    TINY_ARCHITECTURES,
    assert_close_to_reference,
    decode_theta,
    rebuild,
    request_kernel,
    sample_inputs,
    tensor_json,
)

MODES = tuple(mode.value for mode in CONTRACTED_MODES)
"""The contracted modes, read off the table (the derived ones have their own tests)."""

CASES = [("mlp", mode, fmt) for mode in MODES for fmt in FORMATS] + [
    (family, mode, FORMATS[(i + offset) % len(FORMATS)])
    for offset, family in enumerate(("cnn", "transformer"))
    for i, mode in enumerate(MODES)
]
"""Every mode in every response type for the MLP; every mode for the CNN and transformer, the types rotating
(each family still meets all three types), to keep the run short."""


@pytest.fixture(scope="module")
def registered(live_server: LiveServer) -> dict[str, tuple[dict[str, Any], torch.nn.Module]]:
    """Each family registered once (as 'kernels-<family>'), with its model rebuilt from the downloaded weights."""
    out = {}
    with live_server.client("write") as client:
        for family, architecture in TINY_ARCHITECTURES.items():
            name = f"kernels-{family}"
            response = client.post("/v1/models", json={"name": name, "architecture": architecture, "seed": 7})
            assert response.status_code == 201, response.text
            record = response.json()
            weights = client.get(f"/v1/models/{name}/versions/1/weights")
            assert weights.headers["content-type"] == wire.MEDIA_SAFETENSORS
            out[family] = (record, rebuild(record, weights.content))
    return out


def _reference(model: torch.nn.Module, x1: np.ndarray, x2: np.ndarray | None, mode: str) -> torch.Tensor:
    return reference_ntk(model, torch.from_numpy(x1), None if x2 is None else torch.from_numpy(x2), mode)


@pytest.mark.parametrize(("family", "mode", "fmt"), CASES)
def test_kernel_matches_reference(
    live_server: LiveServer, registered: dict[str, Any], family: str, mode: str, fmt: str
) -> None:
    record, model = registered[family]
    x1 = sample_inputs(record, 3, seed=1)
    # npy carries x1 alone (x2 = x1); example_diagonal never uses x2
    x2 = None if fmt == "npy" or mode == "example_diagonal" else sample_inputs(record, 2, seed=2)
    with live_server.client("read") as client:
        response = request_kernel(client, record["name"], x1, x2, fmt=fmt, mode=mode)
    theta, meta = decode_theta(response)
    assert_close_to_reference(theta, _reference(model, x1, x2, mode))
    assert meta["mode"] == mode
    assert meta["model"] == record["name"]
    assert meta["version"] == "1"
    assert meta["implementation"] in {"jacobian_contraction", "ntk_vector_products", "structured"}
    assert float(meta["elapsed_ms"]) > 0


@pytest.mark.parametrize("implementation", ["jacobian_contraction", "ntk_vector_products"])
def test_float64_implementation_and_param_subset(
    live_server: LiveServer, registered: dict[str, Any], implementation: str
) -> None:
    record, model = registered["mlp"]
    x1 = sample_inputs(record, 3, seed=3)
    with live_server.client("read") as client:
        response = request_kernel(
            client,
            record["name"],
            x1,
            None,
            fmt="json",
            dtype="float64",
            implementation=implementation,
            params=["layers.1.*"],
        )
    theta, meta = decode_theta(response)
    assert meta["implementation"] == implementation
    assert theta.dtype == np.float64
    expected = reference_ntk(model, torch.from_numpy(x1), None, "full", params=["layers.1.*"])
    np.testing.assert_allclose(theta, expected.numpy(), rtol=1e-10, atol=1e-12)


def test_options_as_query_parameters_with_binary_body(live_server: LiveServer, registered: dict[str, Any]) -> None:
    record, model = registered["mlp"]
    x1, x2 = sample_inputs(record, 2, seed=4), sample_inputs(record, 3, seed=5)
    with live_server.client("read") as client:
        response = request_kernel(
            client,
            record["name"],
            x1,
            x2,
            fmt="safetensors",
            mode="trace",
            dtype="float64",
            version=1,
            implementation="ntk_vector_products",
        )
    theta, meta = decode_theta(response)
    assert meta["implementation"] == "ntk_vector_products"
    np.testing.assert_allclose(theta, _reference(model, x1, x2, "trace").numpy(), rtol=1e-10, atol=1e-12)


def test_uploaded_version_is_used_and_old_version_stays(live_server: LiveServer) -> None:
    architecture = TINY_ARCHITECTURES["mlp"]
    with live_server.client("write") as client:
        record = client.post("/v1/models", json={"name": "kernels-v2", "architecture": architecture}).json()
        v1_model = rebuild(record, client.get("/v1/models/kernels-v2/versions/1/weights").content)
        new = {k: torch.randn_like(v) for k, v in v1_model.state_dict().items()}
        upload = client.post(
            "/v1/models/kernels-v2/versions",
            content=wire.encode_safetensors({k: v.numpy() for k, v in new.items()}),
            headers={"Content-Type": wire.MEDIA_SAFETENSORS},
        )
        assert upload.status_code == 201, upload.text
        assert upload.json()["version"] == 2
        v2_model = rebuild(record, client.get("/v1/models/kernels-v2/versions/2/weights").content)
        x1 = sample_inputs(record, 2, seed=6)
        latest, _ = decode_theta(request_kernel(client, "kernels-v2", x1, None, fmt="json", mode="trace"))
        first, meta = decode_theta(request_kernel(client, "kernels-v2", x1, None, fmt="json", mode="trace", version=1))
    assert meta["version"] == "1"
    assert_close_to_reference(latest, _reference(v2_model, x1, None, "trace"))
    assert_close_to_reference(first, _reference(v1_model, x1, None, "trace"))
    assert not np.allclose(latest, first)


def _side_cache_hits(client: Any) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("ntk_side_cache_hits_total "):  # a counter since issue 16
            return float(line.split()[1])
    raise AssertionError("ntk_side_cache_hits_total not exported")


def test_dataset_rows_as_x2_and_the_side_cache_reuses_them(live_server: LiveServer, registered: dict[str, Any]) -> None:
    record, model = registered["mlp"]
    data = sample_inputs(record, 6, seed=8)
    with live_server.client("write") as client:
        upload = client.post("/v1/datasets", content=wire.encode_npy(data), headers={"Content-Type": wire.MEDIA_NPY})
        assert upload.status_code == 201, upload.text
        ref = {"dataset": upload.json()["id"], "start": 1, "stop": 4}
        hits_before = _side_cache_hits(client)
        results = []
        for seed in (9, 10):
            x1 = sample_inputs(record, 2, seed=seed)
            body = {"x1": tensor_json(x1), "x2": ref, "implementation": "jacobian_contraction"}
            theta, _ = decode_theta(client.post(f"/v1/models/{record['name']}/ntk", json=body))
            results.append((x1, theta))
        hits_after = _side_cache_hits(client)
    for x1, theta in results:
        assert_close_to_reference(theta, _reference(model, x1, data[1:4], "full"))
    assert hits_after > hits_before, "the second request should reuse the data set's side"


def _side_cache_metric(client: Any, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_inline_x1_and_x2_stay_out_of_the_side_cache(live_server: LiveServer, registered: dict[str, Any]) -> None:
    """Inline sides are not cached (the engine takes its joint pass for them): the cache is never consulted."""
    record, model = registered["mlp"]
    x1, x2 = sample_inputs(record, 3, seed=21), sample_inputs(record, 3, seed=22)
    with live_server.client("write") as client:
        before = {
            m: _side_cache_metric(client, m) for m in ("ntk_side_cache_hits_total", "ntk_side_cache_misses_total")
        }
        theta, _ = decode_theta(request_kernel(client, record["name"], x1, x2, fmt="safetensors"))
        after = {m: _side_cache_metric(client, m) for m in ("ntk_side_cache_hits_total", "ntk_side_cache_misses_total")}
    assert after == before
    assert_close_to_reference(theta, _reference(model, x1, x2, "full"))


def test_dataset_as_x1_with_symmetric_x2(live_server: LiveServer, registered: dict[str, Any]) -> None:
    record, model = registered["transformer"]
    data = sample_inputs(record, 4, seed=11)
    with live_server.client("write") as client:
        ds = client.post(
            "/v1/datasets",
            content=wire.encode_safetensors({"x": data}),
            headers={"Content-Type": wire.MEDIA_SAFETENSORS},
            params={"name": "tokens"},
        ).json()
        assert ds["name"] == "tokens"
        body = {"x1": {"dataset": ds["id"]}, "mode": "output_diagonal"}
        theta, _ = decode_theta(client.post(f"/v1/models/{record['name']}/ntk", json=body))
    assert_close_to_reference(theta, _reference(model, data, None, "output_diagonal"))


def test_shorter_token_sequences_are_accepted(live_server: LiveServer, registered: dict[str, Any]) -> None:
    record, model = registered["transformer"]
    x1 = sample_inputs(record, 2, seed=12)[:, :3]
    with live_server.client("read") as client:
        theta, _ = decode_theta(request_kernel(client, record["name"], x1, None, fmt="npy", mode="trace"))
    assert_close_to_reference(theta, _reference(model, x1, None, "trace"))


def test_large_json_body_is_parsed_and_computed(live_server: LiveServer, registered: dict[str, Any]) -> None:
    record, model = registered["mlp"]
    x1 = sample_inputs(record, 15_000, seed=13)  # ~1.3 MB of JSON: parsed in a worker thread
    with live_server.client("read") as client:
        response = client.post(
            f"/v1/models/{record['name']}/ntk",
            json={"x1": tensor_json(x1), "mode": "example_diagonal"},
            headers={"Accept": wire.MEDIA_NPY},
        )
    assert len(response.request.content) > 2**20
    theta, _ = decode_theta(response)
    assert theta.shape == (15_000, 3, 3)
    # example_diagonal rows are per example: check a few against the reference
    assert_close_to_reference(theta[:4], _reference(model, x1[:4], None, "example_diagonal"))
