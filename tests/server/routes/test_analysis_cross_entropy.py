"""/predict with loss="cross_entropy" against a real server: over the client and the CLI, checked against the
float64 reference kernel of the model rebuilt from its downloaded weights and a hand-written softmax descent loop;
bad labels and impossible plans get a 4xx before any kernel is computed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ntk_service.client import Client
from ntk_service.errors import InvalidInput, ResourceLimit, ShapeMismatch
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server.support import TINY_ARCHITECTURES, rebuild, sample_inputs, tensor_json

K = TINY_ARCHITECTURES["mlp"]["output_dim"]
NAME = "analysis-ce-mlp"


@pytest.fixture(scope="module")
def record(live_server: LiveServer) -> dict[str, Any]:
    with live_server.client("write") as http:
        body = {"name": NAME, "architecture": TINY_ARCHITECTURES["mlp"], "seed": 5}
        out = http.post("/v1/models", json=body).json()
        model = rebuild(out, http.get(f"/v1/models/{NAME}/versions/1/weights").content).double()
    return {"record": out, "model": model}


@pytest.fixture
def client(live_server: LiveServer) -> Client:
    with Client(live_server.url, api_key=live_server.read_key) as c:
        yield c


def _matrix(model: torch.nn.Module, x1: np.ndarray, x2: np.ndarray | None = None) -> np.ndarray:
    theta = reference_ntk(model, torch.from_numpy(x1), None if x2 is None else torch.from_numpy(x2)).numpy()
    n, m = theta.shape[:2]
    return theta.transpose(0, 2, 1, 3).reshape(n * K, m * K)


def _descend(model, x, xt, labels, lr: float, steps: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """f <- f − η Θ vec((softmax(f) − onehot) / N), and f* with Θ*: the reference kernel, by hand."""
    theta, theta_test = _matrix(model, x), _matrix(model, xt, x)
    with torch.no_grad():
        f = model(torch.from_numpy(x).double()).numpy()
        f_test = model(torch.from_numpy(xt).double()).numpy()
    out = {}
    for s in range(steps + 1):
        out[s] = (f.copy(), f_test.copy())
        p = np.exp(f - f.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        g = ((p - np.eye(K)[labels]) / len(labels)).reshape(-1)
        f, f_test = f - lr * (theta @ g).reshape(f.shape), f_test - lr * (theta_test @ g).reshape(f_test.shape)
    return out


def test_cross_entropy_descent_and_flow_over_http(client: Client, record) -> None:
    rec, model = record["record"], record["model"]
    x, xt = sample_inputs(rec, 6, seed=1), sample_inputs(rec, 3, seed=2)
    labels = np.array([0, 1, 2, 1, 0, 2])
    lr, steps = 3.0, [0, 3, 12]
    out = client.predict(
        NAME, x, labels, xt, times=steps, learning_rate=lr, loss="cross_entropy", flow="gradient_descent"
    )
    want = _descend(model, x, xt, labels, lr, max(steps))
    assert out.test is not None and out.train.shape == (3, 6, K)
    for i, s in enumerate(steps):
        np.testing.assert_allclose(out.train[i], want[s][0], rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(out.test[i], want[s][1], rtol=1e-8, atol=1e-10)
    assert np.max(np.abs(out.train[-1] - out.train[0])) > 1e-3 and out.rtol is None
    flow = client.predict(NAME, torch.from_numpy(x), torch.from_numpy(labels), times=[0.0, 4.0], learning_rate=lr,
                          loss="cross_entropy", mode="trace")  # fmt: skip
    assert flow.rtol == 1e-10 and flow.atol == 1e-12 and "solve_ivp" in flow.path and flow.train.shape == (2, 6, K)


def test_bad_labels_and_plans_get_4xx(live_server: LiveServer, client: Client, record) -> None:
    x = sample_inputs(record["record"], 4, seed=3)
    ce = {"times": [1], "learning_rate": 0.1, "loss": "cross_entropy", "flow": "gradient_descent"}
    with pytest.raises(InvalidInput, match="integer class indices.*got dtype float64") as floats:
        client.predict(NAME, x, np.array([0.0, 1.0, 2.0, 1.0]), **ce)
    assert floats.value.http_status == 422
    with pytest.raises(InvalidInput, match=f"class index 3, outside \\[0, {K}\\)"):
        client.predict(NAME, x, np.array([0, 1, 3, 1]), **ce)
    with pytest.raises(ShapeMismatch, match="one class index per training example, shape \\(4,\\)"):
        client.predict(NAME, x, np.zeros((4, K), dtype=np.int64), **ce)
    with pytest.raises(InvalidInput, match="no t = inf limit"):
        client.predict(NAME, x, np.array([0, 1, 2, 1]), **(ce | {"times": [float("inf")], "flow": "gradient_flow"}))
    with pytest.raises(ResourceLimit, match="multiply-adds, above the limit") as slow:
        client.predict(NAME, x, np.array([0, 1, 2, 1]), **(ce | {"times": [10**12]}))
    assert slow.value.http_status == 413
    with live_server.client("read") as http:  # a raw JSON client, float32 labels
        labels = np.array([0, 1, 2, 1], dtype=np.float32)
        body = {"x_train": tensor_json(x), "y_train": tensor_json(labels), **ce}
        response = http.post(f"/v1/models/{NAME}/predict", json=body)
        assert response.status_code == 422 and "int64 labels" in response.json()["error"]["message"]
        response = http.post(f"/v1/models/{NAME}/predict", json=body | {"loss": "crossentropy"})
        assert response.status_code == 422 and "cross_entropy" in response.json()["error"]["message"]


def test_cli_predict_with_cross_entropy(live_server: LiveServer, client: Client, record, tmp_path) -> None:
    from typer.testing import CliRunner

    from ntk_service.cli import app

    x = sample_inputs(record["record"], 5, seed=4)
    labels = np.array([2, 0, 1, 1, 0])
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "labels.npy", labels)
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.read_key}
    args = ["analyze", "predict", NAME, "--x-train", str(tmp_path / "x.npy"), "--y-train",
            str(tmp_path / "labels.npy"), "--times", "0,2,5", "--learning-rate", "2", "--loss", "cross_entropy",
            "--flow", "gradient_descent", "-o", str(tmp_path / "pred.npz")]  # fmt: skip
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, f"{result.stdout}\n{result.stderr}"
    direct = client.predict(NAME, x, labels, times=[0, 2, 5], learning_rate=2.0, loss="cross_entropy",
                            flow="gradient_descent")  # fmt: skip
    np.testing.assert_array_equal(np.load(tmp_path / "pred.npz")["train"], direct.train)
    np.save(tmp_path / "bad.npy", labels.astype(np.float64))
    bad = CliRunner().invoke(app, [*args[:6], str(tmp_path / "bad.npy"), *args[7:]], env=env)
    assert bad.exit_code != 0 and "integer class indices" in bad.stderr
