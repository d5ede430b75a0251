"""Results that open anywhere: a job's Zarr group downloaded over a real server into a folder that is not the
server's data directory, opened with xarray, with the dimension names, the attributes and (for a symmetric
result) the mirror of every tile below the diagonal; the job record says where the group lies on the server."""

from __future__ import annotations

import uuid
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xarray as xr
import zarr
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.client import Client
from tests.conftest import LiveServer
from tests.jobs.conftest import TINY_MLP, tiny_model_from_weights
from tests.reference import reference_ntk


@pytest.fixture(scope="module")
def jobs(live_server: LiveServer) -> dict[str, Any]:
    """A symmetric float64 full job (x1 (10, 4), tiles of 4: 6 of 9 tiles stored) and a trace job x1 × x2."""
    name = f"zarr-{uuid.uuid4().hex[:8]}"
    x1 = np.random.default_rng(1).standard_normal((10, 4)).astype(np.float32)
    x2 = np.random.default_rng(2).standard_normal((7, 4)).astype(np.float32)
    with Client(live_server.url, api_key=live_server.write_key) as client:
        client.register_model(name, TINY_MLP)
        x1_id, x2_id = client.upload_dataset(x1)["id"], client.upload_dataset(x2)["id"]
        full = client.submit_job(name, x1_id, mode="full", dtype="float64", tile_size=4)
        trace = client.submit_job(name, x1_id, x2_id, mode="trace", tile_size=4)
        return {
            "name": name,
            "x1": x1,
            "x2": x2,
            "full": client.wait(full, progress=False),
            "trace": client.wait(trace, progress=False),
            "weights": client.download_weights(name),
        }


def test_a_symmetric_full_result_opens_with_xarray_away_from_the_server(
    live_server: LiveServer, jobs: dict[str, Any], tmp_path: Path
) -> None:
    job = jobs["full"]
    here = tmp_path / "laptop"
    here.mkdir()
    assert not here.resolve().is_relative_to(live_server.data_dir.resolve())
    with Client(live_server.url, api_key=live_server.read_key) as client:
        theta = client.result_array(job).to_xarray(here / "full.zarr.zip")
        served = client.job_result(job["id"])  # the server's own mirroring, over .npy
    assert sorted(p.name for p in here.iterdir()) == ["full.zarr.zip"]  # no .part, nothing extracted

    assert theta.name == "theta" and theta.dims == ("x1", "x2", "out1", "out2") and theta.shape == (10, 10, 3, 3)
    assert theta.attrs["model"] == jobs["name"] and theta.attrs["version"] == 1
    assert (theta.attrs["mode"], theta.attrs["dtype"], theta.attrs["symmetric"]) == ("full", "float64", True)
    assert theta.attrs["x1_rows"] == [0, 10] and theta.attrs["job_id"] == job["id"]
    values = theta.values
    np.testing.assert_array_equal(values, served)
    np.testing.assert_array_equal(values, values.transpose(1, 0, 3, 2))  # every lower tile is its mirror
    model = tiny_model_from_weights(jobs["weights"])
    x = torch.from_numpy(jobs["x1"])
    np.testing.assert_allclose(values, reference_ntk(model, x, x, mode="full").numpy(), rtol=1e-10, atol=1e-12)

    # Plain xarray on the file: the same group as on the server's disk (dims and attributes; zeros below the
    # diagonal tiles of a symmetric result, as there).
    plain = xr.open_zarr(zarr.storage.ZipStore(here / "full.zarr.zip", mode="r"))
    assert plain["theta"].dims == theta.dims and plain.attrs["weights_sha256"] == theta.attrs["weights_sha256"]
    np.testing.assert_array_equal(plain["theta"].values[:4, :], values[:4, :])  # the first row band is stored
    assert not plain["theta"].values[8:, :4].any()  # the tile (2, 0) is not: its mirror (0, 2) is
    group = Path(job["result_path"])
    assert group.is_dir() and group.resolve().is_relative_to(live_server.data_dir.resolve())
    with zipfile.ZipFile(here / "full.zarr.zip") as archive:
        on_disk = sorted(p.relative_to(group).as_posix() for p in group.rglob("*") if p.is_file())
        assert sorted(archive.namelist()) == on_disk
        assert all(archive.read(name) == (group / name).read_bytes() for name in on_disk)
        assert all(info.compress_type == zipfile.ZIP_STORED for info in archive.infolist())


def test_a_rectangular_trace_result_and_the_cli_download(
    live_server: LiveServer, jobs: dict[str, Any], tmp_path: Path
) -> None:
    job = jobs["trace"]
    out = tmp_path / "trace.zarr.zip"
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.read_key}
    result = CliRunner().invoke(app, ["jobs", "result", job["id"], "-o", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"wrote {out}: the Zarr group of (10, 7) float32"
    with Client(live_server.url, api_key=live_server.read_key) as client:
        served = client.job_result(job["id"])
        again = client.result_array(job).to_xarray(tmp_path / "again.zip")
    plain = xr.open_zarr(zarr.storage.ZipStore(out, mode="r"))
    assert plain["theta"].dims == ("x1", "x2") and plain.attrs["symmetric"] is False
    np.testing.assert_array_equal(plain["theta"].values, served)  # nothing to mirror: every tile is stored
    np.testing.assert_array_equal(again.values, served)
    refused = CliRunner().invoke(app, ["jobs", "result", job["id"], "-o", str(out), "--rows", "0:2"], env=env)
    assert refused.exit_code == 2 and "a .zip download is the whole Zarr group" in refused.stderr
