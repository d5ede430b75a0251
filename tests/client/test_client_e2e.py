"""The Python client used as a user would, against the real uvicorn server of ``tests/conftest.py``.

Kernels are checked against the float64 reference loop (``tests/reference.py``) on the model rebuilt from the
weights the client downloaded; errors are checked by class, status and message.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch

from ntk_service import errors
from ntk_service.client import Client
from ntk_service.vocabulary import CONTRACTED_MODES
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server.support import TINY_ARCHITECTURES, assert_close_to_reference, rebuild, sample_inputs

MLP = TINY_ARCHITECTURES["mlp"]  # input_dim 4, output_dim 3


@pytest.fixture
def client(live_server: LiveServer) -> Client:
    with Client(live_server.url, api_key=live_server.write_key, timeout=60) as client:
        yield client


@pytest.fixture
def model(client: Client) -> dict[str, Any]:
    """A freshly registered tiny MLP with a unique name (the live server is shared by the whole session)."""
    return client.register_model(f"client-mlp-{uuid.uuid4().hex[:8]}", MLP, seed=3)


def _reference_model(client: Client, record: dict[str, Any], version: int | None = None) -> torch.nn.Module:
    weights = client.download_weights(record["name"], version)
    return rebuild(record, safetensors.numpy.save(weights))


@pytest.mark.parametrize("transport_format", ["safetensors", "npy", "json"])
def test_kernels_in_every_transport_format_match_the_reference(
    live_server: LiveServer, model: dict[str, Any], transport_format: str
) -> None:
    with Client(live_server.url, api_key=live_server.read_key, transport_format=transport_format) as reader:
        reference = _reference_model(reader, model)
        x1, x2 = sample_inputs(model, 4, seed=1), sample_inputs(model, 3, seed=2)
        for mode in (m.value for m in CONTRACTED_MODES):  # every contracted mode of the table
            result = reader.ntk_result(model["name"], x1, x2, mode=mode)
            assert_close_to_reference(
                result.theta, reference_ntk(reference, torch.from_numpy(x1), torch.from_numpy(x2), mode)
            )
            assert (result.mode, result.model, result.version) == (mode, model["name"], 1)
            assert result.implementation not in ("", "auto") and result.elapsed_ms > 0
        symmetric = reader.ntk(model["name"], x1, params=["layers.1.*"], dtype="float64")
        assert symmetric.dtype == np.float64
        np.testing.assert_array_equal(symmetric, symmetric.transpose(1, 0, 3, 2))
        expected = reference_ntk(reference, torch.from_numpy(x1), None, "full", params=["layers.1.*"])
        assert_close_to_reference(symmetric, expected)


def test_dataset_slices_and_torch_results(client: Client, model: dict[str, Any]) -> None:
    x = sample_inputs(model, 6, seed=4)
    dataset = client.upload_dataset(x, name="client-e2e")
    assert dataset["shape"] == [6, 4] and dataset["dtype"] == "float32"
    assert dataset["id"] in {d["id"] for d in client.list_datasets()}
    assert client.get_dataset(dataset["id"])["name"] == "client-e2e"

    reference = _reference_model(client, model)
    theta = client.ntk(model["name"], {"dataset": dataset["id"], "start": 1, "stop": 4}, x[:2], as_torch=True)
    assert isinstance(theta, torch.Tensor)
    assert_close_to_reference(
        theta.numpy(), reference_ntk(reference, torch.from_numpy(x[1:4]), torch.from_numpy(x[:2]))
    )

    client.delete_dataset(dataset["id"])
    with pytest.raises(errors.DatasetNotFound) as info:
        client.ntk(model["name"], {"dataset": dataset["id"]})
    assert info.value.http_status == 404 and dataset["id"] in info.value.message


def test_weight_versions_round_trip(client: Client, model: dict[str, Any]) -> None:
    weights = client.download_weights(model["name"])
    assert list(weights) and {p["name"] for p in model["parameters"]} == set(weights)
    doubled = {name: 2 * value for name, value in weights.items()}
    record = client.upload_weights(model["name"], doubled)
    assert record["version"] == 2 and record["weights_sha256"] != model["weights_sha256"]
    assert client.get_model(model["name"])["version"] == 2
    for name, value in client.download_weights(model["name"], 2).items():
        np.testing.assert_array_equal(value, doubled[name])
    torch_weights = client.download_weights(model["name"], 1, as_torch=True)
    assert all(isinstance(t, torch.Tensor) for t in torch_weights.values())

    x = sample_inputs(model, 3, seed=5)
    for version in (1, 2):
        theta = client.ntk(model["name"], x, version=version)
        reference = _reference_model(client, model, version)
        assert_close_to_reference(theta, reference_ntk(reference, torch.from_numpy(x)))


def test_model_listing_and_deletion(client: Client, model: dict[str, Any]) -> None:
    assert model["name"] in {m["name"] for m in client.list_models()}
    assert {a["name"] for a in client.architectures()} >= {"mlp", "cnn", "transformer"}
    assert client.health()["status"] == "ok"
    client.delete_model(model["name"])
    with pytest.raises(errors.ModelNotFound) as info:
        client.get_model(model["name"])
    assert info.value.http_status == 404 and model["name"] in info.value.message


def test_service_errors_arrive_as_the_exception_tree(
    live_server: LiveServer, client: Client, model: dict[str, Any]
) -> None:
    with pytest.raises(errors.NameConflict) as conflict:
        client.register_model(model["name"], MLP)
    assert conflict.value.http_status == 409

    with pytest.raises(errors.ShapeMismatch, match=r"per-example shape \(5,\).* expects \(4,\)") as shape:
        client.ntk(model["name"], np.zeros((2, 5), np.float32))
    assert shape.value.http_status == 422

    # The session server plans kernels within 256 MiB and takes bodies up to 2 MiB.
    with pytest.raises(errors.MemoryEstimateExceeded, match="over the memory budget of 256.00 MiB") as memory:
        client.ntk(model["name"], sample_inputs(model, 3000, seed=0))  # theta alone: 3000² · 3² · 4 B ≈ 309 MiB
    assert memory.value.http_status == 413
    assert memory.value.estimate_bytes > memory.value.budget_bytes == 256 * 2**20
    with pytest.raises(errors.PayloadTooLarge, match="exceeds the server's limit of 2.00 MiB") as too_large:
        client.upload_dataset(np.zeros((200_000, 4), np.float32))
    assert too_large.value.http_status == 413

    with pytest.raises(errors.InvalidInput) as bad_spec:
        client.register_model(f"bad-{uuid.uuid4().hex[:6]}", {"family": "mlp", "input_dim": -1})
    assert bad_spec.value.http_status == 422

    with Client(live_server.url, api_key=live_server.read_key) as reader:
        with pytest.raises(errors.PermissionDenied, match="write") as denied:
            reader.delete_model(model["name"])
        assert denied.value.http_status == 403
    with Client(live_server.url, api_key="not-a-key") as stranger, pytest.raises(errors.AuthenticationError):
        stranger.list_models()
    with Client(live_server.url) as anonymous, pytest.raises(errors.AuthenticationError) as missing:
        anonymous.list_models()
    assert missing.value.http_status == 401


def test_json_transport_over_the_cap_points_to_binary(live_server: LiveServer, model: dict[str, Any]) -> None:
    # The session server caps JSON responses at 64 KiB: (50, 50, 3, 3) float32 is over it, binary is not.
    x = sample_inputs(model, 50, seed=6)
    with Client(live_server.url, api_key=live_server.read_key, transport_format="json") as reader:
        with pytest.raises(errors.NotAcceptable, match="application/x-safetensors") as info:
            reader.ntk(model["name"], x)
        assert info.value.http_status == 406
    with Client(live_server.url, api_key=live_server.read_key) as reader:
        assert reader.ntk(model["name"], x).shape == (50, 50, 3, 3)


def test_unreachable_server() -> None:
    with (
        Client("http://127.0.0.1:9", timeout=5) as nobody,
        pytest.raises(errors.ServiceUnavailable, match="cannot reach"),
    ):
        nobody.health()
