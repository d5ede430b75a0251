"""Solve jobs against a real uvicorn process: kernel ridge, GP mean and linearized predictions at t = ∞ by each
solver (auto, pcg, block) equal a dense numpy solve on the float64 reference kernel; the held-out curve is the
metric of the predictions; non-convergence is reported; cancellation; 422s naming the field; the memory estimate
refused at submission."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ntk_service import wire
from ntk_service.client import Client
from ntk_service.client._solve import format_solve_progress
from ntk_service.errors import (
    Conflict,
    DiskEstimateExceeded,
    InvalidInput,
    JobNotFinished,
    JobNotFound,
    MemoryEstimateExceeded,
    NtkServiceError,
    ShapeMismatch,
)
from ntk_service.jobs import JobManager, LocalExecutor
from ntk_service.jobs.kinds.features import FEATURES_KIND, FeaturesRequest, read_features
from ntk_service.jobs.kinds.rows import DataRows
from ntk_service.jobs.kinds.solve import SolveRequest
from ntk_service.registry import DatasetStore, ModelRegistry
from tests.conftest import LiveServer, start_live_server
from tests.jobs.conftest import SLOW_MODEL, TINY_MLP, tiny_model_from_weights
from tests.reference import reference_ntk

N, M, K = 12, 5, 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_live_server(tmp_path_factory.mktemp("solve-jobs"))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def setup(server: LiveServer) -> Iterator[dict[str, Any]]:
    """Model 'tiny' (k = 3) and data sets: train x (12, 4), targets y (12, 3), test (5, 4), and y of 11 rows."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, 4)).astype(np.float32)
    y = rng.standard_normal((N, K))
    t = rng.standard_normal((M, 4)).astype(np.float32)
    with Client(server.url, api_key=server.write_key) as client:
        client.register_model("tiny", TINY_MLP, seed=0)
        model = tiny_model_from_weights(client.download_weights("tiny")).double()
        ids = {name: client.upload_dataset(a)["id"] for name, a in (("x", x), ("y", y), ("t", t), ("y11", y[:11]))}
        yield {"client": client, "x": x, "y": y, "t": t, "ids": ids, "model": model}


def _finished(client: Client, job_id: str) -> dict[str, Any]:
    return client.wait_solve_job(job_id, poll_s=0.05, timeout_s=120, progress=None)


def _dense(model: torch.nn.Module, x: np.ndarray, t: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The reference train and test-train kernels as matrices in the solvers' layout (TRACE read as Θ/k ⊗ I_k)."""
    xt, tt = torch.from_numpy(x).double(), torch.from_numpy(t).double()
    if mode == "full":
        a = reference_ntk(model, xt, mode="full").numpy()
        b = reference_ntk(model, tt, xt, mode="full").numpy()
        return a.transpose(0, 2, 1, 3).reshape(N * K, N * K), b.transpose(0, 2, 1, 3).reshape(M * K, N * K)
    eye = np.eye(K)
    a = reference_ntk(model, xt, mode="trace").numpy() / K
    b = reference_ntk(model, tt, xt, mode="trace").numpy() / K
    return np.kron(a, eye), np.kron(b, eye)


@pytest.mark.parametrize(
    ("kind", "mode", "solver"),
    [("kernel_ridge", "full", "auto"), ("gp_mean", "trace", "pcg"), ("linearized", "full", "block")],
)
def test_solve_job_predictions_equal_a_dense_solve_on_the_reference_kernel(
    setup: dict[str, Any], kind: str, mode: str, solver: str
) -> None:
    client, ids, ridge = setup["client"], setup["ids"], 1e-2
    job = client.submit_solve_job(
        "tiny", kind=kind, train=ids["x"], targets=ids["y"], test=ids["t"], mode=mode, ridge=ridge, rtol=1e-10,
        solver=solver,
    )  # fmt: skip
    assert job["status"] in ("queued", "running")
    done = _finished(client, job["id"])
    report = done["result"]
    assert done["status"] == "succeeded" and report["converged"] is True, report
    assert report["solver"] == ("dense" if solver == "auto" else solver)  # auto: 36 rows, a dense solve
    assert [a["solver"] for a in report["attempts"]] == [report["solver"]] and report["rtol"] == 1e-10
    assert done["progress"]["iterations"] == report["iterations"] > 0 and report["memory_bytes"] > 0
    assert max(report["residual"]) <= 1e-10 and report["time_s"] > 0
    result = client.solve_job_result(job["id"], require_converged=True)
    assert result.alpha.shape == (N, K) and result.predictions is not None and result.predictions.shape == (M, K)

    model = setup["model"]
    a, b = _dense(model, setup["x"], setup["t"], mode)
    y = setup["y"]
    f0 = f0_test = np.zeros(1)
    if kind == "linearized":
        with torch.no_grad():
            f0 = model(torch.from_numpy(setup["x"]).double()).numpy()
            f0_test = model(torch.from_numpy(setup["t"]).double()).numpy()
    alpha = np.linalg.solve(a + ridge * np.eye(N * K), (y - f0).reshape(-1))
    expected = f0_test + (b @ alpha).reshape(M, K)
    np.testing.assert_allclose(result.predictions, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    np.testing.assert_allclose(result.alpha, alpha.reshape(N, K), rtol=1e-5, atol=1e-6 * np.abs(alpha).max())


def test_the_held_out_curve_is_the_metric_of_the_predictions_live_and_in_the_result(setup: dict[str, Any]) -> None:
    """The held-out rows are the test rows here, so the curve's last point (the final α) is the MSE of the
    returned predictions against the held-out targets, computed here; the live progress carries the same curve."""
    client, ids = setup["client"], setup["ids"]
    held_y = np.random.default_rng(3).standard_normal((M, K))
    held = client.upload_dataset(held_y)["id"]
    job = client.submit_solve_job(
        "tiny", kind="kernel_ridge", train=ids["x"], targets=ids["y"], test=ids["t"], ridge=1e-2, rtol=1e-8,
        solver="block", heldout={"inputs": ids["t"], "targets": held, "metric": "mse"},
    )  # fmt: skip
    done = _finished(client, job["id"])
    report = done["result"]
    assert report["converged"] and report["heldout_metric"] == "mse" and len(report["heldout_curve"]) >= 2
    assert done["progress"]["heldout_curve"] == report["heldout_curve"]
    assert done["progress"]["heldout"] == report["heldout_curve"][-1][1]
    passes = [p for p, _ in report["heldout_curve"]]
    assert passes == sorted(passes) and passes[-1] <= report["passes"]
    predictions = client.solve_job_result(job["id"]).predictions
    assert predictions is not None
    mse = float(np.mean((predictions - held_y) ** 2))
    assert report["heldout_curve"][-1][1] == pytest.approx(mse, rel=1e-9)
    assert "heldout" in format_solve_progress(done)


def test_a_solve_cut_at_one_iteration_is_reported_as_not_converged(setup: dict[str, Any]) -> None:
    client, ids = setup["client"], setup["ids"]
    job = client.submit_solve_job(
        "tiny", kind="kernel_ridge", train=ids["x"], targets=ids["y"], ridge=1e-3, solver="cg", max_iterations=1
    )
    done = _finished(client, job["id"])
    assert done["status"] == "succeeded"
    assert done["result"]["converged"] is False and done["result"]["stop_reason"] == "max_iterations"
    assert done["result"]["iterations"] == 1 and max(done["result"]["residual"]) > 1e-3
    result = client.solve_job_result(job["id"])
    assert result.converged is False and result.predictions is None
    with pytest.raises(NtkServiceError, match="did not converge"):
        client.solve_job_result(job["id"], require_converged=True)
    body = client._get_json(f"/v1/solve-jobs/{job['id']}/result")  # JSON repeats the report beside the arrays
    assert body["converged"] is False and body["alpha"]["shape"] == [N, K]


def test_a_long_solve_shows_progress_and_is_cancelled(server: LiveServer, setup: dict[str, Any]) -> None:
    client, ids = setup["client"], setup["ids"]
    slow = {**SLOW_MODEL, "kwargs": {**SLOW_MODEL["kwargs"], "out_dim": 3}}  # type: ignore[dict-item]
    client.register_model("slow-solve", slow, seed=0)
    job = client.submit_solve_job(
        "slow-solve", kind="kernel_ridge", train=ids["x"], targets=ids["y"], ridge=1e-3, examples_per_chunk=1,
        solver="pcg", preconditioner="none", rtol=1e-12,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while (client.solve_job(job["id"])["progress"] or {}).get("products", 0) < 1:
        assert time.monotonic() < deadline, "the solve never started"
        time.sleep(0.05)
    seen = client.solve_job(job["id"])
    assert seen["status"] == "running" and seen["progress"]["elapsed_s"] > 0
    client.cancel_solve_job(job["id"])
    done = _finished(client, job["id"])
    assert done["status"] == "cancelled" and done["result"] is None
    with pytest.raises(JobNotFinished, match="cancelled"):
        client.solve_job_result(job["id"])


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"ridge": -1.0}, InvalidInput, "ridge"),
        ({"ridge": 0.0}, InvalidInput, "ridge"),
        ({"solver": "lu"}, InvalidInput, "solver"),
        ({"solver": "block", "block_size": 100_000}, InvalidInput, r"block_size 100000 with k = 3 .* ≤ 66666"),
        ({"solver": "block", "block_size": 4, "landmarks": 8}, InvalidInput, r"landmarks \(8\) must be ≤ block_size"),
        ({"block_size": 10**9}, InvalidInput, "block_size"),
        ({"dtype": "float32", "rtol": 1e-7}, InvalidInput, "rtol 1e-07 is below the floor float32 products"),
        ({"heldout": {"inputs": "t", "targets": "y"}}, ShapeMismatch, r"heldout.targets rows \[0, 12\) are 12 rows"),
        ({"heldout": {"inputs": "x", "targets": "x"}}, ShapeMismatch, r"heldout.targets has shape \(12, 4\)"),
        ({"heldout": {"inputs": "x", "targets": "y", "metric": "r2"}}, InvalidInput, "metric"),
        ({"kind": "linearized", "heldout": {"inputs": "x", "targets": "y"}}, InvalidInput, "heldout.metric 'mse'"),
        ({"kind": "lasso"}, InvalidInput, "kind"),
        ({"mode": "example_diagonal"}, InvalidInput, "mode"),
        ({"preconditioner": "jacobi"}, InvalidInput, "preconditioner"),
        ({"targets": "y11"}, ShapeMismatch, "11 rows"),
        ({"train": {"dataset": "x", "start": 0, "stop": 13}}, InvalidInput, r"outside the data set of 12 rows"),
        ({"targets": "x"}, ShapeMismatch, r"shape \(12, 4\), expected \(12, 3\)"),
    ],
)
def test_bad_solve_input_is_a_422_saying_what_to_fix(
    setup: dict[str, Any], change: dict[str, Any], error: type[Exception], match: str
) -> None:
    client, ids = setup["client"], setup["ids"]
    sides = {"train": ids["x"], "targets": ids["y"]}
    for side in ("train", "targets"):
        value = change.get(side)
        if isinstance(value, str):
            change = change | {side: ids[value]}
        elif isinstance(value, dict):
            change = change | {side: value | {"dataset": ids[value["dataset"]]}}
    if "heldout" in change:
        held = change["heldout"]
        change = change | {"heldout": held | {side: {"dataset": ids[held[side]]} for side in ("inputs", "targets")}}
    body: dict[str, Any] = {"kind": "kernel_ridge", "model": "tiny", "ridge": 1e-3} | sides | change
    body = {k: ({"dataset": v} if k in ("train", "targets") and isinstance(v, str) else v) for k, v in body.items()}
    with pytest.raises(error, match=match) as caught:
        client._send_json("POST", "/v1/solve-jobs", body)
    assert getattr(caught.value, "http_status", None) == 422


def test_a_nan_ridge_and_a_solve_over_the_memory_budget_are_refused_by_the_job_engine(tmp_path: Path) -> None:
    """JSON cannot carry NaN (the server answers 400 for it), so the engine's own check is tested directly; and a
    solve whose estimate is over the budget is refused at submission, the estimate in the message."""
    registry, datasets = ModelRegistry(tmp_path), DatasetStore(tmp_path)
    registry.register("tiny", TINY_MLP, seed=0)
    x = datasets.create(np.zeros((300, 4), np.float32)).id
    y = datasets.create(np.ones((300, 3))).id
    jobs = JobManager(data_dir=tmp_path, models=registry, datasets=datasets, executor=LocalExecutor(),
                      memory_budget_bytes=2**20)  # fmt: skip
    try:
        with pytest.raises(InvalidInput, match=r"ridge must be a finite number > 0, got nan"):
            jobs.create(
                SolveRequest(
                    kind="kernel_ridge", model="tiny", train=DataRows(x), targets=DataRows(y), ridge=float("nan")
                )
            )
        request = SolveRequest(kind="kernel_ridge", model="tiny", train=DataRows(x), targets=DataRows(y), ridge=1.0)
        # 900 rows: dense needs 3 × 900² float64s (18.5 MiB) > 1 MiB, and so does auto, which tries it first
        with pytest.raises(MemoryEstimateExceeded, match=r"solver 'dense' needs about 18\.5\d* MiB") as caught:
            jobs.create(dataclasses.replace(request, solver="dense"))
        assert caught.value.estimate_bytes > caught.value.budget_bytes == 2**20
        assert jobs.create(dataclasses.replace(request, solver="pcg", preconditioner="none")).spec.estimate_bytes > 0
        assert len(jobs.list()) == 1
    finally:
        registry.close()
        datasets.close()


def test_inline_solve_equals_the_dense_solve_and_checks_its_targets(setup: dict[str, Any]) -> None:
    client, ridge = setup["client"], 1e-2
    x, t, y = setup["x"], setup["t"], setup["y"]
    body = {
        "kind": "kernel_ridge",
        "x_train": wire.tensor_to_json(x),
        "y_train": wire.tensor_to_json(y),
        "x_test": wire.tensor_to_json(t),
        "mode": "trace",
        "ridge": ridge,
        "rtol": 1e-12,
    }
    out = client._send_json("POST", "/v1/models/tiny/solve", body)
    assert out["converged"] is True and out["alpha"]["shape"] == [N, K]
    a, b = _dense(setup["model"], x, t, "trace")
    expected = (b @ np.linalg.solve(a + ridge * np.eye(N * K), y.reshape(-1))).reshape(M, K)
    predictions = wire.tensor_from_json(out["predictions"], name="predictions")
    np.testing.assert_allclose(predictions, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    cut = client._send_json("POST", "/v1/models/tiny/solve", body | {"solver": "pcg", "max_iterations": 1})
    assert cut["converged"] is False and cut["stop_reason"] == "max_iterations"
    with pytest.raises(ShapeMismatch, match=r"y_train has shape \(11, 3\), expected \(12, 3\)") as caught:
        client._send_json("POST", "/v1/models/tiny/solve", body | {"y_train": wire.tensor_to_json(y[:11])})
    assert caught.value.http_status == 422  # type: ignore[attr-defined]
    for ridge_value in (-1, 0):
        with pytest.raises(InvalidInput, match="ridge") as caught:
            client._send_json("POST", "/v1/models/tiny/solve", body | {"ridge": ridge_value})
        assert caught.value.http_status == 422  # type: ignore[attr-defined]


def test_the_ridge_estimate_route_picks_a_ridge_whose_exact_gcv_is_near_its_minimum(setup: dict[str, Any]) -> None:
    """POST /v1/models/{name}/ridge-estimate scores the default grid (× the kernel's mean diagonal) from a Nyström
    basis of the operator; the exact GCV of the reference kernel (numpy, here) at its pick is within 20 % of the
    exact minimum over the grid (the library's guarantee, NOTE [ridge estimate]); bad input is a 422."""
    client, x, y = setup["client"], setup["x"], setup["y"]
    est = client.estimate_ridge("tiny", x, y)
    a, _ = _dense(setup["model"], x, setup["t"], "full")
    mean_diagonal = float(np.mean(np.diag(a)))
    grid = np.logspace(-6, 0, 13) * mean_diagonal
    assert est["method"] == "nystrom" and np.allclose(est["ridges"], grid, rtol=1e-6)
    theta, vectors = np.linalg.eigh(a)
    projected = vectors.T @ y.reshape(-1)

    def gcv(lam: float) -> float:  # (1/n) ‖(I − H)y‖² / ((1/n) tr(I − H))²
        shrink = lam / (np.maximum(theta, 0.0) + lam)
        return float(np.mean((shrink * projected) ** 2) / np.mean(shrink) ** 2)

    exact = [gcv(lam) for lam in grid]
    assert gcv(est["best_gcv"]) <= 1.2 * min(exact) and est["best_gcv"] in est["ridges"]
    with pytest.raises(InvalidInput, match="ridges") as caught:
        client.estimate_ridge("tiny", x, y, ridges=[-1.0])
    assert caught.value.http_status == 422  # type: ignore[attr-defined]
    with pytest.raises(ShapeMismatch, match=r"y_train has shape \(11, 3\), expected \(12, 3\)"):
        client.estimate_ridge("tiny", x, y[:11])


def test_a_solve_jobs_event_stream_reports_each_cg_segment_and_ends_with_the_finished_job(
    server: LiveServer, setup: dict[str, Any]
) -> None:
    client, ids = setup["client"], setup["ids"]
    job = client.submit_solve_job(
        "tiny", kind="kernel_ridge", train=ids["x"], targets=ids["y"], ridge=1e-3, rtol=1e-12, progress_every=2,
        solver="pcg", preconditioner="none",
    )  # fmt: skip
    events: list[tuple[str, dict[str, Any]]] = []
    with server.client() as http, http.stream("GET", f"/v1/solve-jobs/{job['id']}/events") as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in stream.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line[5:])))
    assert [name for name, _ in events[:-1]] == ["progress"] * (len(events) - 1) and events[-1][0] == "end"
    final = events[-1][1]
    assert final == client.solve_job(job["id"]) and final["status"] == "succeeded"
    iterations = [e["progress"]["iterations"] for _, e in events if e["progress"]]
    assert iterations == sorted(iterations) and iterations[-1] == final["result"]["iterations"]
    assert len(set(iterations)) >= 2, "the stream showed no CG report between start and end"


def test_solve_and_features_jobs_are_found_only_under_their_own_routes(
    server: LiveServer, setup: dict[str, Any]
) -> None:
    client, ids = setup["client"], setup["ids"]
    solve = client.submit_solve_job("tiny", kind="kernel_ridge", train=ids["x"], targets=ids["y"], ridge=1e-2)
    features = client.submit_features_job("tiny", dataset=ids["x"], dim=8, seed=0)
    _finished(client, solve["id"])
    client.wait_features_job(features["id"], poll_s=0.05, timeout_s=120, progress=None)
    with server.client() as http:
        listed = {
            route: [j["id"] for j in http.get(f"/v1/{route}").json()["data"]]
            for route in ("solve-jobs", "feature-jobs")
        }
        assert solve["id"] in listed["solve-jobs"] and solve["id"] not in listed["feature-jobs"]
        assert features["id"] in listed["feature-jobs"] and features["id"] not in listed["solve-jobs"]
        for route, other in (("solve-jobs", features["id"]), ("feature-jobs", solve["id"])):
            for method, path in (("GET", ""), ("GET", "/events"), ("DELETE", "")):
                response = http.request(method, f"/v1/{route}/{other}{path}")
                assert response.status_code == 404, (route, path, response.text)
                error = response.json()["error"]
                assert error["type"] == "job_not_found" and f"GET /v1/{route}" in error["message"], error
        assert http.get("/v1/solve-jobs/0123/events").status_code == 404


def test_finished_solve_and_features_jobs_are_deleted_with_their_files_and_cancel_only_keeps_them(
    server: LiveServer, setup: dict[str, Any]
) -> None:
    client, ids = setup["client"], setup["ids"]
    solve = _finished(
        client, client.submit_solve_job("tiny", kind="kernel_ridge", train=ids["x"], targets=ids["y"], ridge=1.0)["id"]
    )
    features = client.submit_features_job("tiny", dataset=ids["x"], dim=16, seed=0, dtype="float64")
    features = client.wait_features_job(features["id"], poll_s=0.05, timeout_s=120, progress=None)
    assert client.cancel_solve_job(solve["id"]) == client.solve_job(solve["id"])  # cancel_only: a finished job stays
    folders = {job["id"]: server.data_dir / "jobs" / "solve" / job["id"] for job in (solve, features)}
    assert all(folder.is_dir() for folder in folders.values())
    deleted = client.delete_solve_job(solve["id"])
    assert deleted["deleted"] == "job" and deleted["freed_bytes"] >= (N + 0) * K * 8
    gone = client.delete_features_job(features["id"])
    assert gone["freed_bytes"] >= N * K * 16 * 8 * 0.5, gone  # Φ (12, 3, 16) float64, zstd-compressed on disk
    assert not any(folder.exists() for folder in folders.values())
    with pytest.raises(JobNotFound):
        client.solve_job(solve["id"])
    with pytest.raises(JobNotFound):
        client.delete_features_job(features["id"])


def test_a_features_job_too_large_for_the_disk_budget_is_refused_and_the_budget_is_shared_with_kernel_jobs(
    tmp_path: Path,
) -> None:
    budget = 40_000  # bytes: Φ (12, 3, 256) float32 = 36,864 fits once; a kernel job's 12·12·3·3 float32 = 5184
    live = start_live_server(tmp_path / "data", job_disk_budget_bytes=str(budget))
    try:
        with Client(live.url, api_key=live.write_key) as client:
            client.register_model("tiny", TINY_MLP, seed=0)
            x = client.upload_dataset(np.random.default_rng(0).standard_normal((N, 4)).astype(np.float32))["id"]
            with pytest.raises(
                DiskEstimateExceeded,
                match=r"Φ \(12, 3, 512\) in float32 needs 72\.00 KiB on disk, more than the disk budget",
            ) as big:
                client.submit_features_job("tiny", dataset=x, dim=512)
            assert getattr(big.value, "http_status", None) == 413
            first = client.submit_features_job("tiny", dataset=x, dim=256)
            client.wait_features_job(first["id"], poll_s=0.05, timeout_s=120, progress=None)
            with pytest.raises(DiskEstimateExceeded, match=r"less 36\.00 KiB of stored results"):
                client.submit_job("tiny", x, mode="full")  # 5184 bytes, but the features job holds 36,864
            client.delete_features_job(first["id"])
            job = client.wait(client.submit_job("tiny", x, mode="full"), progress=False)
            assert job["status"] == "succeeded"
            with pytest.raises(DiskEstimateExceeded, match=r"less 5\.06 KiB of stored results"):
                client.submit_features_job("tiny", dataset=x, dim=256)  # the kernel job's result counts in turn
    finally:
        live.stop()


def test_a_features_job_is_not_deleted_while_its_phi_is_read(tmp_path: Path) -> None:
    registry, datasets = ModelRegistry(tmp_path), DatasetStore(tmp_path)
    registry.register("tiny", TINY_MLP, seed=0)
    x = datasets.create(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)).id
    jobs = JobManager(data_dir=tmp_path, models=registry, datasets=datasets, executor=LocalExecutor())
    jobs.start()
    try:
        job = jobs.create(FeaturesRequest(model="tiny", dataset=DataRows(x), dim=8))
        deadline = time.monotonic() + 60
        while jobs.get(job.id).status != "succeeded":
            assert time.monotonic() < deadline, jobs.get(job.id)
            time.sleep(0.05)
        with jobs.reading(job.id):  # what GET /v1/feature-jobs/{id}/result holds while it reads Φ
            _, folder = jobs.succeeded(job.id, FEATURES_KIND)
            phi = read_features(folder)
            with pytest.raises(Conflict, match="being read"):
                jobs.delete(job.id, kind=FEATURES_KIND)
            first = np.asarray(phi[:])
        assert first.shape == (5, 3, 8)
        assert jobs.delete(job.id, kind=FEATURES_KIND).freed_bytes > 0
        with pytest.raises(JobNotFound):
            jobs.get(job.id)
    finally:
        jobs.stop()
        registry.close()
        datasets.close()
