"""``ntk-service models versions`` and ``models download-weights`` (and ``--label``) against the real server."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
from typer.testing import CliRunner

from ntk_service.cli import app
from tests.conftest import SLOW_FACTORY, LiveServer
from tests.server.support import TINY_ARCHITECTURES


def _run(live_server: LiveServer, *args: str) -> Any:
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.write_key}
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result


def test_architectures_show_layer_types_and_allowed_factories(live_server: LiveServer) -> None:
    out = _run(live_server, "models", "architectures").stdout
    assert "\nsequential: " in out and "  layer Conv2d(in_channels, out_channels, kernel_size, " in out
    assert f"  allowed on this server: {SLOW_FACTORY}\n" in out


def test_versions_and_download_weights(live_server: LiveServer, tmp_path: Path) -> None:
    name = f"cli-versions-{uuid.uuid4().hex[:8]}"
    spec = json.dumps(TINY_ARCHITECTURES["mlp"])
    _run(live_server, "models", "register", name, "-a", spec, "--label", "init")
    record = json.loads(_run(live_server, "models", "show", name, "--json").stdout)
    weights = {p["name"]: np.full(p["shape"], 0.25, np.float32) for p in record["parameters"]}
    upload = tmp_path / "epoch1.safetensors"
    upload.write_bytes(safetensors.numpy.save(weights))
    _run(live_server, "models", "upload-weights", name, str(upload), "--label", "epoch 1")

    table = _run(live_server, "models", "versions", name).stdout.splitlines()
    assert table[0].split() == ["VERSION", "CREATED_AT", "LABEL", "SEED", "WEIGHTS_SHA256"]
    assert table[1].split()[0] == "1" and " init " in table[1] and table[1].split()[3] == "0"
    assert table[2].split()[0] == "2" and " epoch 1 " in table[2] and table[2].split()[4] == "-"
    listed = json.loads(_run(live_server, "--json", "models", "versions", name).stdout)
    assert [(v["version"], v["label"]) for v in listed] == [(1, "init"), (2, "epoch 1")]

    latest = tmp_path / "latest.safetensors"
    out = _run(live_server, "models", "download-weights", name, "-o", str(latest)).stdout
    assert out.strip() == f"wrote 4 tensors of {name} version 2 to {latest}"
    assert {k: v.tolist() for k, v in safetensors.numpy.load_file(latest).items()} == {
        k: v.tolist() for k, v in weights.items()
    }
    first = tmp_path / "first.safetensors"
    summary = json.loads(
        _run(live_server, "models", "download-weights", name, "-o", str(first), "--version", "1", "--json").stdout
    )
    assert summary["version"] == 1
    assert not np.array_equal(safetensors.numpy.load_file(first)["layers.0.weight"], weights["layers.0.weight"])
