"""Per-layer kernels over HTTP (``groups`` on /ntk), from the client and the CLI, against a real server: each
group's kernel against the float64 reference restricted to the group's columns, on the model rebuilt from the
downloaded weights; bad groupings answered 4xx with the usual error body."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ntk_service import wire
from ntk_service.cli import app
from ntk_service.client import Client, GroupKernels
from ntk_service.errors import NoMatchingParameters, OverlappingGroups
from tests.conftest import LiveServer
from tests.reference import reference_columns, reference_jacobian, reference_kernel
from tests.server.support import TINY_ARCHITECTURES, assert_close_to_reference, rebuild, sample_inputs, tensor_json

MODELS = {"groups-mlp": "mlp", "groups-cnn": "cnn"}
MODULES = {
    "groups-mlp": {"layers.0": ["layers.0.weight", "layers.0.bias"], "layers.1": ["layers.1.weight", "layers.1.bias"]},
    "groups-cnn": {"convs.0": ["convs.0.weight", "convs.0.bias"], "head": ["head.weight", "head.bias"]},
}


@pytest.fixture(scope="module")
def registered(live_server: LiveServer) -> dict[str, tuple[dict[str, Any], torch.nn.Module]]:
    out = {}
    with live_server.client("write") as client:
        for name, family in MODELS.items():
            response = client.post(
                "/v1/models", json={"name": name, "architecture": TINY_ARCHITECTURES[family], "seed": 3}
            )
            assert response.status_code == 201, response.text
            record = response.json()
            out[name] = (record, rebuild(record, client.get(f"/v1/models/{name}/versions/1/weights").content))
    return out


def _expected(model: torch.nn.Module, x1: np.ndarray, x2: np.ndarray | None, names: list[str], mode: str) -> Any:
    """The reference kernel of the parameters ``names``: J restricted to their columns."""
    cols = reference_columns(model, names)
    j1 = _jacobian(model, x1)[..., cols]
    return reference_kernel(j1, j1 if x2 is None else _jacobian(model, x2)[..., cols], mode)


_JACOBIANS: dict[tuple[int, bytes], torch.Tensor] = {}


def _jacobian(model: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    """The reference J (n, k, P) of x, computed once per model and input."""
    key = (id(model), x.tobytes())
    if key not in _JACOBIANS:
        _JACOBIANS[key] = reference_jacobian(model, torch.from_numpy(x))
    return _JACOBIANS[key]


def _decode(response: Any) -> tuple[dict[str, np.ndarray], dict[str, list[str]], dict[str, Any]]:
    """(group -> theta, group -> parameters, metadata) from a JSON or safetensors answer."""
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith(wire.MEDIA_SAFETENSORS):
        tensors, meta = wire.decode_safetensors(response.content)
        names = json.loads(meta["groups"])
        assert sorted(names) == sorted(tensors)
        return {n: tensors[n] for n in names}, json.loads(meta["parameters"]), dict(meta)
    body = wire.json_loads(response.content)
    groups = body.pop("groups")
    thetas = {g["name"]: wire.tensor_from_json(g["theta"], name=g["name"]) for g in groups}
    return thetas, {g["name"]: g["parameters"] for g in groups}, body


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("fmt", ["json", "safetensors"])
def test_group_kernels_match_the_reference(live_server: LiveServer, registered: Any, name: str, fmt: str) -> None:
    record, model = registered[name]
    x1, x2 = sample_inputs(record, 3, seed=1), sample_inputs(record, 2, seed=2)
    first = next(iter(MODULES[name]))
    cases: list[tuple[Any, bool, dict[str, list[str]]]] = [
        ("modules", False, MODULES[name]),
        ({"first": [f"{first}.*"]}, True, {"first": MODULES[name][first], "rest": list(MODULES[name].values())[1]}),
    ]
    accept = wire.MEDIA_JSON if fmt == "json" else wire.MEDIA_SAFETENSORS
    with live_server.client("read") as client:
        for groups, rest, members in cases:
            for other in (x2, None):
                for mode in ("full", "trace", "example_diagonal", "output_diagonal", "pseudo"):
                    body: dict[str, Any] = {"x1": tensor_json(x1), "groups": groups, "rest": rest, "mode": mode}
                    if other is not None:
                        body["x2"] = tensor_json(other)
                    response = client.post(f"/v1/models/{name}/ntk", json=body, headers={"Accept": accept})
                    thetas, parameters, meta = _decode(response)
                    assert parameters == members and list(thetas) == list(members)
                    assert meta["mode"] == mode and meta["implementation"] != "auto"
                    for group, theta in thetas.items():
                        assert_close_to_reference(theta, _expected(model, x1, other, members[group], mode))


def test_binary_body_with_groups_in_the_query(live_server: LiveServer, registered: Any) -> None:
    record, model = registered["groups-mlp"]
    x1, x2 = sample_inputs(record, 3, seed=4), sample_inputs(record, 2, seed=5)
    groups = {"weights": ["*.weight"], "biases": ["*.bias"]}
    with live_server.client("read") as client:
        response = client.post(
            "/v1/models/groups-mlp/ntk",
            content=wire.encode_safetensors({"x1": x1, "x2": x2}),
            params={"groups": json.dumps(groups), "mode": "trace", "implementation": "structured"},
            headers={"Content-Type": wire.MEDIA_SAFETENSORS, "Accept": wire.MEDIA_SAFETENSORS},
        )
    thetas, parameters, meta = _decode(response)
    assert parameters == {
        "weights": ["layers.0.weight", "layers.1.weight"],
        "biases": ["layers.0.bias", "layers.1.bias"],
    }
    assert meta["implementation"] == "structured"
    for group, theta in thetas.items():
        assert_close_to_reference(theta, _expected(model, x1, x2, parameters[group], "trace"))


def test_data_set_sides_with_groups(live_server: LiveServer, registered: Any) -> None:
    """x2 from a stored data set (a keyed side in the shared side cache): a plain kernel and a grouped one reuse
    the side, and the groups still match the reference."""
    record, model = registered["groups-mlp"]
    data = sample_inputs(record, 5, seed=11)
    x1 = sample_inputs(record, 2, seed=12)
    with live_server.client("write") as client:
        upload = client.post("/v1/datasets", content=wire.encode_npy(data), headers={"Content-Type": wire.MEDIA_NPY})
        assert upload.status_code == 201, upload.text
        ref = {"dataset": upload.json()["id"], "start": 1, "stop": 4}
        plain = client.post("/v1/models/groups-mlp/ntk", json={"x1": tensor_json(x1), "x2": ref, "mode": "trace"})
        assert plain.status_code == 200, plain.text
        body = {"x1": tensor_json(x1), "x2": ref, "mode": "trace", "groups": "modules"}
        thetas, parameters, _ = _decode(client.post("/v1/models/groups-mlp/ntk", json=body))
    for group, theta in thetas.items():
        assert_close_to_reference(theta, _expected(model, x1, data[1:4], parameters[group], "trace"))
    whole = wire.tensor_from_json(wire.json_loads(plain.content)["theta"], name="theta")
    np.testing.assert_allclose(sum(thetas.values()), whole, rtol=1e-5, atol=1e-6 * float(np.abs(whole).max()))


def _error(response: Any, status: int, error_type: str, fragment: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type and fragment in error["message"], error


def test_bad_groupings_are_answered_4xx(live_server: LiveServer, registered: Any) -> None:
    record, _ = registered["groups-mlp"]
    x = tensor_json(sample_inputs(record, 2, seed=6))
    path = "/v1/models/groups-mlp/ntk"
    with live_server.client("read") as client:

        def post(**body: Any) -> Any:
            return client.post(path, json={"x1": x, **body})

        _error(post(groups={"a": ["layers.0.*"], "b": ["*.bias"]}), 422, "overlapping_groups", "'layers.0.bias'")
        _error(post(groups={"a": ["nope.*"]}), 422, "no_matching_parameters", "glob 'nope.*' of group 'a'")
        _error(post(groups={"a": []}), 422, "no_matching_parameters", "has no globs")
        _error(post(groups={}), 422, "invalid_input", "groups")
        _error(post(groups="layers"), 422, "invalid_input", "groups.modules: Input should be 'modules'")
        _error(post(groups={"a": "layers.0.*"}), 422, "invalid_input", "groups.mapping.a: Input should be a valid list")
        _error(post(groups="modules", params=["layers.0.*"]), 422, "invalid_input", "params and groups")
        _error(post(rest=True), 422, "invalid_input", "rest=true needs groups")
        _error(post(groups="modules", rest=True), 422, "no_matching_parameters", "already in a group")
        _error(post(groups={"__metadata__": ["*"]}), 422, "invalid_input", "reserved")
        _error(
            post(groups="modules", implementation="ntk_vector_products"),
            422,
            "unknown_implementation",
            "cannot split the kernel by group",
        )
        npy = client.post(path, json={"x1": x, "groups": "modules"}, headers={"Accept": wire.MEDIA_NPY})
        _error(npy, 406, "not_acceptable", wire.MEDIA_SAFETENSORS)
        query = client.post(
            path,
            content=wire.encode_npy(sample_inputs(record, 2, seed=6)),
            params={"groups": "{not json"},
            headers={"Content-Type": wire.MEDIA_NPY},
        )
        _error(query, 422, "invalid_input", 'must be "modules" or a JSON object')
        # the G results are refused up front with the estimate: 2 FULL kernels of N = 2400 (k = 3) pass 256 MiB
        big = sample_inputs(record, 2400, seed=7)
        refused = client.post(
            path,
            content=wire.encode_safetensors({"x1": big}),
            params={"groups": "modules"},
            headers={"Content-Type": wire.MEDIA_SAFETENSORS, "Accept": wire.MEDIA_SAFETENSORS},
        )
        _error(refused, 413, "memory_estimate_exceeded", "2 parameter groups")
        assert refused.json()["error"]["estimate_bytes"] >= 2 * 2400 * 2400 * 9 * 4


@pytest.mark.parametrize("transport_format", ["json", "safetensors"])
def test_client_ntk_groups(live_server: LiveServer, registered: Any, transport_format: str) -> None:
    record, model = registered["groups-cnn"]
    x1, x2 = sample_inputs(record, 3, seed=8), sample_inputs(record, 2, seed=9)
    with Client(live_server.url, api_key=live_server.read_key, transport_format=transport_format) as client:  # type: ignore[arg-type]
        res = client.ntk_groups("groups-cnn", x1, x2, groups={"conv": ["convs.*"]}, rest=True, mode="output_diagonal")
        assert isinstance(res, GroupKernels)
        assert res.parameters == {"conv": MODULES["groups-cnn"]["convs.0"], "rest": MODULES["groups-cnn"]["head"]}
        for group, theta in res.thetas.items():
            assert_close_to_reference(theta, _expected(model, x1, x2, res.parameters[group], "output_diagonal"))
        torch_res = client.ntk_groups("groups-cnn", x1, mode="trace", as_torch=True)
        assert list(torch_res.thetas) == ["convs.0", "head"]
        assert all(isinstance(t, torch.Tensor) for t in torch_res.thetas.values())
        whole = _expected(model, x1, None, [n for ns in MODULES["groups-cnn"].values() for n in ns], "trace")
        assert_close_to_reference(torch_res.total().numpy(), whole)
        with pytest.raises(OverlappingGroups, match="is in both group"):
            client.ntk_groups("groups-cnn", x1, groups={"a": ["*"], "b": ["head.*"]})
        with pytest.raises(NoMatchingParameters, match="matches no parameter"):
            client.ntk_groups("groups-cnn", x1, groups={"a": ["layers.*"]})


def test_cli_kernel_groups(live_server: LiveServer, registered: Any, tmp_path: Path) -> None:
    record, model = registered["groups-mlp"]
    x1 = sample_inputs(record, 3, seed=10)
    np.save(tmp_path / "x1.npy", x1)
    runner = CliRunner()
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.read_key}
    out = tmp_path / "groups.safetensors"
    args = ["kernel", "groups-mlp", "--x1", str(tmp_path / "x1.npy"), "--mode", "trace"]
    result = runner.invoke(app, [*args, "--groups", "first=layers.0.*", "--rest", "-o", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert "first" in result.stdout and "rest" in result.stdout
    tensors, meta = wire.decode_safetensors(out.read_bytes())
    parameters = json.loads(meta["parameters"])
    assert parameters == {"first": MODULES["groups-mlp"]["layers.0"], "rest": MODULES["groups-mlp"]["layers.1"]}
    for group, theta in tensors.items():
        assert_close_to_reference(theta, _expected(model, x1, None, parameters[group], "trace"))
    printed = runner.invoke(app, [*args, "--groups", "modules", "--json"], env=env)
    assert printed.exit_code == 0, printed.output
    rows = json.loads(printed.stdout)["groups"]
    assert [row["group"] for row in rows] == ["layers.0", "layers.1"]
    theta = wire.tensor_from_json(rows[1]["theta"], name="theta")
    assert_close_to_reference(theta, _expected(model, x1, None, MODULES["groups-mlp"]["layers.1"], "trace"))
    for bad, message in (
        (["--groups", "nameonly"], "is not NAME=GLOB"),
        (["--groups", "modules", "--params", "layers.0.*"], "--params and --groups"),
        (["--rest"], "--rest needs --groups"),
    ):
        failed = runner.invoke(app, [*args, *bad], env=env)
        assert failed.exit_code != 0 and message in failed.output, failed.output
