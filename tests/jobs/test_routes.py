"""Jobs over HTTP against real uvicorn processes: submit, progress events, downloads in every format, cancel,
disk budget, and a server killed with SIGKILL mid-job that resumes to a bitwise-equal result."""

from __future__ import annotations

import io
import json
import sqlite3
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy
import torch
import xarray as xr
from torch import nn

from ntk_service.client import Client
from ntk_service.errors import JobNotFound, NtkServiceError, ServiceUnavailable
from ntk_service.results import open_result
from ntk_service.server.routes.jobs import stream_pieces
from tests.conftest import LiveServer, start_live_server
from tests.jobs.conftest import SLOW_MODEL, TINY_MLP, tiny_model_from_weights
from tests.reference import reference_ntk

NPY = "application/x-npy"
SAFETENSORS = "application/x-safetensors"


_SERVER_SETTINGS = {
    "max_json_response_bytes": str(64 * 2**10),
    "max_binary_response_bytes": str(4096),
    "job_disk_budget_bytes": str(2**20),
    "memory_budget_bytes": str(64 * 2**20),
    "job_stream_block_bytes": str(400),
}
"""64 KiB JSON cap, 4 KiB cap on binary answers built in one piece, 1 MiB disk budget for all job results, streamed
downloads in reads of at most 400 bytes (a row of the FULL float64 job is 720 bytes: it goes in pieces of a row)."""


class _Servers:
    """The module's server; the SIGKILL test (last in this file) replaces it with a restarted one."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.current = start_live_server(data_dir, **_SERVER_SETTINGS)

    def kill(self) -> None:
        self.current.process.kill()  # SIGKILL: no shutdown code runs
        self.current.process.wait(10)

    def restart(self) -> LiveServer:
        self.current = start_live_server(self.data_dir, **_SERVER_SETTINGS)
        return self.current


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Servers]:
    holder = _Servers(tmp_path_factory.mktemp("jobs") / "data")
    yield holder
    holder.current.stop()


@pytest.fixture
def server(servers: _Servers) -> LiveServer:
    return servers.current


def _upload(client: httpx.Client, array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    response = client.post("/v1/datasets", content=buffer.getvalue(), headers={"Content-Type": NPY})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _register(client: httpx.Client, name: str, architecture: dict[str, Any]) -> None:
    response = client.post("/v1/models", json={"name": name, "architecture": architecture, "seed": 0})
    assert response.status_code == 201, response.text


def _wait(client: httpx.Client, job_id: str, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return dict(job)
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} not finished after {timeout} s")


def _wait_for_tiles(client: httpx.Client, job_id: str, tiles: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (job := client.get(f"/v1/jobs/{job_id}").json())["tiles_done"] < tiles:
        assert job["status"] in ("queued", "running"), job
        assert time.monotonic() < deadline, f"job {job_id} has not reached {tiles} tiles after {timeout} s: {job}"
        time.sleep(0.02)


def _npy(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == NPY
    return np.load(io.BytesIO(response.content), allow_pickle=False)


def _tiny_model(client: httpx.Client) -> nn.Module:
    """The registered 'tiny' model rebuilt here from its downloaded weights (for the reference)."""
    return tiny_model_from_weights(safetensors.numpy.load(client.get("/v1/models/tiny/versions/1/weights").content))


@pytest.fixture(scope="module")
def tiny_job(servers: _Servers) -> dict[str, Any]:
    """A finished symmetric FULL float64 job of 'tiny' on x1 (10, 4), tiles of 4 (6 of 9 tiles)."""
    with servers.current.client() as client:
        _register(client, "tiny", TINY_MLP)
        x1 = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
        dataset = _upload(client, x1)
        response = client.post(
            "/v1/jobs",
            json={"model": "tiny", "x1": {"dataset": dataset}, "mode": "full", "dtype": "float64", "tile_size": 4},
        )
        assert response.status_code == 202, response.text
        assert response.headers["location"] == f"/v1/jobs/{response.json()['id']}"
        job = _wait(client, response.json()["id"])
        return {**job, "x1_array": x1, "model": _tiny_model(client)}


def test_job_result_in_every_format_and_slice(server: LiveServer, tiny_job: dict[str, Any]) -> None:
    assert tiny_job["status"] == "succeeded", tiny_job["error"]
    assert (tiny_job["tiles_done"], tiny_job["tiles_total"], tiny_job["result_shape"]) == (6, 6, [10, 10, 3, 3])
    expected = reference_ntk(tiny_job["model"], torch.from_numpy(tiny_job["x1_array"]), mode="full").numpy()
    url = f"/v1/jobs/{tiny_job['id']}/result"
    with server.client("read") as client:
        whole = _npy(client.get(url, headers={"Accept": NPY}))
        np.testing.assert_allclose(whole, expected, rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(whole, whole.transpose(1, 0, 3, 2))  # exactly symmetric
        block = _npy(client.get(url, params={"rows": "7:10", "cols": ":5"}, headers={"Accept": NPY}))
        np.testing.assert_array_equal(block, whole[7:10, 0:5])  # below the diagonal: mirrored tiles
        response = client.get(url, params={"rows": "2:9", "cols": "3:"}, headers={"Accept": SAFETENSORS})
        assert response.status_code == 200 and response.headers["content-type"] == SAFETENSORS
        np.testing.assert_array_equal(safetensors.numpy.load(response.content)["theta"], whole[2:9, 3:])
        body = client.get(url, params={"rows": "0:2", "cols": "8:10"}).json()  # JSON by default
        assert body["theta"]["shape"] == [2, 2, 3, 3] and body["mode"] == "full" and body["version"] == 1
        theta = np.asarray(body["theta"]["data"], dtype=np.float64).reshape(body["theta"]["shape"])
        np.testing.assert_array_equal(theta, whole[0:2, 8:10])


def test_result_errors(server: LiveServer, tiny_job: dict[str, Any]) -> None:
    url = f"/v1/jobs/{tiny_job['id']}/result"
    with server.client("read") as client:
        bad = client.get(url, params={"rows": "5:11"})
        assert bad.status_code == 422
        assert "expected 0 ≤ a < b ≤ 10" in bad.json()["error"]["message"]
        missing = client.get("/v1/jobs/0123/result")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "job_not_found"
        assert client.get(url, headers={"Accept": "text/csv"}).status_code == 406
    with server.client(None) as anonymous:  # no key: 401, whether or not the job exists
        assert anonymous.get(f"/v1/jobs/{tiny_job['id']}").status_code == 401
        assert anonymous.get("/v1/jobs/0123/events").status_code == 401


def test_submission_errors(server: LiveServer, tiny_job: dict[str, Any]) -> None:
    with server.client() as client:
        dataset = tiny_job["x1"]["dataset"]
        too_big = client.post(
            "/v1/jobs",
            json={"model": "tiny", "x1": {"dataset": _upload(client, np.zeros((200, 4), np.float32))}, "mode": "full"},
        )
        assert too_big.status_code == 413
        error = too_big.json()["error"]
        assert error["type"] == "disk_estimate_exceeded" and "needs 1.37 MiB on disk" in error["message"]
        unknown = client.post("/v1/jobs", json={"model": "tiny", "x1": {"dataset": dataset}, "mode": "diag"})
        assert unknown.status_code == 422
        wrong_shape = _upload(client, np.zeros((3, 5), np.float32))
        shape = client.post("/v1/jobs", json={"model": "tiny", "x1": {"dataset": wrong_shape}})
        assert shape.status_code == 422 and "per-example shape (5,)" in shape.json()["error"]["message"]
        assert client.post("/v1/jobs", json={"model": "nope", "x1": {"dataset": dataset}}).status_code == 404
    with server.client("read") as reader:
        denied = reader.post("/v1/jobs", json={"model": "tiny", "x1": {"dataset": dataset}})
        assert denied.status_code == 403
        listed = reader.get("/v1/jobs").json()
        assert listed["count"] == len(listed["data"]) >= 1


def _events(client: httpx.Client, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    name = ""
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_events_stream_progress_until_the_end(server: LiveServer) -> None:
    with server.client() as client:
        # Only a tile that meets a new row block runs the (sleeping) forward: the engine keeps the prepared model and
        # the job's side cache the sides. 0.5 s per forward spaces those tiles over several polls (EVENT_POLL_S).
        slower = {**SLOW_MODEL, "kwargs": {**SLOW_MODEL["kwargs"], "delay_s": 0.5}}  # type: ignore[dict-item]
        _register(client, "slow-sse", slower)
        dataset = _upload(client, np.random.default_rng(1).standard_normal((12, 4)).astype(np.float32))
        job = client.post(
            "/v1/jobs",
            json={"model": "slow-sse", "x1": {"dataset": dataset}, "mode": "trace", "tile_size": 3, "panel_tiles": 1},
        ).json()
        events = _events(client, job["id"])
    names = [name for name, _ in events]
    done = [data["tiles_done"] for _, data in events]
    assert names[-1] == "end" and set(names[:-1]) == {"progress"}
    assert events[-1][1]["status"] == "succeeded" and done[-1] == 10
    assert done == sorted(done) and len(set(done)) >= 5  # several progress steps were streamed
    assert any(data["eta_s"] is not None for _, data in events[:-1])
    assert events[-1][1]["eta_s"] == 0.0


def test_cancel_over_http(server: LiveServer, tiny_job: dict[str, Any]) -> None:
    with server.client() as client:
        _register(client, "slow-cancel", SLOW_MODEL)
        dataset = _upload(client, np.random.default_rng(2).standard_normal((40, 4)).astype(np.float32))
        spec = {"model": "slow-cancel", "x1": {"dataset": dataset}, "tile_size": 2, "panel_tiles": 1}
        job = client.post("/v1/jobs", json=spec).json()
        _wait_for_tiles(client, job["id"], 1)
        # The job takes the compute slot one tile at a time, so an interactive kernel still gets its turn.
        kernel = client.post("/v1/models/tiny/ntk", json={"x1": {"dataset": tiny_job["x1"]["dataset"], "stop": 2}})
        assert kernel.status_code == 200, kernel.text
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"
        cancelled = client.delete(f"/v1/jobs/{job['id']}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        time.sleep(0.5)
        final = client.get(f"/v1/jobs/{job['id']}").json()
        assert final["status"] == "cancelled" and final["tiles_done"] < final["tiles_total"] == 210
        later = client.get(f"/v1/jobs/{job['id']}").json()
        assert later["tiles_done"] == final["tiles_done"]  # nothing runs after the boundary
        result = client.get(f"/v1/jobs/{job['id']}/result")
        assert result.status_code == 409 and result.json()["error"]["type"] == "job_not_finished"


SLICES = {
    "above": ("0:4", "4:10"),
    "across": ("2:9", "1:10"),
    "below": ("8:10", "0:3"),
    "ragged last tile": ("8:10", "8:10"),
    "below, ragged rows": ("9:10", "5:9"),
    "whole": (":", ":"),
}
"""tiny_job: x1 (10, 4), tiles of 4: blocks [0,4) [4,8) [8,10); only the blocks on or above the diagonal are stored."""


def _piece(text: str) -> slice:
    start, _, stop = text.partition(":")
    return slice(int(start) if start else None, int(stop) if stop else None)


def test_symmetric_slices_over_http_result_array_open_result_and_xarray(
    server: LiveServer, tiny_job: dict[str, Any]
) -> None:
    dense = reference_ntk(tiny_job["model"], torch.from_numpy(tiny_job["x1_array"]), mode="full").numpy()
    url = f"/v1/jobs/{tiny_job['id']}/result"
    job_dir = server.data_dir / "jobs" / tiny_job["id"]
    with server.client("read") as client, Client(server.url, api_key=server.read_key) as ntk:
        remote = ntk.result_array(tiny_job["id"])
        assert remote.shape == (10, 10, 3, 3) and remote.dtype == np.float64
        view = open_result(job_dir)
        for name, (rows, cols) in SLICES.items():
            expected = dense[_piece(rows), _piece(cols)]
            response = client.get(url, params={"rows": rows, "cols": cols}, headers={"Accept": NPY})
            assert int(response.headers["content-length"]) == len(response.content)
            np.testing.assert_allclose(_npy(response), expected, rtol=1e-10, atol=1e-12, err_msg=name)
            np.testing.assert_allclose(remote[_piece(rows), _piece(cols)], expected, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(np.asarray(view[_piece(rows), _piece(cols)]), expected, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(remote[9, 2, 1], dense[9, 2, 1], rtol=1e-10)  # one entry below the diagonal
    dataset = xr.open_zarr(job_dir / "result.zarr")  # a real job's result, as any xarray user opens it
    assert dataset["theta"].dims == ("x1", "x2", "out1", "out2")
    assert dataset.attrs["format_version"] == 1 and dataset.attrs["x1_rows"] == [0, 10]
    assert dataset.attrs["job_id"] == tiny_job["id"] and dataset.attrs["model"] == "tiny"
    stored = dataset["theta"].values  # plain readers see the stored upper tiles only
    np.testing.assert_allclose(stored[0:4, 4:10], dense[0:4, 4:10], rtol=1e-10, atol=1e-12)
    assert not stored[8:10, 0:4].any()


def test_download_streams_to_a_file_and_one_piece_answers_are_capped(
    server: LiveServer, tiny_job: dict[str, Any], tmp_path: Path
) -> None:
    url = f"/v1/jobs/{tiny_job['id']}/result"
    with server.client("read") as client:
        capped = client.get(url, headers={"Accept": SAFETENSORS})  # 7200 bytes > the 4 KiB cap
        assert capped.status_code == 406
        message = capped.json()["error"]["message"]
        assert "NTK_MAX_BINARY_RESPONSE_BYTES" in message and "Accept: application/x-npy" in message
        assert "download_result" in message
        whole = _npy(client.get(url, headers={"Accept": NPY}))  # streamed: no cap
    with Client(server.url, api_key=server.read_key) as ntk:
        on_disk = ntk.download_result(tiny_job["id"], tmp_path / "theta.npy")
        assert isinstance(on_disk, np.memmap) and not (tmp_path / "theta.npy.part").exists()
        np.testing.assert_array_equal(on_disk, whole)
        block = ntk.download_result(tiny_job["id"], tmp_path / "block.npy", rows=(7, 10), cols=slice(0, 5))
        np.testing.assert_array_equal(block, whole[7:10, 0:5])
        with pytest.raises(JobNotFound):
            ntk.download_result("0123", tmp_path / "missing.npy")
        assert not (tmp_path / "missing.npy").exists()


@pytest.mark.parametrize(
    ("rows", "cols", "entry", "block_bytes"),
    [
        ((3, 9), (1, 23), (3, 3), 200),  # a row (22 × 72 B) wider than a read: pieces of one row
        ((3, 9), (1, 23), (3, 3), 10),  # smaller than one entry: one entry per read
        ((0, 30), (5, 11), (), 100),  # whole rows, at most a tile of them
        ((2, 19), None, (3, 3), 300),  # EXAMPLE_DIAGONAL: rows only
    ],
)
def test_stream_pieces_cover_the_block_in_order_and_are_bounded_by_bytes(
    rows: tuple[int, int], cols: tuple[int, int] | None, entry: tuple[int, ...], block_bytes: int
) -> None:
    itemsize, tile = 8, 4
    entry_bytes = int(np.prod(entry, dtype=np.int64)) * itemsize
    seen: list[tuple[int, int]] = []
    for (r0, r1), piece_cols in stream_pieces(rows, cols, entry, itemsize, tile, block_bytes):
        c0, c1 = piece_cols if piece_cols is not None else (0, 1)
        assert (r1 - r0) * (c1 - c0) * entry_bytes <= max(block_bytes, entry_bytes)
        assert (r0 // tile == (r1 - 1) // tile) and (c0 // tile == (c1 - 1) // tile or piece_cols == cols)
        seen += [(r, c) for r in range(r0, r1) for c in range(c0, c1)]
    c0, c1 = cols if cols is not None else (0, 1)
    assert seen == [(r, c) for r in range(*rows) for c in range(c0, c1)]  # the .npy body's C order


@pytest.mark.parametrize(
    ("mode", "dtype", "with_x2"),
    [("trace", "float32", False), ("output_diagonal", "float64", True), ("example_diagonal", "float32", False)],
)
def test_streamed_download_of_every_mode_and_dtype_is_exact(
    server: LiveServer, tiny_job: dict[str, Any], mode: str, dtype: str, with_x2: bool
) -> None:
    rng = np.random.default_rng(11)
    x1, x2 = rng.standard_normal((9, 4)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    with server.client() as client:
        sides = {"x1": {"dataset": _upload(client, x1)}}
        if with_x2:
            sides["x2"] = {"dataset": _upload(client, x2)}
        spec = {"model": "tiny", "mode": mode, "dtype": dtype, "tile_size": 4, **sides}
        job = _wait(client, client.post("/v1/jobs", json=spec).json()["id"])
        assert job["status"] == "succeeded", job
        response = client.get(f"/v1/jobs/{job['id']}/result", headers={"Accept": NPY})
        assert int(response.headers["content-length"]) == len(response.content)
        theta = _npy(response)
    assert theta.dtype == np.dtype(dtype)
    expected = reference_ntk(
        tiny_job["model"], torch.from_numpy(x1), torch.from_numpy(x2) if with_x2 else None, mode=mode
    ).numpy()
    np.testing.assert_allclose(theta, expected, rtol=1e-5, atol=1e-6)


def test_result_array_strided_slices_fetch_bounded_blocks(server: LiveServer, tiny_job: dict[str, Any]) -> None:
    dense = reference_ntk(tiny_job["model"], torch.from_numpy(tiny_job["x1_array"]), mode="full").numpy()
    keys = [np.s_[1::3, ::2], np.s_[::4, 7], np.s_[2:9:2, 1:10, 0, 2], np.s_[-3:, 12:], np.s_[8:2:1, :], np.s_[9]]
    with Client(server.url, api_key=server.read_key) as ntk:
        for fetch_block_bytes in (1, 2**26):  # one row per GET, or everything in one
            remote = ntk.result_array(tiny_job["id"], fetch_block_bytes=fetch_block_bytes)
            for key in keys:
                np.testing.assert_allclose(remote[key], dense[key], rtol=1e-10, atol=1e-12, err_msg=str(key))
        with server.client() as client:  # 512² float32 trace (1 MiB whole), deleted at the end
            dataset = _upload(client, np.random.default_rng(3).standard_normal((512, 4)).astype(np.float32))
            spec = {"model": "tiny", "x1": {"dataset": dataset}, "mode": "trace", "tile_size": 256}
            job = _wait(client, client.post("/v1/jobs", json=spec).json()["id"])
            try:
                whole = ntk.result_array(job["id"])[:, :]
                remote = ntk.result_array(job["id"], fetch_block_bytes=16 * 2**10)
                tracemalloc.start()
                try:
                    strided = remote[::64, 5::64]
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                with Client(server.url, api_key=server.read_key, transport_format="npy") as npy_client:
                    tracemalloc.start()
                    try:
                        streamed = npy_client.job_result(job["id"])
                        _, whole_peak = tracemalloc.get_traced_memory()
                    finally:
                        tracemalloc.stop()
            finally:
                assert client.delete(f"/v1/jobs/{job['id']}").status_code == 200
    np.testing.assert_array_equal(strided, whole[::64, 5::64])
    assert peak < 256 * 2**10, f"an 8 × 8 strided slice peaked at {peak / 2**10:.0f} KiB (the result is 1 MiB)"
    np.testing.assert_array_equal(streamed, whole)
    assert whole_peak < 1.5 * whole.nbytes, f"job_result (npy) of 1 MiB peaked at {whole_peak / 2**20:.2f} MiB"


@pytest.mark.slow
def test_a_download_cut_off_by_the_server_dying_says_so_and_leaves_no_file(tmp_path: Path) -> None:
    # Reads of 64 bytes: the 4 MiB result streams for seconds, long enough to kill the server in the middle.
    server = start_live_server(tmp_path / "data", keys=False, job_stream_block_bytes="64")
    try:
        with server.client(None) as client:
            _register(client, "tiny", TINY_MLP)
            dataset = _upload(client, np.random.default_rng(5).standard_normal((1024, 4)).astype(np.float32))
            spec = {"model": "tiny", "x1": {"dataset": dataset}, "mode": "trace", "tile_size": 256}
            job = _wait(client, client.post("/v1/jobs", json=spec).json()["id"])
        outcome: list[BaseException] = []

        def download() -> None:
            with Client(server.url) as ntk:
                try:
                    ntk.download_result(job["id"], tmp_path / "theta.npy")
                except NtkServiceError as exc:
                    outcome.append(exc)

        thread = threading.Thread(target=download)
        thread.start()
        deadline = time.monotonic() + 30
        while not (tmp_path / "theta.npy.part").exists():
            assert time.monotonic() < deadline and thread.is_alive(), "the download never started"
            time.sleep(0.01)
        time.sleep(2.0)  # the answer has begun (its header comes at once; the body takes about two minutes)
        server.process.kill()
        thread.join(30)
    finally:
        server.stop()
    assert len(outcome) == 1 and not isinstance(outcome[0], ServiceUnavailable), outcome
    assert "the download was cut off" in str(outcome[0])
    assert not (tmp_path / "theta.npy").exists() and not (tmp_path / "theta.npy.part").exists()


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_delete_frees_the_disk_and_the_budget_and_a_second_delete_is_a_404(
    server: LiveServer, tiny_job: dict[str, Any]
) -> None:  # tiny_job: the model 'tiny' is registered
    with server.client() as client:
        # 512 examples, trace, tiles of 256: 3 stored tiles of 256² float32 = 768 KiB of the 1 MiB budget.
        dataset = _upload(client, np.random.default_rng(7).standard_normal((512, 4)).astype(np.float32))
        spec = {"model": "tiny", "x1": {"dataset": dataset}, "mode": "trace", "tile_size": 256}
        used_before = _metric(client, "ntk_job_results_bytes")
        first = _wait(client, client.post("/v1/jobs", json=spec).json()["id"])
        assert first["estimate_bytes"] == 3 * 256 * 256 * 4
        assert _metric(client, "ntk_job_results_bytes") == used_before + first["estimate_bytes"]
        assert _metric(client, "ntk_job_disk_budget_bytes") == 2**20
        refused = client.post("/v1/jobs", json=spec)  # the budget counts what is stored
        assert refused.status_code == 413 and "less" in refused.json()["error"]["message"]
        job_dir = server.data_dir / "jobs" / first["id"]
        on_disk = _tree_bytes(job_dir)
        assert on_disk >= first["estimate_bytes"]
        deleted = client.delete(f"/v1/jobs/{first['id']}")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json() == {"id": first["id"], "deleted": "job", "freed_bytes": on_disk}
        assert not job_dir.exists() and not list(job_dir.parent.glob(".deleting-*"))
        assert _metric(client, "ntk_job_results_bytes") == used_before
        again = client.delete(f"/v1/jobs/{first['id']}")
        assert again.status_code == 404 and again.json()["error"]["type"] == "job_not_found"
        assert client.get(f"/v1/jobs/{first['id']}").status_code == 404

        second = _wait(client, client.post("/v1/jobs", json=spec).json()["id"])  # fits again
        kept = client.delete(f"/v1/jobs/{second['id']}", params={"keep_record": "true"})
        assert kept.status_code == 200 and kept.json()["deleted"] == "result"
        record = client.get(f"/v1/jobs/{second['id']}").json()
        assert record["status"] == "succeeded" and record["result_deleted_at"] is not None
        gone = client.get(f"/v1/jobs/{second['id']}/result", headers={"Accept": NPY})
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "result_not_found"
        twice = client.delete(f"/v1/jobs/{second['id']}", params={"keep_record": "true"})
        assert twice.status_code == 404 and "already deleted" in twice.json()["error"]["message"]
    with server.client("read") as reader:
        assert reader.delete(f"/v1/jobs/{second['id']}").status_code == 403
    with server.client() as client:  # the kept record itself can still go
        record_gone = client.delete(f"/v1/jobs/{second['id']}")
        assert record_gone.json() == {"id": second["id"], "deleted": "job", "freed_bytes": 0}
        assert client.get(f"/v1/jobs/{second['id']}").status_code == 404


def test_jobs_over_data_set_row_ranges(server: LiveServer, tiny_job: dict[str, Any]) -> None:
    x = np.random.default_rng(8).standard_normal((9, 4)).astype(np.float32)
    with server.client() as client:
        dataset = _upload(client, x)
        sides = {"x1": {"dataset": dataset, "start": 2, "stop": 7}, "x2": {"dataset": dataset, "start": 6}}
        job = _wait(client, client.post("/v1/jobs", json={"model": "tiny", "mode": "trace", **sides}).json()["id"])
        assert job["status"] == "succeeded" and job["result_shape"] == [5, 3]
        assert job["x1"] == {"dataset": dataset, "start": 2, "stop": 7}
        theta = _npy(client.get(f"/v1/jobs/{job['id']}/result", headers={"Accept": NPY}))
        bad = client.post("/v1/jobs", json={"model": "tiny", "x1": {"dataset": dataset, "start": 5, "stop": 20}})
        assert bad.status_code == 422 and "outside the data set" in bad.json()["error"]["message"]
    expected = reference_ntk(
        tiny_job["model"], torch.from_numpy(x[2:7]), torch.from_numpy(x[6:9]), mode="trace"
    ).numpy()
    np.testing.assert_allclose(theta, expected, rtol=1e-5, atol=1e-6)
    attrs = xr.open_zarr(server.data_dir / "jobs" / job["id"] / "result.zarr").attrs
    assert (attrs["x1_rows"], attrs["x2_rows"]) == ([2, 7], [6, 9])


def test_sigkill_mid_job_resumes_to_a_bitwise_equal_result(servers: _Servers) -> None:
    with servers.current.client() as client:
        _register(client, "slow", SLOW_MODEL)
        dataset = _upload(client, np.random.default_rng(3).standard_normal((16, 4)).astype(np.float32))
        spec = {"model": "slow", "x1": {"dataset": dataset}, "mode": "full", "tile_size": 4, "panel_tiles": 1}  # 10
        job_id = client.post("/v1/jobs", json=spec).json()["id"]
        _wait_for_tiles(client, job_id, 3)
    servers.kill()
    database = servers.data_dir / "jobs" / "jobs.sqlite3"
    with sqlite3.connect(database) as conn:
        states = dict(conn.execute("SELECT tile_id, state FROM tiles WHERE job_id = ?", (job_id,)).fetchall())
    done_before = {t for t, state in states.items() if state == "done"}
    cut_off = {t for t, state in states.items() if state == "running"}  # claimed, being computed at the kill
    assert 3 <= len(done_before) < 10 and len(cut_off) <= 1
    with servers.restart().client() as client:
        resumed = _wait(client, job_id)
        assert resumed["status"] == "succeeded" and resumed["tiles_done"] == 10
        fresh_id = client.post("/v1/jobs", json=spec).json()["id"]
        assert _wait(client, fresh_id)["status"] == "succeeded"
        interrupted = _npy(client.get(f"/v1/jobs/{job_id}/result", headers={"Accept": NPY}))
        uninterrupted = _npy(client.get(f"/v1/jobs/{fresh_id}/result", headers={"Accept": NPY}))
    np.testing.assert_array_equal(interrupted, uninterrupted)
    with sqlite3.connect(database) as conn:
        attempts = dict(conn.execute("SELECT tile_id, attempts FROM tiles WHERE job_id = ?", (job_id,)).fetchall())
    assert all(attempts[t] == 1 for t in done_before)  # nothing that was done is computed again
    assert all(attempts[t] == 2 for t in cut_off)  # the kill is a real failure: it consumed the cut-off attempt
    assert all(attempts[t] == 1 for t in attempts.keys() - done_before - cut_off)  # the rest ran once
