"""Jobs from the Python client and the CLI, as a user would, against the session's real server."""

from __future__ import annotations

import io
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
from ntk_service.errors import JobNotFinished, JobNotFound
from tests.conftest import LiveServer
from tests.jobs.conftest import SLOW_MODEL, TINY_MLP, tiny_model_from_weights
from tests.reference import reference_ntk


@pytest.fixture(scope="module")
def setup(live_server: LiveServer) -> dict[str, Any]:
    """A tiny MLP, a slow model and two data sets (x1 (9, 4), x2 (5, 4)) on the session server."""
    suffix = uuid.uuid4().hex[:8]
    x1 = np.random.default_rng(4).standard_normal((9, 4)).astype(np.float32)
    x2 = np.random.default_rng(5).standard_normal((5, 4)).astype(np.float32)
    with Client(live_server.url, api_key=live_server.write_key) as client:
        client.register_model(f"jobs-tiny-{suffix}", TINY_MLP)
        client.register_model(f"jobs-slow-{suffix}", SLOW_MODEL)
        return {
            "tiny": f"jobs-tiny-{suffix}",
            "slow": f"jobs-slow-{suffix}",
            "x1": x1,
            "x2": x2,
            "x1_id": client.upload_dataset(x1)["id"],
            "x2_id": client.upload_dataset(x2)["id"],
        }


def test_client_submit_wait_and_download_in_every_transport(live_server: LiveServer, setup: dict[str, Any]) -> None:
    with Client(live_server.url, api_key=live_server.write_key) as client:
        job = client.submit_job(
            setup["tiny"], setup["x1_id"], setup["x2_id"], mode="output_diagonal", dtype="float64", tile_size=3
        )
        bar = io.StringIO()
        done = client.wait(job, stream=bar)
        assert done["status"] == "succeeded" and done["tiles_done"] == done["tiles_total"] == 6
        assert bar.getvalue().rstrip().endswith("6/6 tiles 100%  ETA 0s  succeeded")
        weights = client.download_weights(setup["tiny"])
        assert client.cancel_job(job["id"])["status"] == "succeeded"  # a finished job stays as it is
        assert job["id"] in {j["id"] for j in client.list_jobs()}
    model = tiny_model_from_weights(weights)
    expected = reference_ntk(
        model, torch.from_numpy(setup["x1"]), torch.from_numpy(setup["x2"]), mode="output_diagonal"
    ).numpy()
    for transport in ("safetensors", "npy", "json"):
        with Client(live_server.url, api_key=live_server.read_key, transport_format=transport) as reader:
            whole = reader.job_result(job["id"])
            np.testing.assert_allclose(whole, expected, rtol=1e-10, atol=1e-12)
            np.testing.assert_array_equal(
                reader.job_result(job["id"], rows=slice(1, 4), cols=(2, None)), whole[1:4, 2:]
            )


def test_client_errors(live_server: LiveServer, setup: dict[str, Any]) -> None:
    with Client(live_server.url, api_key=live_server.write_key) as client:
        with pytest.raises(JobNotFound):
            client.get_job("no-such-job")
        slow = client.submit_job(setup["slow"], setup["x1_id"], tile_size=1)  # 45 slow tiles
        with pytest.raises(JobNotFinished, match="job_result|is (queued|running)"):
            client.job_result(slow["id"])
        assert client.cancel_job(slow["id"])["status"] == "cancelled"


@pytest.fixture
def cli(live_server: LiveServer) -> Any:
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.write_key}
        result = runner.invoke(app, list(args), env=env)
        assert result.exit_code == 0, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
        return result

    return invoke


def test_cli_submit_watch_status_result_cancel(cli: Any, setup: dict[str, Any], tmp_path: Path) -> None:
    submitted = cli(
        "jobs",
        "submit",
        setup["tiny"],
        "--x1",
        f"dataset:{setup['x1_id']}",
        "--mode",
        "trace",
        "--tile-size",
        "4",
        "--panel-tiles",
        "2",
        "--watch",
    )
    assert "submitted job" in submitted.stdout
    assert "6/6 tiles 100%" in submitted.stderr  # the progress bar goes to stderr
    job_id = submitted.stdout.split("submitted job ")[1].split(":")[0]
    status = json.loads(cli("jobs", "status", job_id, "--json").stdout)
    assert status["status"] == "succeeded" and status["result_shape"] == [9, 9]
    assert status["panel_tiles"] == 2  # 3 row blocks in bands of 2: panels (0-1, 0-1), (0-1, 2), (2, 2)
    listed = json.loads(cli("jobs", "status", "--json").stdout)
    assert job_id in {j["id"] for j in listed}
    out = tmp_path / "theta.npy"
    written = cli("jobs", "result", job_id, "-o", str(out), "--rows", "2:9", "--cols", ":3")
    assert written.stdout.startswith(f"wrote {out}: (7, 3) float32")
    whole = tmp_path / "whole.npy"
    cli("jobs", "result", job_id, "-o", str(whole))
    np.testing.assert_array_equal(np.load(out), np.load(whole)[2:9, :3])
    assert "succeeded" in cli("jobs", "watch", job_id).stdout
    assert cli("jobs", "cancel", job_id).stdout.startswith(f"job {job_id} succeeded at 6/6 tiles")
    deleted = cli("jobs", "delete", job_id, "--keep-record")
    assert deleted.stdout.startswith(f"deleted the result {job_id}: ") and "bytes freed" in deleted.stdout
    assert json.loads(cli("jobs", "status", job_id, "--json").stdout)["result_deleted_at"] is not None
    assert json.loads(cli("jobs", "delete", fresh_id(cli, setup), "--json").stdout)["deleted"] == "job"
    ranged = json.loads(
        cli(
            "jobs", "submit", setup["tiny"], "--x1", f"dataset:{setup['x1_id']}[2:7]", "--mode", "trace", "--json"
        ).stdout
    )
    assert ranged["x1"] == {"dataset": setup["x1_id"], "start": 2, "stop": 7} and ranged["result_shape"] == [5, 5]
    upload = tmp_path / "x.npy"
    np.save(upload, setup["x2"])
    from_file = json.loads(cli("jobs", "submit", setup["tiny"], "--x1", str(upload), "--json").stdout)
    assert from_file["status"] in ("queued", "running", "succeeded") and from_file["result_shape"] == [5, 5, 3, 3]


def fresh_id(cli: Any, setup: dict[str, Any]) -> str:
    """A new finished trace job of the tiny model (through the CLI, watched to the end)."""
    submitted = cli("jobs", "submit", setup["tiny"], "--x1", f"dataset:{setup['x2_id']}", "--mode", "trace", "--watch")
    return str(submitted.stdout.split("submitted job ")[1].split(":")[0])
