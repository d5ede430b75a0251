"""Every error status the API promises, with its type and message, against the real server (never a 500)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from ntk_service import wire
from tests.conftest import LiveServer
from tests.server.support import TINY_ARCHITECTURES, request_kernel, tensor_json

MLP = TINY_ARCHITECTURES["mlp"]  # input (4,), k = 3


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[httpx.Client]:
    with live_server.client("write") as client:
        response = client.post("/v1/models", json={"name": "errors-mlp", "architecture": MLP})
        assert response.status_code == 201, response.text
        yield client


def _error(response: httpx.Response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == error_type
    return str(error["message"])


def _ntk(client: httpx.Client, body: Any, **kwargs: Any) -> httpx.Response:
    return client.post("/v1/models/errors-mlp/ntk", json=body, **kwargs)


X1 = tensor_json(np.ones((2, 4), np.float32))

# ---------------------------------------------------------------- 400 malformed


def test_400_invalid_json(client: httpx.Client) -> None:
    response = client.post("/v1/models", content=b'{"name": ', headers={"Content-Type": "application/json"})
    assert "expected a JSON document, could not parse it" in _error(response, 400, "malformed_request")


def test_400_tensor_without_data(client: httpx.Client) -> None:
    message = _error(_ntk(client, {"x1": {"shape": [2, 4], "dtype": "float32"}}), 400, "malformed_request")
    assert message == (
        "x1: tensor object is missing 'data'; expected "
        '{"shape": [2, 3], "dtype": "float32", "data": [1, 2, 3, 4, 5, 6]}'
    )


def test_400_corrupt_npy_body(client: httpx.Client) -> None:
    response = client.post("/v1/datasets", content=b"not an npy file", headers={"Content-Type": wire.MEDIA_NPY})
    assert "expected an application/x-npy body written by numpy.save" in _error(response, 400, "malformed_request")


def test_400_corrupt_safetensors_body(client: httpx.Client) -> None:
    response = client.post(
        "/v1/models/errors-mlp/ntk", content=b"\x01" * 20, headers={"Content-Type": wire.MEDIA_SAFETENSORS}
    )
    assert "expected an application/x-safetensors body" in _error(response, 400, "malformed_request")


# ---------------------------------------------------------------- 404, 405


def test_404_unknown_route(client: httpx.Client) -> None:
    assert (
        _error(client.get("/v2/nothing"), 404, "not_found") == "no route GET /v2/nothing; the API reference is at /docs"
    )


def test_404_unknown_model_version_and_dataset(client: httpx.Client) -> None:
    assert "no-such-model" in _error(client.get("/v1/models/no-such-model"), 404, "model_not_found")
    assert "version 9" in _error(client.get("/v1/models/errors-mlp/versions/9"), 404, "model_not_found")
    assert "ds_000000000000000000000000" in _error(
        client.get("/v1/datasets/ds_000000000000000000000000"), 404, "dataset_not_found"
    )
    assert "no-such-model" in _error(
        client.post("/v1/models/no-such-model/ntk", json={"x1": X1}), 404, "model_not_found"
    )


def test_405_names_the_allowed_methods(client: httpx.Client) -> None:
    response = client.put("/v1/models")
    message = _error(response, 405, "method_not_allowed")
    assert message == "PUT is not allowed on /v1/models; allowed: GET, POST"
    assert response.headers["allow"] == "GET, POST"


# ---------------------------------------------------------------- 406


def test_406_unsupported_accept(client: httpx.Client) -> None:
    message = _error(_ntk(client, {"x1": X1}, headers={"Accept": "text/html"}), 406, "not_acceptable")
    assert message == (
        "ntk of model 'errors-mlp': cannot produce any of Accept: 'text/html'; this route offers "
        "application/json, application/x-npy, application/x-safetensors"
    )


def test_406_json_too_large_before_computing(client: httpx.Client) -> None:
    # (70, 70, 3, 3) = 44100 values: at least 176 KiB of JSON, over the test server's 64 KiB cap
    x1 = tensor_json(np.zeros((70, 4), np.float32))
    message = _error(_ntk(client, {"x1": x1}), 406, "not_acceptable")
    assert "the JSON response would be at least 172.27 KiB, over the server's JSON limit of 64.00 KiB" in message
    assert "send 'Accept: application/x-npy' or 'Accept: application/x-safetensors'" in message


def test_406_json_too_large_after_encoding_and_binary_works(client: httpx.Client) -> None:
    # (100, 100) trace values: 40 KB at 4 bytes each would pass the first check, the real JSON is ~100 KB
    x1 = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    assert "over the server's JSON limit" in _error(
        _ntk(client, {"x1": tensor_json(x1), "mode": "trace"}), 406, "not_acceptable"
    )
    response = request_kernel(client, "errors-mlp", x1, None, fmt="npy", mode="trace")
    assert response.status_code == 200
    assert wire.decode_npy(response.content).shape == (100, 100)


# ---------------------------------------------------------------- 409


def test_409_name_conflict(client: httpx.Client) -> None:
    response = client.post("/v1/models", json={"name": "errors-mlp", "architecture": MLP})
    assert "errors-mlp" in _error(response, 409, "name_conflict")


# ---------------------------------------------------------------- 413


def test_413_declared_body_too_large(client: httpx.Client) -> None:
    body = wire.encode_npy(np.zeros((600_000,), np.float32))  # 2.3 MiB > 2 MiB
    response = client.post("/v1/datasets", content=body, headers={"Content-Type": wire.MEDIA_NPY})
    message = _error(response, 413, "payload_too_large")
    assert message.startswith("request body of 2.29 MiB exceeds the server's limit of 2.00 MiB (NTK_MAX_BODY_BYTES)")


def test_413_streamed_body_too_large(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(24):
            yield b"\0" * 100_000

    response = client.post("/v1/datasets", content=chunks(), headers={"Content-Type": wire.MEDIA_NPY})
    assert "exceeds the server's limit of 2.00 MiB" in _error(response, 413, "payload_too_large")


def test_413_memory_estimate_carries_estimate_and_budget(client: httpx.Client) -> None:
    # the (3000, 3000, 3, 3) float32 result alone is 309 MiB, over the test server's 256 MiB budget
    x1 = tensor_json(np.zeros((3000, 4), np.float32))
    response = _ntk(client, {"x1": x1}, headers={"Accept": wire.MEDIA_NPY})
    message = _error(response, 413, "memory_estimate_exceeded")
    assert "the result alone is 308.99 MiB" in message
    assert "over the memory budget of 256.00 MiB" in message
    error = response.json()["error"]
    assert error["budget_bytes"] == 256 * 2**20
    assert error["estimate_bytes"] > error["budget_bytes"]
    assert "use mode trace or output_diagonal, fewer examples" in message  # full: both are smaller


def test_413_in_trace_mode_does_not_suggest_trace(client: httpx.Client) -> None:
    # the (9000, 9000) float32 trace result alone is 309 MiB, over the test server's 256 MiB budget
    x1 = tensor_json(np.zeros((9000, 4), np.float32))
    response = _ntk(client, {"x1": x1, "mode": "trace"}, headers={"Accept": wire.MEDIA_NPY})
    message = _error(response, 413, "memory_estimate_exceeded")
    assert "for mode trace" in message and "the result alone is 308.99 MiB" in message
    assert "trace," not in message.split("memory budget")[1]  # nothing cheaper than trace to suggest
    assert message.endswith(
        "over the memory budget of 256.00 MiB; use fewer examples, a parameter subset, or a batch job"
    )
    # the analysis routes' own estimate: a 3500x3500 float64 eigh (3 copies, 294 MiB) of a trace kernel
    spectrum = client.post(
        "/v1/models/errors-mlp/spectrum", json={"x": tensor_json(np.zeros((3500, 4), np.float32)), "mode": "trace"}
    )
    message = _error(spectrum, 413, "memory_estimate_exceeded")
    assert message.endswith("over the memory budget of 256.00 MiB (NTK_MEMORY_BUDGET_BYTES); use fewer examples")


# ---------------------------------------------------------------- 415


def test_415_wrong_content_types(client: httpx.Client) -> None:
    message = _error(
        client.post("/v1/models", content=b"name=m", headers={"Content-Type": "text/plain"}),
        415,
        "unsupported_media_type",
    )
    assert message == (
        "register model: expected Content-Type application/json, got 'text/plain'; "
        "set the Content-Type header to match the body"
    )
    response = client.post("/v1/datasets", content=b"1,2", headers={"Content-Type": "text/csv"})
    assert "expected Content-Type application/x-npy or application/x-safetensors or" in _error(
        response, 415, "unsupported_media_type"
    )
    response = client.post(
        "/v1/models/errors-mlp/versions", content=wire.encode_npy(np.zeros(3)), headers={"Content-Type": wire.MEDIA_NPY}
    )
    assert "expected Content-Type application/x-safetensors" in _error(response, 415, "unsupported_media_type")


# ---------------------------------------------------------------- 422


def test_422_shape_mismatch_before_computing(client: httpx.Client) -> None:
    x1 = tensor_json(np.ones((2, 3), np.float32))
    assert _error(_ntk(client, {"x1": x1}), 422, "shape_mismatch") == (
        "ntk of model 'errors-mlp': x1 has per-example shape (3,), model 'errors-mlp' expects (4,); "
        "send a batch of shape (N, 4)"
    )


def test_422_dtype_mismatch(client: httpx.Client) -> None:
    x1 = tensor_json(np.ones((2, 4), np.int64))
    assert "x1 has dtype int64, model 'errors-mlp' expects float32" in _error(
        _ntk(client, {"x1": x1}), 422, "invalid_input"
    )


@pytest.mark.parametrize("family", ["sequential", "transformer"])
def test_422_token_ids_outside_the_vocabulary_before_computing(client: httpx.Client, family: str) -> None:
    architecture = TINY_ARCHITECTURES["transformer"]  # vocabulary 11
    if family == "sequential":
        architecture = {
            "family": "sequential",
            "input_shape": [3],
            "input_dtype": "int64",
            "layers": [
                {"type": "Embedding", "num_embeddings": 11, "embedding_dim": 2},
                {"type": "Flatten"},
                {"type": "Linear", "in_features": 6, "out_features": 2},
            ],
        }
    name = f"errors-tokens-{family}"
    assert client.post("/v1/models", json={"name": name, "architecture": architecture}).status_code == 201
    x1 = tensor_json(np.array([[1, 2, 3], [4, 11, 0]], np.int64))
    message = _error(client.post(f"/v1/models/{name}/ntk", json={"x1": x1}), 422, "invalid_input")
    assert message == (
        f"ntk of model {name!r}: x1 has token ids in [0, 11], model {name!r} has a vocabulary of 11 (ids 0..10)"
    )
    ok = tensor_json(np.array([[1, 2, 3], [4, 10, 0]], np.int64))
    assert client.post(f"/v1/models/{name}/ntk", json={"x1": ok, "mode": "trace"}).status_code == 200


def test_422_nan_input_in_a_binary_body(client: httpx.Client) -> None:
    x1 = np.ones((2, 4), np.float32)
    x1[1, 2] = np.nan
    response = request_kernel(client, "errors-mlp", x1, None, fmt="npy")
    assert "x1" in _error(response, 422, "non_finite_input")


def test_422_unknown_mode_and_options(client: httpx.Client) -> None:
    message = _error(_ntk(client, {"x1": X1, "mode": "diagonal"}), 422, "invalid_input")
    assert message.startswith("ntk of model 'errors-mlp': mode: Input should be 'full', 'trace'")
    message = _error(_ntk(client, {"x1": X1, "colour": "red"}), 422, "invalid_input")
    assert "colour: Extra inputs are not permitted" in message
    message = _error(_ntk(client, {"x1": X1}, params={"mode": "trace"}), 422, "invalid_input")
    assert "with a JSON body, put mode/implementation/params/dtype/version in the body" in message


def test_422_bad_query_option_with_binary_body(client: httpx.Client) -> None:
    response = request_kernel(client, "errors-mlp", np.ones((2, 4), np.float32), None, fmt="npy", mode="nope")
    message = _error(response, 422, "invalid_input")
    assert message.startswith("POST /v1/models/errors-mlp/ntk: mode: Input should be 'full'")


def test_422_no_matching_parameters(client: httpx.Client) -> None:
    response = _ntk(client, {"x1": X1, "params": ["decoder.*"]})
    assert "decoder.*" in _error(response, 422, "no_matching_parameters")


def test_422_dataset_rows_out_of_range(client: httpx.Client) -> None:
    ds = client.post(
        "/v1/datasets", content=wire.encode_npy(np.ones((5, 4), np.float32)), headers={"Content-Type": wire.MEDIA_NPY}
    ).json()
    response = _ntk(client, {"x1": {"dataset": ds["id"], "start": 3, "stop": 9}})
    assert ds["id"] in _error(response, 422, "invalid_input")


def test_422_invalid_architecture_and_name(client: httpx.Client) -> None:
    response = client.post("/v1/models", json={"name": "bad", "architecture": {"family": "rnn"}})
    assert "rnn" in _error(response, 422, "invalid_input")
    response = client.post("/v1/models", json={"name": "../etc", "architecture": MLP})
    assert _error(response, 422, "invalid_input").startswith("register model: name: String should match pattern")
    response = client.post("/v1/models", json={"architecture": MLP})
    assert _error(response, 422, "invalid_input") == "register model: name: Field required"


def test_422_weights_that_do_not_fit_the_architecture(client: httpx.Client) -> None:
    response = client.post(
        "/v1/models/errors-mlp/versions",
        content=wire.encode_safetensors({"layers.0.weight": np.zeros((2, 2), np.float32)}),
        headers={"Content-Type": wire.MEDIA_SAFETENSORS},
    )
    assert "layers.0.weight" in _error(response, 422, "invalid_input")


def test_422_path_parameter(client: httpx.Client) -> None:
    message = _error(client.get("/v1/models/errors-mlp/versions/zero"), 422, "invalid_input")
    assert (
        message == "GET /v1/models/errors-mlp/versions/zero: version: Input should be a valid integer, "
        "unable to parse string as an integer"
    )


# ---------------------------------------------------------------- 403 (factory allow-list)


def test_403_factory_not_allowed(client: httpx.Client) -> None:
    architecture = {"family": "factory", "factory": "os:system", "kwargs": {}, "input_shape": [1]}
    response = client.post("/v1/models", json={"name": "evil", "architecture": architecture})
    assert "factory 'os:system' is not allowed on this server" in _error(response, 403, "permission_denied")
