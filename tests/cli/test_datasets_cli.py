"""``ntk-service datasets upload`` of named arrays (.npz, .safetensors) against a real server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from typer.testing import CliRunner

from ntk_service import wire
from ntk_service.cli import app
from tests.conftest import LiveServer


def _cli(live_server: LiveServer, *args: str) -> Any:
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.write_key}
    return CliRunner().invoke(app, list(args), env=env)


def test_upload_named_arrays_from_npz_and_safetensors(live_server: LiveServer, tmp_path: Path) -> None:
    ids = np.arange(12, dtype=np.int64).reshape(4, 3)
    mask = np.ones((4, 3), np.int64)
    np.savez(tmp_path / "prompts.npz", input_ids=ids, attention_mask=mask)
    (tmp_path / "prompts.safetensors").write_bytes(wire.encode_safetensors({"input_ids": ids, "attention_mask": mask}))
    for name in ("prompts.npz", "prompts.safetensors"):
        result = _cli(live_server, "datasets", "upload", str(tmp_path / name), "--json")
        assert result.exit_code == 0, result.stderr
        record = json.loads(result.stdout)
        assert record["shape"] == [4] and {a["name"]: a["shape"] for a in record["arrays"]} == {
            "input_ids": [4, 3],
            "attention_mask": [4, 3],
        }
    text = _cli(live_server, "datasets", "upload", str(tmp_path / "prompts.npz"))
    assert text.exit_code == 0 and "4 rows of input_ids [4, 3] int64, attention_mask [4, 3] int64" in text.stdout
    (tmp_path / "x.safetensors").write_bytes(wire.encode_safetensors({"x": ids}))  # tensor x alone: one array
    single = json.loads(_cli(live_server, "datasets", "upload", str(tmp_path / "x.safetensors"), "--json").stdout)
    assert single["shape"] == [4, 3] and "arrays" not in single


def test_upload_refusals(live_server: LiveServer, tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("1 2 3")
    wrong = _cli(live_server, "datasets", "upload", str(tmp_path / "x.txt"))
    assert wrong.exit_code != 0 and "must end in .npy, .npz or .safetensors" in wrong.stderr
    np.savez(tmp_path / "ragged.npz", input_ids=np.zeros((3, 2), np.int64), mask=np.zeros((2, 2), np.int64))
    refused = _cli(live_server, "datasets", "upload", str(tmp_path / "ragged.npz"))
    assert refused.exit_code == 1 and "'input_ids': 3, 'mask': 2" in refused.stderr
