"""Typed helpers shared by the server tests: tiny architectures, wire encodings, rebuilding a downloaded model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import safetensors.torch
import torch
from torch import nn

from ntk_service import wire
from ntk_service.registry import build_model
from tests.conftest import SLOW_FACTORY

TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "mlp": {"family": "mlp", "input_dim": 4, "hidden": [8], "output_dim": 3, "activation": "tanh"},
    "cnn": {
        "family": "cnn",
        "input_shape": [1, 5, 5],
        "channels": [2],
        "kernel_size": 3,
        "strides": [1],
        "output_dim": 3,
    },
    "transformer": {
        "family": "transformer",
        "vocab_size": 11,
        "max_len": 5,
        "d_model": 8,
        "n_heads": 2,
        "n_layers": 1,
        "d_ff": 16,
        "output_dim": 2,
    },
}
"""One small model per built-in family (each kernel request takes milliseconds)."""

FORMATS = ("json", "npy", "safetensors")


def sample_inputs(record: dict[str, Any], n: int, *, seed: int) -> np.ndarray:
    """n valid examples for a registered model: floats, or token ids below the vocabulary size."""
    rng = np.random.default_rng(seed)
    shape = (n, *record["input_shape"])
    if record["input_dtype"] == "int64":
        return rng.integers(0, record["architecture"]["vocab_size"], size=shape, dtype=np.int64)
    return rng.standard_normal(shape).astype(np.float32)


def rebuild(record: dict[str, Any], weights: bytes) -> nn.Module:
    """The model of ``record`` with the downloaded safetensors ``weights`` (strict: every name and shape)."""
    model, _ = build_model(record["architecture"], seed=0)
    model.load_state_dict(safetensors.torch.load(weights), strict=True)
    return model.eval()


def tensor_json(array: np.ndarray) -> dict[str, Any]:
    """The wire's JSON tensor object, with plain Python lists (what any JSON client would send)."""
    return {"shape": list(array.shape), "dtype": str(array.dtype), "data": array.reshape(-1).tolist()}


def request_kernel(
    client: httpx.Client,
    name: str,
    x1: np.ndarray,
    x2: np.ndarray | None,
    *,
    fmt: str,
    **options: Any,
) -> httpx.Response:
    """POST /v1/models/{name}/ntk with x1/x2 and the result in ``fmt`` (json, npy, safetensors).

    JSON sends a JSON body; npy sends x1 as an .npy body (x2 must be None); safetensors sends x1 and x2.
    """
    path = f"/v1/models/{name}/ntk"
    if fmt == "json":
        body: dict[str, Any] = {"x1": tensor_json(x1), **options}
        if x2 is not None:
            body["x2"] = tensor_json(x2)
        return client.post(path, json=body)
    accept = wire.MEDIA_NPY if fmt == "npy" else wire.MEDIA_SAFETENSORS
    if fmt == "npy":
        assert x2 is None, "an .npy body holds x1 only"
        content, media = wire.encode_npy(x1), wire.MEDIA_NPY
    else:
        tensors = {"x1": x1} if x2 is None else {"x1": x1, "x2": x2}
        content, media = wire.encode_safetensors(tensors), wire.MEDIA_SAFETENSORS
    return client.post(path, content=content, params=options, headers={"Content-Type": media, "Accept": accept})


def decode_theta(response: httpx.Response) -> tuple[np.ndarray, dict[str, str]]:
    """theta and its metadata from a kernel response of any of the three types."""
    assert response.status_code == 200, response.text
    media = response.headers["content-type"].split(";")[0]
    if media == wire.MEDIA_JSON:
        body = wire.json_loads(response.content)  # orjson, as a real client would
        theta = wire.tensor_from_json(body.pop("theta"), name="theta")
        return theta, {k: str(v) for k, v in body.items()}
    if media == wire.MEDIA_NPY:
        meta = {k[len("x-ntk-") :].replace("-", "_"): v for k, v in response.headers.items() if k.startswith("x-ntk-")}
        return wire.decode_npy(response.content), meta
    tensors, meta = wire.decode_safetensors(response.content)
    return tensors["theta"], meta


def assert_close_to_reference(theta: np.ndarray, reference: torch.Tensor) -> None:
    """float32 results against the float64 reference: relative to the kernel's scale."""
    expected = reference.numpy()
    assert theta.shape == expected.shape
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(theta, expected, rtol=1e-4, atol=1e-5 * scale)


SLOW_JOB_INPUTS = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
"""The 8 examples (8, 4) of ``submit_slow_job``'s data set."""


def submit_slow_job(
    client: httpx.Client, *, delay_s: float, gate: Path | None = None, model: str = "slow"
) -> dict[str, Any]:
    """Register ``model`` (``tests.server.slow_factory``: each forward call waits for the file ``gate`` to exist,
    if given, then sleeps ``delay_s``) and submit a TRACE job over ``SLOW_JOB_INPUTS`` in tiles of 2 (10 tiles, a
    panel each, so the job stops at a tile boundary) with the Jacobian contraction; the 202's job record. The gate
    is open while the model registers and the job is submitted (both run forward passes on a probe example) and
    closed as soon as the 202 is back: the job may have begun its first tile, but cannot finish before the test
    opens the gate again (each tile sleeps ``delay_s`` at least once after it)."""
    kwargs: dict[str, Any] = {"in_dim": 4, "out_dim": 2, "delay_s": delay_s}
    if gate is not None:
        kwargs["gate"] = str(gate)
    arch = {
        "family": "factory",
        "factory": SLOW_FACTORY,
        "kwargs": kwargs,
        "input_shape": [4],
    }
    if gate is not None:
        gate.touch()
    assert client.post("/v1/models", json={"name": model, "architecture": arch}).status_code == 201
    media = {"Content-Type": wire.MEDIA_NPY}
    dataset = client.post("/v1/datasets", content=wire.encode_npy(SLOW_JOB_INPUTS), headers=media)
    assert dataset.status_code == 201, dataset.text
    submitted = client.post(
        "/v1/jobs",
        json={
            "model": model,
            "x1": {"dataset": dataset.json()["id"]},
            "mode": "trace",
            "tile_size": 2,
            "panel_tiles": 1,
            "implementation": "jacobian_contraction",
        },
    )
    if gate is not None:
        gate.unlink()
    assert submitted.status_code == 202, submitted.text
    job: dict[str, Any] = submitted.json()
    return job
