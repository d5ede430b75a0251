"""Checks the running container from outside, as a user would; called by docker/smoke-test.sh.

Runs in the project venv on the host (it needs ``ntk_service`` for the client and the engine):

    python docker/smoke_check.py register URL STATE_FILE      # auth, register, kernel vs the engine
    python docker/smoke_check.py after-restart URL STATE_FILE # the model and its kernel survived
    python docker/smoke_check.py ray-job URL STATE_FILE       # a batch job on the compose Ray cluster

Keys come from the env (NTK_SMOKE_READ_KEY, NTK_SMOKE_WRITE_KEY). The kernel is checked against
``compute_ntk`` run here on an MLP built independently (``torch.nn.Sequential``) and loaded with the weights
downloaded from the service, so a wrong architecture, wrong weights or a wrong kernel all fail.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from ntk_service.client import Client
from ntk_service.kernels import compute_ntk

MODEL = "smoke-mlp"
ARCHITECTURE = {"family": "mlp", "input_dim": 3, "hidden": [8], "output_dim": 2, "activation": "relu", "bias": True}
RTOL, ATOL = 1e-9, 1e-12
"""float64 on both sides; only summation order (thread count) may differ."""


def _say(message: str) -> None:
    sys.stdout.write(f"[smoke_check] {message}\n")
    sys.stdout.flush()


def _fail(message: str) -> None:
    sys.stdout.write(f"[smoke_check] FAIL: {message}\n")
    raise SystemExit(1)


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((3, 3)).astype(np.float32)


def _tensor_json(array: np.ndarray) -> dict[str, object]:
    return {"shape": list(array.shape), "dtype": str(array.dtype), "data": array.ravel().tolist()}


def _expect_status(response: httpx.Response, status: int, what: str) -> None:
    if response.status_code != status:
        _fail(f"{what}: expected HTTP {status}, got {response.status_code}: {response.text[:300]}")
    _say(f"{what}: HTTP {status} as expected")


def _engine_theta(weights: dict[str, np.ndarray], record: dict, x1: np.ndarray, x2: np.ndarray) -> np.ndarray:
    """The kernel computed here, on an nn.Sequential built from ARCHITECTURE and the downloaded weights."""
    model = torch.nn.Sequential(
        torch.nn.Linear(ARCHITECTURE["input_dim"], ARCHITECTURE["hidden"][0]),
        torch.nn.ReLU(),
        torch.nn.Linear(ARCHITECTURE["hidden"][0], ARCHITECTURE["output_dim"]),
    ).double()
    served = [(p["name"], tuple(p["shape"])) for p in record["parameters"]]
    local = list(model.named_parameters())
    if [shape for _, shape in served] != [tuple(p.shape) for _, p in local]:
        _fail(f"parameter shapes differ: served {served}, local {[(n, tuple(p.shape)) for n, p in local]}")
    with torch.no_grad():
        for (served_name, _), (_, param) in zip(served, local, strict=True):
            param.copy_(torch.from_numpy(np.asarray(weights[served_name])))
    result = compute_ntk(model, torch.from_numpy(x1), torch.from_numpy(x2), mode="full", dtype="float64")
    return result.theta.numpy()


def register(url: str, state_file: Path) -> None:
    read_key, write_key = os.environ["NTK_SMOKE_READ_KEY"], os.environ["NTK_SMOKE_WRITE_KEY"]
    body = {"name": MODEL, "architecture": ARCHITECTURE, "seed": 0}
    with httpx.Client(base_url=url, timeout=60) as http:
        _expect_status(http.get("/healthz"), 200, "GET /healthz without a key")
        _expect_status(http.post("/v1/models", json=body), 401, "POST /v1/models without a key")
        bearer = {"Authorization": f"Bearer {read_key}"}
        _expect_status(http.post("/v1/models", json=body, headers=bearer), 403, "POST /v1/models, read key")

    with Client(url, api_key=write_key) as writer:
        record = writer.register_model(MODEL, ARCHITECTURE, seed=0)
    _say(f"registered {record['name']} v{record['version']}: {record['num_params']} params")

    x1, x2 = _inputs()
    with Client(url, api_key=read_key) as reader:
        weights = reader.download_weights(MODEL, record["version"])
        theta_binary = np.asarray(reader.ntk(MODEL, x1, x2, mode="full", dtype="float64"))
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {read_key}"}) as http:
        request = {"x1": _tensor_json(x1), "x2": _tensor_json(x2), "mode": "full", "dtype": "float64"}
        response = http.post(f"/v1/models/{MODEL}/ntk", json=request)
        _expect_status(response, 200, f"POST /v1/models/{MODEL}/ntk (JSON)")
        theta_json_field = response.json()["theta"]
        theta_json = np.asarray(theta_json_field["data"], dtype=np.float64).reshape(theta_json_field["shape"])

    expected = _engine_theta(weights, record, x1, x2)
    for label, theta in (("binary", theta_binary), ("JSON", theta_json)):
        if theta.shape != (4, 3, 2, 2):
            _fail(f"{label} kernel has shape {theta.shape}, expected (4, 3, 2, 2)")
        if not np.allclose(theta, expected, rtol=RTOL, atol=ATOL):
            _fail(f"{label} kernel differs from the engine: max |diff| {np.abs(theta - expected).max():.3e}")
        _say(f"{label} kernel (4, 3, 2, 2) matches compute_ntk: max |diff| {np.abs(theta - expected).max():.1e}")

    state = {"record": record, "theta": theta_binary.tolist()}
    state_file.write_text(json.dumps(state))


def after_restart(url: str, state_file: Path) -> None:
    state = json.loads(state_file.read_text())
    before = state["record"]
    with Client(url, api_key=os.environ["NTK_SMOKE_READ_KEY"]) as reader:
        names = [m["name"] for m in reader.list_models()]
        if MODEL not in names:
            _fail(f"after the restart the models are {names}, expected {MODEL!r} among them")
        record = reader.get_model(MODEL)
        x1, x2 = _inputs()
        theta = np.asarray(reader.ntk(MODEL, x1, x2, mode="full", dtype="float64"))
    for field in ("version", "num_params", "weights_sha256", "created_at"):
        if record[field] != before[field]:
            _fail(f"after the restart {field} is {record[field]!r}, was {before[field]!r}")
    _say(f"after restart: {MODEL} v{record['version']} still there, weights_sha256 {record['weights_sha256'][:12]}…")
    previous = np.asarray(state["theta"])
    if not np.allclose(theta, previous, rtol=RTOL, atol=ATOL):
        _fail(f"kernel after the restart differs: max |diff| {np.abs(theta - previous).max():.3e}")
    _say(f"kernel after restart equals the one before (bitwise: {bool(np.array_equal(theta, previous))})")


def ray_job(url: str, state_file: Path) -> None:
    """A batch job on the compose cluster (NTK_EXECUTOR=ray): its kernel must equal compute_ntk run here."""
    write_key = os.environ["NTK_SMOKE_WRITE_KEY"]
    x = np.random.default_rng(1).standard_normal((7, 3)).astype(np.float32)
    with Client(url, api_key=write_key) as writer:
        record = writer.register_model(MODEL, ARCHITECTURE, seed=3)
        dataset = writer.upload_dataset(x, name="smoke")
        weights = writer.download_weights(MODEL, record["version"])
    auth = {"Authorization": f"Bearer {write_key}"}
    with httpx.Client(base_url=url, timeout=60, headers=auth) as http:
        job = {"model": MODEL, "x1": {"dataset": dataset["id"]}, "mode": "full", "dtype": "float64", "tile_size": 3}
        response = http.post("/v1/jobs", json=job)
        _expect_status(response, 202, "POST /v1/jobs (ray executor)")
        job_id = response.json()["id"]
        for _ in range(600):
            status = http.get(f"/v1/jobs/{job_id}").json()
            if status["status"] in {"succeeded", "failed", "cancelled"}:
                break
            time.sleep(0.5)
        if status["status"] != "succeeded":
            _fail(f"job {job_id} ended {status['status']!r}: {status.get('error')}")
        _say(f"job {job_id}: {status['tiles_done']}/{status['tiles_total']} tiles on the Ray cluster")
        result = http.get(f"/v1/jobs/{job_id}/result", headers={"Accept": "application/json"})
        _expect_status(result, 200, "GET /v1/jobs/{id}/result")
        field = result.json()["theta"]
        theta = np.asarray(field["data"], dtype=np.float64).reshape(field["shape"])
    expected = _engine_theta(weights, record, x, x)
    if theta.shape != expected.shape or not np.allclose(theta, expected, rtol=RTOL, atol=ATOL):
        _fail(f"job kernel {theta.shape} differs from compute_ntk {expected.shape}")
    _say(f"job kernel {theta.shape} matches compute_ntk: max |diff| {np.abs(theta - expected).max():.1e}")
    state_file.write_text(json.dumps({"job": job_id}))


def main(argv: list[str]) -> None:
    commands = {"register": register, "after-restart": after_restart, "ray-job": ray_job}
    if len(argv) != 3 or argv[0] not in commands:
        _fail(f"usage: smoke_check.py {{{'|'.join(commands)}}} URL STATE_FILE; got {argv}")
    commands[argv[0]](argv[1], Path(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1:])
