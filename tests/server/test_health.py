"""Liveness, readiness, metrics and the OpenAPI document."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from ntk_service.config import Settings
from ntk_service.server import create_app
from tests.conftest import LiveServer


def test_healthz_and_readyz(live_server: LiveServer) -> None:
    with live_server.client(None) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").json() == {"status": "ready", "device": "cpu"}


def test_readyz_is_503_until_the_lifespan_has_opened_the_registry(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path, api_keys="k:read"))

    async def probe() -> tuple[httpx.Response, ...]:
        transport = httpx.ASGITransport(app=app)  # runs no lifespan: the app has not started
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            ready = await client.get("/readyz")
            models = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
            return ready, models, await client.get("/healthz")

    ready, models, alive = anyio.run(probe)
    assert ready.status_code == 503
    assert ready.headers["retry-after"] == "1"
    assert ready.json()["error"]["type"] == "service_unavailable"
    assert models.status_code == 503
    assert "the server is not ready (starting or stopping)" in models.json()["error"]["message"]
    assert alive.status_code == 200


def test_metrics_count_requests_by_route_template(live_server: LiveServer) -> None:
    with live_server.client("read") as client:
        for name in ("one", "two"):
            client.get(f"/v1/models/metrics-{name}")  # 404s, same template
        text = client.get("/metrics").text
    assert 'ntk_http_requests_total{method="GET",route="/v1/models/{name}",status="404"}' in text
    assert "metrics-one" not in text  # raw paths never become labels
    assert "ntk_http_request_duration_seconds_bucket" in text
    assert "ntk_kernel_computes_in_flight" in text
    assert "ntk_side_cache_bytes" in text


def test_metrics_after_a_kernel(live_server: LiveServer) -> None:
    with live_server.client("write") as client:
        client.post(
            "/v1/models",
            json={
                "name": "metrics-mlp",
                "architecture": {"family": "mlp", "input_dim": 2, "hidden": [], "output_dim": 1},
            },
        )
        x1 = {"shape": [1, 2], "dtype": "float32", "data": [1.0, 2.0]}
        assert client.post("/v1/models/metrics-mlp/ntk", json={"x1": x1, "mode": "trace"}).status_code == 200
        text = client.get("/metrics").text
    assert 'ntk_kernel_compute_seconds_count{implementation="' in text
    assert 'mode="trace"' in text


@pytest.mark.parametrize(
    "path",
    ["/v1/models", "/v1/models/{name}/ntk", "/v1/datasets", "/v1/architectures", "/v1/models/{name}/versions"],
)
def test_openapi_documents_the_api(live_server: LiveServer, path: str) -> None:
    with live_server.client(None) as client:
        spec = client.get("/openapi.json").json()
        docs = client.get("/docs")
    assert docs.status_code == 200
    assert path in spec["paths"]


def test_openapi_documents_the_kernel_body_types(live_server: LiveServer) -> None:
    with live_server.client(None) as client:
        spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/models/{name}/ntk"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/x-safetensors", "application/x-npy"}
    assert "x1" in body["application/json"]["schema"]["properties"]
