"""float64 inputs to a kernel computed in float32 (no ``dtype="float64"``) are not silent: the response says so
(``note``, with the dtype it was computed in), the client raises a UserWarning and the CLI prints a note line."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ntk_service import wire
from ntk_service.cli import app
from ntk_service.client import Client
from tests.conftest import LiveServer
from tests.server.support import TINY_ARCHITECTURES, tensor_json


@pytest.fixture(scope="module")
def model(live_server: LiveServer) -> str:
    name = f"precision-{uuid.uuid4().hex[:8]}"
    with live_server.client("write") as http:
        response = http.post("/v1/models", json={"name": name, "architecture": TINY_ARCHITECTURES["mlp"]})
        assert response.status_code == 201, response.text
    return name


X64 = np.random.default_rng(0).standard_normal((3, 4))  # float64


def test_the_http_response_says_float64_inputs_were_computed_in_float32(live_server: LiveServer, model: str) -> None:
    with live_server.client("read") as http:
        quiet = http.post(f"/v1/models/{model}/ntk", json={"x1": tensor_json(X64.astype(np.float32))}).json()
        said = http.post(f"/v1/models/{model}/ntk", json={"x1": tensor_json(X64)}).json()
        asked = http.post(f"/v1/models/{model}/ntk", json={"x1": tensor_json(X64), "dtype": "float64"}).json()
        npy = http.post(
            f"/v1/models/{model}/ntk",
            content=wire.encode_npy(X64),
            headers={"Content-Type": wire.MEDIA_NPY, "Accept": wire.MEDIA_NPY},
        )
    assert (quiet["dtype"], quiet.get("note")) == ("float32", None)  # float32 in, float32 out: nothing to say
    assert said["dtype"] == "float32" and said["theta"]["dtype"] == "float32"
    assert said["note"].startswith("x1 was sent as float64 and computed in float32")
    assert 'send dtype="float64" to compute in float64' in said["note"]
    assert (asked["dtype"], asked.get("note"), asked["theta"]["dtype"]) == ("float64", None, "float64")
    assert npy.headers["x-ntk-note"].startswith("x1 was sent as float64")  # binary answers carry it too


def test_the_client_warns_and_the_cli_prints_a_note(live_server: LiveServer, model: str, tmp_path: Path) -> None:
    with Client(live_server.url, api_key=live_server.read_key) as client:
        with pytest.warns(UserWarning, match=r"ntk of '.*': x1 was sent as float64 .* dtype=\"float64\""):
            result = client.ntk_result(model, X64, mode="trace")
        assert result.theta.dtype == np.float32 and result.dtype == "float32" and result.note
        exact = client.ntk_result(model, X64, mode="trace", dtype="float64")  # no warning (filterwarnings=error)
        assert exact.theta.dtype == np.float64 and exact.note is None
        np.testing.assert_allclose(result.theta, exact.theta, rtol=1e-5)
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.read_key}
    x = str(tmp_path / "x.npy")
    np.save(x, X64)
    printed = CliRunner().invoke(app, ["kernel", model, "--x1", x, "--mode", "trace"], env=env)
    assert printed.exit_code == 0, printed.stderr
    assert printed.stderr.startswith("note: x1 was sent as float64 and computed in float32")
    exact_cli = CliRunner().invoke(app, ["kernel", model, "--x1", x, "--mode", "trace", "--dtype", "float64"], env=env)
    assert exact_cli.exit_code == 0 and "note:" not in exact_cli.stderr
