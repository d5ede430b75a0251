"""``ntk-service solve`` and ``ntk-service features`` used as a user would (CliRunner against the real server): the
written predictions equal a dense solve on the float64 reference kernel; a cut solve exits 1 after writing."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.client import Client
from tests.conftest import LiveServer
from tests.jobs.conftest import TINY_MLP, tiny_model_from_weights
from tests.reference import reference_ntk

N, M, K = 8, 3, 3


@pytest.fixture
def cli(live_server: LiveServer) -> Any:
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.write_key}
        return runner.invoke(app, list(args), env=env)

    return invoke


def _ok(result: Any) -> Any:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result


def test_solve_and_features_commands(cli: Any, live_server: LiveServer, tmp_path: Path) -> None:
    name = f"cli-solve-{uuid.uuid4().hex[:8]}"
    _ok(cli("models", "register", name, "--architecture", json.dumps(TINY_MLP), "--seed", "2"))
    rng = np.random.default_rng(5)
    x, y, t = rng.standard_normal((N, 4)).astype(np.float32), rng.standard_normal((N, K)), rng.standard_normal((M, 4))
    for label, array in (("x", x), ("y", y), ("t", t.astype(np.float32))):
        np.save(tmp_path / f"{label}.npy", array)
    files = {label: str(tmp_path / f"{label}.npy") for label in ("x", "y", "t")}
    common = ["--train", files["x"], "--targets", files["y"], "--ridge", "0.01"]

    submitted = _ok(cli("solve", "submit", name, "--kind", "kernel_ridge", *common, "--test", files["t"], "--watch"))
    job_id = submitted.stdout.split()[3]
    assert "it " in submitted.stderr and "residual" in submitted.stderr  # progress lines while it ran
    out = tmp_path / "solve.npz"
    _ok(cli("solve", "result", job_id, "-o", str(out)))
    with Client(live_server.url, api_key=live_server.write_key) as client:
        model = tiny_model_from_weights(client.download_weights(name)).double()
    xt, tt = torch.from_numpy(x).double(), torch.from_numpy(t.astype(np.float32)).double()
    a = reference_ntk(model, xt, mode="full").numpy().transpose(0, 2, 1, 3).reshape(N * K, N * K)
    b = reference_ntk(model, tt, xt, mode="full").numpy().transpose(0, 2, 1, 3).reshape(M * K, N * K)
    expected = (b @ np.linalg.solve(a + 0.01 * np.eye(N * K), y.reshape(-1))).reshape(M, K)
    with np.load(out) as saved:
        np.testing.assert_allclose(saved["predictions"], expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())

    cut = _ok(cli("solve", "submit", name, "--kind", "gp_mean", *common, "--solver", "pcg", "--max-iterations", "1",
                  "--watch"))  # fmt: skip
    failed = cli("solve", "result", cut.stdout.split()[3], "-o", str(tmp_path / "cut.npz"))
    assert failed.exit_code == 1 and "did not converge (max_iterations)" in failed.stderr
    assert (tmp_path / "cut.npz").exists()  # written anyway: the user decides

    features = _ok(cli("features", "submit", name, "--dataset", files["x"], "--dim", "16", "--seed", "3", "--watch"))
    features_id = features.stdout.split()[3]
    _ok(cli("features", "result", features_id, "-o", str(tmp_path / "phi.npy"), "--rows", "2:5"))
    assert np.load(tmp_path / "phi.npy").shape == (3, K, 16)
    _ok(cli("features", "kernel", features_id, "-o", str(tmp_path / "theta.npy"), "--mode", "trace"))
    assert np.load(tmp_path / "theta.npy").shape == (N, N)
    bad = cli("features", "submit", name, "--dataset", files["x"], "--dim", "0")
    assert bad.exit_code == 1 and "dim" in bad.stderr

    # a finished job is deleted with its files; its status is then a 404 (exit 1 with the message)
    deleted = _ok(cli("solve", "delete", job_id, "--json"))
    assert json.loads(deleted.stdout)["deleted"] == "job" and json.loads(deleted.stdout)["freed_bytes"] > 0
    missing = cli("solve", "status", job_id)
    assert missing.exit_code == 1 and "no solve job" in missing.stderr
    assert json.loads(_ok(cli("features", "delete", features_id, "--json")).stdout)["id"] == features_id
