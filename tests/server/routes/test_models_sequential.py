"""The ``sequential`` family and version labels over HTTP, against the real server: JSON and safetensors
registration, every refusal as a 4xx with its message, and the OpenAPI union of the families."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import safetensors.torch
import torch
from torch import nn

from ntk_service import wire
from ntk_service.client._module_spec import describe_module
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server.support import assert_close_to_reference, decode_theta, rebuild, sample_inputs, tensor_json

SEQUENTIAL: dict[str, Any] = {
    "family": "sequential",
    "input_shape": [2, 4, 4],
    "layers": [
        {"type": "Conv2d", "in_channels": 2, "out_channels": 3, "kernel_size": 3, "padding": 1, "bias": False},
        {"type": "BatchNorm2d", "num_features": 3},
        {
            "type": "Residual",
            "body": [{"type": "ReLU"}, {"type": "Conv2d", "in_channels": 3, "out_channels": 3, "kernel_size": 1}],
        },
        {"type": "AdaptiveAvgPool2d", "output_size": 1},
        {"type": "Flatten"},
        {"type": "Linear", "in_features": 3, "out_features": 2, "parameterization": "ntk", "w_std": 1.5},
    ],
}


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    message: str = response.json()["error"]["message"]
    return message


def test_sequential_by_json_with_labels_and_a_kernel(live_server: LiveServer) -> None:
    name = _name("seq")
    with live_server.client() as client:
        response = client.post(
            "/v1/models", json={"name": name, "architecture": SEQUENTIAL, "seed": 2, "label": "init"}
        )
        record = response.json()
        assert response.status_code == 201, response.text
        assert (record["version"], record["label"], record["output_dim"]) == (1, "init", 2)
        assert [p["name"] for p in record["parameters"]][:4] == ["0.weight", "1.weight", "1.bias", "2.body.1.weight"]
        weights = client.get(f"/v1/models/{name}/versions/1/weights").content
        assert "1.running_var" in safetensors.torch.load(weights)  # buffers are stored too
        upload = client.post(
            f"/v1/models/{name}/versions",
            params={"label": "epoch 1"},
            content=weights,
            headers={"Content-Type": wire.MEDIA_SAFETENSORS},
        )
        assert upload.status_code == 201 and upload.json()["label"] == "epoch 1"
        listed = client.get(f"/v1/models/{name}/versions").json()["data"]
        assert [(v["version"], v["label"]) for v in listed] == [(1, "init"), (2, "epoch 1")]
        x1 = sample_inputs(record, 3, seed=0)
        kernel = client.post(f"/v1/models/{name}/ntk", json={"x1": tensor_json(x1), "dtype": "float64"})
        assert kernel.status_code == 200, kernel.text
    theta, _ = decode_theta(kernel)
    assert_close_to_reference(theta, reference_ntk(rebuild(record, weights), torch.from_numpy(x1)))


def test_register_with_trained_weights_as_version_1(live_server: LiveServer) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    architecture = describe_module(model, input_shape=(3,))
    body = safetensors.torch.save(model.state_dict(), metadata={"architecture": json.dumps(architecture)})
    headers = {"Content-Type": wire.MEDIA_SAFETENSORS}
    name = _name("trained")
    with live_server.client() as client:
        response = client.post("/v1/models", params={"name": name, "label": "epoch 9"}, content=body, headers=headers)
        assert response.status_code == 201, response.text
        assert (response.json()["seed"], response.json()["label"]) == (None, "epoch 9")
        stored = safetensors.torch.load(client.get(f"/v1/models/{name}/versions/1/weights").content)
        assert all(torch.equal(stored[k], v) for k, v in model.state_dict().items())

        missing_name = client.post("/v1/models", content=body, headers=headers)
        assert "a safetensors body needs the model's name as the query parameter ?name=" in _error(missing_name, 422)
        bare = safetensors.torch.save(model.state_dict())
        no_spec = client.post("/v1/models", params={"name": _name("x")}, content=bare, headers=headers)
        assert "the safetensors file has no __metadata__['architecture']" in _error(no_spec, 422)
        wrong = dict(model.state_dict())
        del wrong["1.running_mean"]
        misfit = safetensors.torch.save(wrong, metadata={"architecture": json.dumps(architecture)})
        refused = client.post("/v1/models", params={"name": _name("x")}, content=misfit, headers=headers)
        assert "missing tensors: 1.running_mean" in _error(refused, 422)
        long_label = client.post(
            f"/v1/models/{name}/versions", params={"label": "x" * 201}, content=bare, headers=headers
        )
        assert long_label.status_code == 422 and "label" in long_label.text


def test_refused_specs_are_4xx_with_their_message(live_server: LiveServer) -> None:
    def register(*layers: dict[str, Any], input_shape: list[int] | None = None) -> str:
        architecture = {"family": "sequential", "input_shape": input_shape or [4], "layers": list(layers)}
        with live_server.client() as client:
            return _error(client.post("/v1/models", json={"name": _name("bad"), "architecture": architecture}), 422)

    assert "layer layers.0: unknown layer type 'LSTM'" in register({"type": "LSTM"})
    assert "keyword 'device' not allowed" in register(
        {"type": "Linear", "in_features": 4, "out_features": 2, "device": "cuda"}
    )
    huge = {"type": "Linear", "in_features": 1 << 20, "out_features": 1 << 20}
    assert "parameters, more than the server's limit" in register(huge, input_shape=[1 << 20])
    conv = {"type": "Conv2d", "in_channels": 1, "out_channels": 1, "kernel_size": 9}
    assert "layer layers.0 (Conv2d) fails on its input of shape (1, 1, 4, 4)" in register(conv, input_shape=[1, 4, 4])


def test_openapi_documents_the_families_as_a_discriminated_union(live_server: LiveServer) -> None:
    with live_server.client("read") as client:
        schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/models"]["post"]["requestBody"]["content"]
    architecture = body["application/json"]["schema"]["properties"]["architecture"]
    assert architecture["discriminator"] == {"propertyName": "family"}
    examples = {option["examples"][0]["family"] for option in architecture["oneOf"]}
    assert examples == {"mlp", "cnn", "transformer", "sequential", "factory"}
    assert wire.MEDIA_SAFETENSORS in body
