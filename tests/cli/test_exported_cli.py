"""``ntk-service models register-program`` and the commands after it on an exported model, against the real server:
a class saved with ``torch.export.save`` on the user's side, registered from its file, a checkpoint uploaded as
.safetensors, and ``kernel`` of both versions = the float64 reference on the user's module; a hostile archive is
refused with one error line and nothing it carries runs."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from ntk_service.cli import app
from tests.conftest import LiveServer
from tests.reference import assert_matches, reference_ntk
from tests.registry.archives import export_archive, mkdir_payload, rewrite
from tests.registry.exported_models import case
from tests.registry.sequential_models import train_steps


def _cli(live_server: LiveServer, *args: str, key: str = "write") -> Any:
    token = live_server.write_key if key == "write" else live_server.read_key
    return CliRunner().invoke(app, list(args), env={"NTK_URL": live_server.url, "NTK_API_KEY": token})


def _ok(result: Any) -> Any:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result


@pytest.mark.slow
def test_register_program_then_checkpoints_and_kernels_equal_the_reference(
    live_server: LiveServer, tmp_path: Path
) -> None:
    module, example = case("gated_loop")
    epoch0 = copy.deepcopy(module)
    program = tmp_path / "gated.pt2"
    program.write_bytes(export_archive(module, example))  # what torch.export.save writes on the user's machine
    name = f"cli-program-{uuid.uuid4().hex[:6]}"

    out = _ok(_cli(live_server, "models", "register-program", name, str(program), "--label", "epoch 0")).stdout
    assert out.startswith(f"registered {name} version 1 (exported, ")
    assert out.rstrip().endswith(
        f"{sum(p.numel() for p in module.parameters())} parameters, input [5] float32, 2 outputs"
    )
    record = json.loads(_ok(_cli(live_server, "--json", "models", "show", name, key="read")).stdout)
    assert (record["architecture"]["family"], record["label"]) == ("exported", "epoch 0")
    assert [p["name"] for p in record["parameters"]] == [n for n, _ in module.named_parameters()]

    train_steps(module, example, 1, seed=9)  # type: ignore[arg-type]
    checkpoint = tmp_path / "epoch1.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in module.state_dict().items()}, checkpoint)
    _ok(_cli(live_server, "models", "upload-weights", name, str(checkpoint), "--label", "epoch 1"))

    x1, x2 = torch.randn(3, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    np.save(tmp_path / "x1.npy", x1.float().numpy())
    np.save(tmp_path / "x2.npy", x2.float().numpy())
    sides = ("--x1", str(tmp_path / "x1.npy"), "--x2", str(tmp_path / "x2.npy"), "--dtype", "float64")
    for version, local in ((1, epoch0), (2, module)):
        theta = tmp_path / f"theta{version}.npy"
        _ok(_cli(live_server, "kernel", name, *sides, "--version", str(version), "-o", str(theta), key="read"))
        assert_matches(torch.from_numpy(np.load(theta)), reference_ntk(local, x1.float(), x2.float()))
    trace = tmp_path / "trace.npy"
    args = ("kernel", name, *sides, "--mode", "trace", "--params", "gate,blocks.1.*", "-o", str(trace))
    _ok(_cli(live_server, *args, key="read"))
    expected = reference_ntk(module, x1.float(), x2.float(), "trace", ["gate", "blocks.1.weight", "blocks.1.bias"])
    assert_matches(torch.from_numpy(np.load(trace)), expected)

    taken = _cli(live_server, "models", "register-program", name, str(program))
    assert taken.exit_code == 1 and taken.stderr.startswith("error: name_conflict: "), taken.stderr


def test_register_program_refuses_a_hostile_file_and_a_missing_one(live_server: LiveServer, tmp_path: Path) -> None:
    torch.manual_seed(0)
    archive = export_archive(torch.nn.Linear(3, 2), torch.randn(2, 3))
    marker = tmp_path / "ran"

    def pickled(config: Any) -> None:
        config["config"]["weight"]["use_pickle"] = True

    hostile = tmp_path / "hostile.pt2"
    hostile.write_bytes(
        rewrite(
            archive,
            {"data/weights/weight_0": mkdir_payload(marker)},
            edit_json={"data/weights/model_weights_config.json": pickled},
        )
    )
    name = f"cli-hostile-{uuid.uuid4().hex[:6]}"
    refused = _cli(live_server, "models", "register-program", name, str(hostile))
    assert refused.exit_code == 1 and refused.stdout == "", refused.output
    assert refused.stderr.startswith("error: ") and len(refused.stderr.strip().splitlines()) == 1
    assert "weight 'weight' is marked use_pickle" in refused.stderr
    assert not marker.exists()
    assert _cli(live_server, "models", "show", name, key="read").exit_code == 1  # nothing was registered

    missing = _cli(live_server, "models", "register-program", name, str(tmp_path / "absent.pt2"))
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    read_only = _cli(live_server, "models", "register-program", name, str(hostile), key="read")
    assert read_only.exit_code == 1 and read_only.stderr.startswith("error: permission_denied: "), read_only.stderr
