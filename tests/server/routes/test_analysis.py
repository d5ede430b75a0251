"""The analysis routes against a real server: /predict, /spectrum and /compare over HTTP and through the client,
checked against the float64 reference kernel of the model rebuilt from its downloaded weights, with the analysis
written out by hand (plain gradient-descent loops, numpy eigvalsh, the distance formula)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import torch

from ntk_service import wire
from ntk_service.client import Client
from ntk_service.errors import (
    InvalidInput,
    MemoryEstimateExceeded,
    ModelNotFound,
    PayloadTooLarge,
    ShapeMismatch,
    UnstableLearningRate,
)
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server.support import TINY_ARCHITECTURES, rebuild, sample_inputs, tensor_json

K = TINY_ARCHITECTURES["mlp"]["output_dim"]


@pytest.fixture(scope="module")
def versions(live_server: LiveServer) -> dict[str, Any]:
    """'analysis-mlp' with two versions (seed 3, then random weights), both rebuilt locally in float64."""
    with live_server.client("write") as http:
        record = http.post(
            "/v1/models", json={"name": "analysis-mlp", "architecture": TINY_ARCHITECTURES["mlp"], "seed": 3}
        ).json()
        v1 = rebuild(record, http.get("/v1/models/analysis-mlp/versions/1/weights").content)
        torch.manual_seed(1)
        upload = {k: (v + 0.3 * torch.randn_like(v)).numpy() for k, v in v1.state_dict().items()}
        response = http.post(
            "/v1/models/analysis-mlp/versions",
            content=wire.encode_safetensors(upload),
            headers={"Content-Type": wire.MEDIA_SAFETENSORS},
        )
        assert response.status_code == 201, response.text
        v2 = rebuild(record, http.get("/v1/models/analysis-mlp/versions/2/weights").content)
    return {"record": record, "models": {1: v1.double(), 2: v2.double()}}


def _matrix(model: torch.nn.Module, x1: np.ndarray, x2: np.ndarray | None = None) -> np.ndarray:
    theta = reference_ntk(model, torch.from_numpy(x1), None if x2 is None else torch.from_numpy(x2)).numpy()
    n, m = theta.shape[:2]
    return theta.transpose(0, 2, 1, 3).reshape(n * K, m * K)


@pytest.fixture
def client(live_server: LiveServer) -> Client:
    with Client(live_server.url, api_key=live_server.read_key) as c:
        yield c


def test_predict_gradient_descent_equals_the_loop_on_the_reference_kernel(client: Client, versions) -> None:
    record, model = versions["record"], versions["models"][2]
    x_train, x_test = sample_inputs(record, 5, seed=10), sample_inputs(record, 3, seed=11)
    y = np.random.default_rng(12).standard_normal((5, K))
    theta, theta_test = _matrix(model, x_train), _matrix(model, x_test, x_train)
    with torch.no_grad():
        f = model(torch.from_numpy(x_train).double()).numpy().reshape(-1)
        f_test = model(torch.from_numpy(x_test).double()).numpy().reshape(-1)
    c = 2 / (5 * K)
    lr = 0.5 * 2 / (c * np.linalg.eigvalsh(theta)[-1])
    out = client.predict(
        "analysis-mlp", x_train, y, x_test, times=[0, 2, 7], learning_rate=lr, flow="gradient_descent", version=2
    )
    assert out.train.shape == (3, 5, K) and out.test is not None and out.test.shape == (3, 3, K)
    np.testing.assert_allclose(out.f0_train.reshape(-1), f, rtol=1e-12, atol=1e-12)
    expected = {}
    for step in range(8):  # f <- f − η·c·Θ(f − y), and the test outputs with Θ*
        expected[step] = (f.copy(), f_test.copy())
        residual = f - y.reshape(-1)
        f, f_test = f - lr * c * theta @ residual, f_test - lr * c * theta_test @ residual
    for i, step in enumerate([0, 2, 7]):
        np.testing.assert_allclose(out.train[i].reshape(-1), expected[step][0], rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(out.test[i].reshape(-1), expected[step][1], rtol=1e-8, atol=1e-10)
    assert out.version == 2 and out.kernel_ms > 0 and out.max_learning_rate == pytest.approx(2 * lr, rel=1e-8)


def test_predict_at_infinity_and_trace_mode(client: Client, versions) -> None:
    record, model = versions["record"], versions["models"][1]
    x_train, x_test = sample_inputs(record, 4, seed=13), sample_inputs(record, 2, seed=14)
    y = np.random.default_rng(15).standard_normal((4, K))
    out = client.predict("analysis-mlp", x_train, y, x_test, times=[math.inf], learning_rate=1.0, version=1)
    theta, theta_test = _matrix(model, x_train), _matrix(model, x_test, x_train)
    with torch.no_grad():
        r0 = model(torch.from_numpy(x_train).double()).numpy().reshape(-1) - y.reshape(-1)
        f_test = model(torch.from_numpy(x_test).double()).numpy().reshape(-1)
    assert out.times[0] == math.inf and out.test is not None
    np.testing.assert_allclose(out.train[0], y, atol=1e-8)
    np.testing.assert_allclose(out.test[0].reshape(-1), f_test - theta_test @ np.linalg.solve(theta, r0), atol=1e-7)
    trace = client.predict("analysis-mlp", x_train, y, times=[0.5], learning_rate=0.1, mode="trace", version=1)
    assert trace.test is None and trace.train.shape == (1, 4, K)


def test_spectrum_matches_eigvalsh(client: Client, versions) -> None:
    record, model = versions["record"], versions["models"][2]
    x = sample_inputs(record, 6, seed=16)
    s = client.spectrum("analysis-mlp", x, ridges=[0.1])
    want = np.linalg.eigvalsh(_matrix(model, x))[::-1]
    np.testing.assert_allclose(s.eigenvalues, want, rtol=1e-9, atol=1e-11)
    assert s.n == 6 * K and s.method == "eigh" and s.version == 2
    assert s.effective_dof[0.1] == pytest.approx(np.sum(np.clip(want, 0, None) / (np.clip(want, 0, None) + 0.1)))
    top = client.spectrum("analysis-mlp", x, top=3, method="lanczos")
    np.testing.assert_allclose(top.eigenvalues, want[:3], rtol=1e-9)
    assert top.condition_number is None and top.lambda_min is None


def test_compare_versions(client: Client, versions) -> None:
    record, models = versions["record"], versions["models"]
    x = sample_inputs(record, 5, seed=17)
    labels = np.array([0, 1, 2, 0, 1])
    out = client.compare("analysis-mlp", x, versions=[1, 2, 1], y=labels, variant="centered")
    k1, k2 = _matrix(models[1], x), _matrix(models[2], x)
    want = 1 - np.sum(k1 * k2) / (np.linalg.norm(k1) * np.linalg.norm(k2))
    assert out.versions == [("analysis-mlp", 1), ("analysis-mlp", 2), ("analysis-mlp", 1)]
    assert out.distance.shape == (3, 3) and out.distance[0, 2] == pytest.approx(0.0, abs=1e-12)
    assert out.distance[0, 1] == pytest.approx(want, rel=1e-8) and out.distance[1, 0] == out.distance[0, 1]
    assert out.relative_change[1] == pytest.approx(np.linalg.norm(k2 - k1) / np.linalg.norm(k1), rel=1e-8)
    # centered alignment of the trace kernel with one-hot labels, written out with H
    trace = np.einsum("nmaa->nm", k1.reshape(5, K, 5, K).transpose(0, 2, 1, 3))
    onehot = np.eye(3)[labels]
    h = np.eye(5) - 1 / 5
    kc, tc = h @ trace @ h, h @ onehot @ onehot.T @ h
    assert out.alignment is not None
    assert out.alignment[0] == pytest.approx(np.sum(kc * tc) / (np.linalg.norm(kc) * np.linalg.norm(tc)), rel=1e-8)


def test_data_set_slices_as_inputs(live_server: LiveServer, client: Client, versions) -> None:
    record = versions["record"]
    x = sample_inputs(record, 9, seed=26)
    with Client(live_server.url, api_key=live_server.write_key) as writer:
        ref = {"dataset": writer.upload_dataset(x)["id"], "start": 2, "stop": 8}
    inline = client.compare("analysis-mlp", x[2:8], versions=[1, 2])
    stored = client.compare("analysis-mlp", ref, versions=[1, 2])  # each version keys the slice by itself
    np.testing.assert_allclose(stored.distance, inline.distance, rtol=1e-12, atol=1e-15)
    assert stored.distance[0, 1] > 0
    s = client.spectrum("analysis-mlp", ref, version=1)
    np.testing.assert_allclose(s.eigenvalues, np.linalg.eigvalsh(_matrix(versions["models"][1], x[2:8]))[::-1],
                               rtol=1e-9, atol=1e-11)  # fmt: skip


@pytest.mark.parametrize("family", ["cnn", "transformer"])
def test_other_families(live_server: LiveServer, client: Client, family: str) -> None:
    name = f"analysis-{family}"
    with live_server.client("write") as http:
        record = http.post("/v1/models", json={"name": name, "architecture": TINY_ARCHITECTURES[family]}).json()
        model = rebuild(record, http.get(f"/v1/models/{name}/versions/1/weights").content).double()
    x = sample_inputs(record, 3, seed=27)
    k = record["output_dim"]
    out = client.predict(name, x, np.zeros((3, k)), times=[0], learning_rate=0.1)
    xt = torch.from_numpy(x).double() if x.dtype.kind == "f" else torch.from_numpy(x)
    with torch.no_grad():
        np.testing.assert_allclose(out.f0_train, model(xt).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.train[0], out.f0_train, rtol=0, atol=1e-12)  # t = 0: the network outputs
    theta = reference_ntk(model, torch.from_numpy(x)).numpy().transpose(0, 2, 1, 3).reshape(3 * k, 3 * k)
    np.testing.assert_allclose(
        client.spectrum(name, x).eigenvalues, np.linalg.eigvalsh(theta)[::-1], rtol=1e-8, atol=1e-10
    )


def test_bad_inputs_get_clear_4xx(live_server: LiveServer, client: Client, versions) -> None:
    record = versions["record"]
    x = sample_inputs(record, 4, seed=18)
    y = np.zeros((4, K))
    with pytest.raises(ShapeMismatch, match="send y_train of shape \\(4, 3\\)") as wrong_y:
        client.predict("analysis-mlp", x, np.zeros((3, K)), times=[1.0], learning_rate=0.1)
    assert wrong_y.value.http_status == 422
    with pytest.raises(InvalidInput, match="times must be ≥ 0"):
        client.predict("analysis-mlp", x, y, times=[-1.0], learning_rate=0.1)
    with pytest.raises(InvalidInput, match="ridge must be ≤ 1e\\+100, got 1e\\+308"):  # was NaN (null)
        client.predict("analysis-mlp", x, y, times=[1.0], learning_rate=0.1, ridge=1e308, ridge_scale="relative")
    with pytest.raises(UnstableLearningRate, match="above the stable limit") as unstable:
        client.predict("analysis-mlp", x, y, times=[3], learning_rate=1e6, flow="gradient_descent")
    assert unstable.value.http_status == 422 and "Use learning_rate <" in unstable.value.message
    x8 = sample_inputs(record, 8, seed=23)
    with pytest.raises(PayloadTooLarge, match="ask for fewer times") as too_big:  # 1000 times: over the 64 KiB cap
        client.predict("analysis-mlp", x8, np.zeros((8, K)), times=list(range(1000)), learning_rate=0.1)
    assert too_big.value.http_status == 413
    with pytest.raises(InvalidInput, match="give both or neither"):
        client.compare("analysis-mlp", x, versions=[1, 2], variant="centered")
    with pytest.raises(ModelNotFound):
        client.spectrum("no-such-model", x)
    with live_server.client("write") as http:
        other = {**TINY_ARCHITECTURES["mlp"], "hidden": [5]}
        assert http.post("/v1/models", json={"name": "analysis-other", "architecture": other}).status_code == 201
        with pytest.raises(InvalidInput, match="compare versions of one architecture"):
            client.compare("analysis-mlp", x, versions=[1, {"model": "analysis-other", "version": 1}])
        big = sample_inputs(record, 1200, seed=19)  # a 3600x3600 float64 eigh (3 copies): over the 256 MiB budget
        with pytest.raises(MemoryEstimateExceeded, match="over the memory budget") as refused:
            client.spectrum("analysis-mlp", big)
        assert refused.value.http_status == 413 and refused.value.estimate_bytes
        response = http.post("/v1/models/analysis-mlp/predict", json={"x_train": tensor_json(x), "times": [1]})
        assert response.status_code == 422 and "needs x_train" in response.json()["error"]["message"]
        response = http.post("/v1/models/analysis-mlp/spectrum", json={"x": tensor_json(x), "top": 2, "bogus": 1})
        assert response.status_code == 422 and "bogus" in response.json()["error"]["message"]


def test_cli_analyze_and_plot(live_server: LiveServer, client: Client, versions, tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from ntk_service.cli import app

    record, model = versions["record"], versions["models"][2]
    x, xt = sample_inputs(record, 5, seed=20), sample_inputs(record, 2, seed=21)
    y = np.random.default_rng(22).standard_normal((5, K))
    for name, array in {"x": x, "xt": xt, "y": y, "labels": np.array([0, 1, 0, 1, 1])}.items():
        np.save(tmp_path / f"{name}.npy", array)
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.read_key}
    runner = CliRunner()

    def run(*args: str) -> Any:
        result = runner.invoke(app, [str(a) for a in args], env=env)
        assert result.exit_code == 0, f"{result.stdout}\n{result.stderr}"
        return result

    common = ("--x-train", tmp_path / "x.npy", "--y-train", tmp_path / "y.npy", "--x-test", tmp_path / "xt.npy")
    run("analyze", "predict", "analysis-mlp", *common, "--times", "0,5,inf", "--learning-rate", "0.05",
        "-o", tmp_path / "pred.npz")  # fmt: skip
    saved = np.load(tmp_path / "pred.npz")
    direct = client.predict("analysis-mlp", x, y, xt, times=[0, 5, math.inf], learning_rate=0.05)
    np.testing.assert_array_equal(saved["test"], direct.test)
    np.testing.assert_array_equal(saved["times"], [0, 5, math.inf])
    run("analyze", "spectrum", "analysis-mlp", "--x", tmp_path / "x.npy", "-o", tmp_path / "eig.npy")
    want = np.linalg.eigvalsh(_matrix(model, x))[::-1]
    np.testing.assert_allclose(np.load(tmp_path / "eig.npy"), want, rtol=1e-9, atol=1e-11)
    out = run("--json", "analyze", "compare", "analysis-mlp", "--x", tmp_path / "x.npy", "--versions", "1,2",
              "--y", tmp_path / "labels.npy", "--variant", "centered")  # fmt: skip
    body = json.loads(out.stdout)
    assert body["distance"][0][1] > 0 and body["versions"][1]["version"] == "analysis-mlp v2"
    np.save(tmp_path / "theta.npy", reference_ntk(model, torch.from_numpy(x)).numpy())
    for args in (
        ("plot", "training", tmp_path / "pred.npz", "-o", tmp_path / "curves.png"),
        ("plot", "spectrum", tmp_path / "eig.npy", "-o", tmp_path / "spectrum.png"),
        ("plot", "heatmap", tmp_path / "theta.npy", "-o", tmp_path / "heat.png"),
    ):
        run(*args)
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "spectrum.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"
    bad = runner.invoke(app, ["analyze", "predict", "analysis-mlp", *map(str, common), "--times", "0,soon",
                              "--learning-rate", "0.1"], env=env)  # fmt: skip
    assert bad.exit_code == 2 and "'soon' is not a number" in bad.stderr


def test_openapi_documents_the_analysis_bodies(live_server: LiveServer) -> None:
    with live_server.client(None) as http:
        spec = http.get("/openapi.json").json()
    for route, field in (("predict", "y_train"), ("spectrum", "top"), ("compare", "versions")):
        body = spec["paths"][f"/v1/models/{{name}}/{route}"]["post"]["requestBody"]["content"]
        assert field in body["application/json"]["schema"]["properties"]


def _job(http: Any, dataset: str, version: int, **extra: Any) -> str:
    body = {"model": "analysis-mlp", "version": version, "x1": {"dataset": dataset}, "mode": "full",
            "dtype": "float64", "tile_size": 4, **extra}  # fmt: skip
    response = http.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    for _ in range(1200):
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] != "queued" and job["status"] != "running":
            assert job["status"] == "succeeded", job
            return str(job_id)
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def test_analyses_of_stored_job_kernels(live_server: LiveServer, versions) -> None:
    record, models = versions["record"], versions["models"]
    x = sample_inputs(record, 10, seed=24)
    with live_server.client("write") as http:
        with Client(live_server.url, api_key=live_server.write_key) as writer:
            dataset = writer.upload_dataset(x)["id"]
        first, second = _job(http, dataset, 1), _job(http, dataset, 2)  # symmetric: 6 of 9 tiles stored
        k1, k2 = _matrix(models[1], x), _matrix(models[2], x)
        with Client(live_server.url, api_key=live_server.read_key) as reader:
            top = reader.job_spectrum(first, top=4)
            dense = reader.job_spectrum(first, top=None)
            y = np.random.default_rng(25).standard_normal((10, K))
            aligned = reader.job_alignment(first, y, variant="rayleigh")
            moved = reader.job_distance(first, second)
        np.testing.assert_allclose(top.eigenvalues, np.linalg.eigvalsh(k1)[::-1][:4], rtol=1e-9)
        assert top.method == "lanczos" and dense.method == "eigh" and dense.n == 30
        np.testing.assert_allclose(dense.eigenvalues, np.linalg.eigvalsh(k1)[::-1], rtol=1e-9, atol=1e-11)
        assert aligned == pytest.approx(y.reshape(-1) @ k1 @ y.reshape(-1) / np.sum(y * y), rel=1e-9)
        want = 1 - np.sum(k1 * k2) / (np.linalg.norm(k1) * np.linalg.norm(k2))
        assert moved.distance == pytest.approx(want, rel=1e-8)
        assert moved.relative_change == pytest.approx(np.linalg.norm(k2 - k1) / np.linalg.norm(k1), rel=1e-9)
        trace_job = _job(http, dataset, 1, mode="trace")
        mismatch = http.post(f"/v1/jobs/{first}/distance", json={"other": trace_job})
        assert mismatch.status_code == 422 and "same inputs in the same mode" in mismatch.json()["error"]["message"]
        missing = http.post(f"/v1/jobs/{first}/alignment", json={"variant": "centered"})
        assert missing.status_code == 422 and "needs y" in missing.json()["error"]["message"]
        assert http.post("/v1/jobs/nope/spectrum", json={}).status_code == 404


def test_spectrum_by_lanczos_on_the_operator_matches_eigvalsh_without_forming_the_kernel(
    client: Client, versions
) -> None:
    record, model = versions["record"], versions["models"][2]
    x = sample_inputs(record, 7, seed=18)
    want = np.linalg.eigvalsh(_matrix(model, x))[::-1]
    top = client.spectrum("analysis-mlp", x, top=4, method="operator")
    np.testing.assert_allclose(top.eigenvalues, want[:4], rtol=1e-8)
    assert top.n == 7 * K and top.condition_number is None
    trace = np.einsum("nmaa->nm", _matrix(model, x).reshape(7, K, 7, K).transpose(0, 2, 1, 3))
    by_trace = client.spectrum("analysis-mlp", x, top=2, method="operator", mode="trace")
    np.testing.assert_allclose(by_trace.eigenvalues, np.linalg.eigvalsh(trace)[::-1][:2], rtol=1e-8)
    with pytest.raises(InvalidInput, match="give top"):
        client.spectrum("analysis-mlp", x, method="operator")
    with pytest.raises(InvalidInput, match=f"must be below the kernel's size {7 * K}"):
        client.spectrum("analysis-mlp", x, top=7 * K, method="operator")
