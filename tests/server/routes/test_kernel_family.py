"""The kernel family over HTTP against a real server: /ntk with mode pseudo, /nngp, /monte_carlo and
/operator/matvec, checked against the float64 reference (or features written out) on the model rebuilt from the
downloaded weights, and their bad inputs answered with clear 4xx errors."""

from __future__ import annotations

import typing
from typing import Any

import numpy as np
import pytest
import torch

from ntk_service import wire
from ntk_service.kernels import DerivedMode, KernelMode
from ntk_service.registry.zoo import build_model
from ntk_service.server.schemas import KernelModeValue
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server.support import (
    TINY_ARCHITECTURES,
    assert_close_to_reference,
    decode_theta,
    rebuild,
    request_kernel,
    sample_inputs,
    tensor_json,
)

NAME = "family-mlp"


def test_the_wire_modes_are_exactly_the_engine_modes() -> None:
    values = [*KernelMode, *DerivedMode]
    assert list(typing.get_args(KernelModeValue)) == [m.value for m in values]


@pytest.fixture(scope="module")
def registered(live_server: LiveServer) -> tuple[dict[str, Any], torch.nn.Module]:
    with live_server.client("write") as client:
        response = client.post("/v1/models", json={"name": NAME, "architecture": TINY_ARCHITECTURES["mlp"], "seed": 5})
        assert response.status_code == 201, response.text
        record = response.json()
        weights = client.get(f"/v1/models/{NAME}/versions/1/weights").content
    return record, rebuild(record, weights)


def _decode(response: Any, *names: str) -> tuple[list[np.ndarray | None], dict[str, Any]]:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith(wire.MEDIA_SAFETENSORS):
        tensors, meta = wire.decode_safetensors(response.content)
        return [tensors.get(n) for n in names], dict(meta)
    body = wire.json_loads(response.content)
    arrays = [None if body[n] is None else wire.tensor_from_json(body.pop(n), name=n) for n in names]
    return arrays, body


@pytest.mark.parametrize("fmt", ["json", "safetensors"])
def test_ntk_mode_pseudo_matches_the_reference(live_server: LiveServer, registered: Any, fmt: str) -> None:
    record, model = registered
    x1, x2 = sample_inputs(record, 3, seed=1), sample_inputs(record, 2, seed=2)
    with live_server.client("read") as client:
        for other in (x2, None):
            theta, meta = decode_theta(request_kernel(client, NAME, x1, other, fmt=fmt, mode="pseudo"))
            expected = reference_ntk(model, torch.from_numpy(x1), None if other is None else torch.from_numpy(other))
            assert_close_to_reference(theta, expected.sum(dim=(2, 3)) / expected.shape[2])
            assert meta["mode"] == "pseudo"


def _features(model: torch.nn.Module, x: np.ndarray, layer: str | None) -> torch.Tensor:
    with torch.no_grad():
        xt = torch.from_numpy(x).double()
        m = model.double()
        return m(xt) if layer is None else torch.tanh(m.layers[0](xt))


@pytest.mark.parametrize("accept", [wire.MEDIA_JSON, wire.MEDIA_SAFETENSORS])
def test_nngp_of_outputs_and_of_a_layer(live_server: LiveServer, registered: Any, accept: str) -> None:
    record, model = registered
    x1, x2 = sample_inputs(record, 3, seed=3), sample_inputs(record, 4, seed=4)
    with live_server.client("read") as client:
        for layer, mode in ((None, "full"), ("activation", "trace")):
            body = {"x1": tensor_json(x1), "x2": tensor_json(x2), "layer": layer, "mode": mode, "dtype": "float64"}
            response = client.post(f"/v1/models/{NAME}/nngp", json=body, headers={"Accept": accept})
            (kernel,), meta = _decode(response, "kernel")
            f1, f2 = _features(model, x1, layer), _features(model, x2, layer)
            expected = torch.einsum("na,mb->nmab", f1, f2) if mode == "full" else f1 @ f2.T
            np.testing.assert_allclose(kernel, expected.numpy(), rtol=1e-6, atol=1e-7)
            assert meta["mode"] == mode and int(meta["features"]) == (3 if layer is None else 8)


def test_monte_carlo_mean_is_the_average_over_the_architecture_built_per_seed(
    live_server: LiveServer, registered: Any
) -> None:
    record, _ = registered
    x1 = sample_inputs(record, 3, seed=5)
    seeds = [11, 12, 13]
    body = {"x1": tensor_json(x1), "seeds": seeds, "mode": "trace", "dtype": "float64"}
    with live_server.client("read") as client:
        (mean, stderr), meta = _decode(client.post(f"/v1/models/{NAME}/monte_carlo", json=body), "mean", "stderr")
    models = [build_model(record["architecture"], s)[0] for s in seeds]
    samples = torch.stack([reference_ntk(m, torch.from_numpy(x1), None, "trace") for m in models])
    np.testing.assert_allclose(mean, samples.mean(0).numpy(), rtol=1e-6)
    np.testing.assert_allclose(stderr, (samples.std(0) / np.sqrt(3)).numpy(), rtol=1e-5, atol=1e-9)
    assert meta["n_samples"] == 3 and meta["kernel"] == "ntk"


def test_monte_carlo_takes_a_version_as_the_other_routes_do(live_server: LiveServer, registered: Any) -> None:
    """``version`` names the version whose architecture is built (as /ntk and /nngp name the one computed on); the
    answer says which, and a version that does not exist is a 404 before anything is built."""
    record, _ = registered
    x1 = sample_inputs(record, 2, seed=15)
    body = {"x1": tensor_json(x1), "seeds": [3, 4], "mode": "trace", "dtype": "float64"}
    with live_server.client("read") as client:
        (mean, _), meta = _decode(
            client.post(f"/v1/models/{NAME}/monte_carlo", json={**body, "version": 1}), "mean", "stderr"
        )
        (latest, _), latest_meta = _decode(client.post(f"/v1/models/{NAME}/monte_carlo", json=body), "mean", "stderr")
        missing = client.post(f"/v1/models/{NAME}/monte_carlo", json={**body, "version": 99})
    models = [build_model(record["architecture"], s)[0] for s in (3, 4)]
    expected = torch.stack([reference_ntk(m, torch.from_numpy(x1), None, "trace") for m in models]).mean(0)
    np.testing.assert_allclose(mean, expected.numpy(), rtol=1e-6)
    assert meta["version"] == 1 and latest_meta["version"] == record["version"]
    np.testing.assert_allclose(latest, mean, rtol=1e-12)  # one architecture for every version of a model
    assert missing.status_code == 404, missing.text
    assert missing.json()["error"]["type"] == "model_not_found"


def test_operator_matvec_matches_the_reference_kernel_times_v(live_server: LiveServer, registered: Any) -> None:
    record, model = registered
    x1, x2 = sample_inputs(record, 4, seed=6), sample_inputs(record, 3, seed=7)
    full = reference_ntk(model, torch.from_numpy(x1), torch.from_numpy(x2), "full")
    dense = full.permute(0, 2, 1, 3).reshape(12, 9).numpy()
    v, w = np.random.default_rng(0).standard_normal((3, 3)), np.random.default_rng(1).standard_normal((4, 3))
    with live_server.client("read") as client:
        path = f"/v1/models/{NAME}/operator/matvec"
        base = {"x1": tensor_json(x1), "x2": tensor_json(x2), "dtype": "float64"}
        (product,), meta = _decode(client.post(path, json={**base, "v": tensor_json(v)}), "product")
        np.testing.assert_allclose(product, (dense @ v.reshape(-1)).reshape(4, 3), rtol=1e-9)
        (back,), _ = _decode(client.post(path, json={**base, "v": tensor_json(w), "transpose": True}), "product")
        np.testing.assert_allclose(back, (dense.T @ w.reshape(-1)).reshape(3, 3), rtol=1e-9)
        trace = reference_ntk(model, torch.from_numpy(x1), torch.from_numpy(x2), "trace").numpy()
        body = {**base, "v": tensor_json(v[:, 0].copy()), "mode": "trace"}
        (product,), _ = _decode(client.post(path, json=body), "product")
        np.testing.assert_allclose(product, trace @ v[:, 0], rtol=1e-9)
    assert meta["mode"] == "full"


def test_bad_inputs_get_clear_4xx_answers(live_server: LiveServer, registered: Any) -> None:
    record, _ = registered
    x1 = tensor_json(sample_inputs(record, 3, seed=8))
    cases = [
        ("nngp", {"x1": x1, "layer": "head"}, 422, "unknown_layer", "layer 'head' is not a module"),
        ("monte_carlo", {"x1": x1, "seeds": []}, 422, "invalid_input", "seeds is empty"),
        ("monte_carlo", {"x1": x1, "seeds": list(range(1025))}, 422, "invalid_input", "over the limit of 1024"),
        ("monte_carlo", {"x1": x1, "seeds": [1, 1]}, 422, "invalid_input", "seed 1 is repeated"),
        ("monte_carlo", {"x1": x1, "seeds": [True, 2]}, 422, "invalid_input", "seeds.0: Input should be a valid int"),
        ("monte_carlo", {"x1": x1, "seeds": ["7"]}, 422, "invalid_input", "seeds.0: Input should be a valid int"),
        ("monte_carlo", {"x1": x1, "seeds": [2.0]}, 422, "invalid_input", "seeds.0: Input should be a valid int"),
        ("monte_carlo", {"x1": x1, "seeds": [2**70]}, 422, "invalid_input", "seeds.0"),
        (
            "monte_carlo",
            {"x1": x1, "seeds": [2**63]},
            422,
            "invalid_input",
            "seeds.0: Input should be less than or equal to " + str(2**63 - 1),
        ),
        ("operator/matvec", {"x1": x1, "v": tensor_json(np.zeros((2, 3)))}, 422, "shape_mismatch", "expected"),
        ("operator/matvec", {"x1": x1}, 422, "invalid_input", "the body needs v"),
        (
            "operator/matvec",
            {"x1": x1, "v": tensor_json(np.zeros(3)), "mode": "output_diagonal"},
            422,
            "invalid_input",
            "mode",
        ),
    ]
    with live_server.client("read") as client:
        for route, body, status, error_type, message in cases:
            response = client.post(f"/v1/models/{NAME}/{route}", json=body)
            assert response.status_code == status, (route, response.text)
            error = response.json()["error"]
            assert error["type"] == error_type and message in error["message"], (route, error)
        response = client.post(f"/v1/models/{NAME}/nngp", content=b"x", headers={"Content-Type": "text/plain"})
        assert response.status_code == 415
