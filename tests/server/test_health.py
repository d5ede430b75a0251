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


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_operator_metrics_process_build_cache_and_jobs(live_server: LiveServer) -> None:
    import time

    import numpy as np
    import torch

    from ntk_service import __version__, wire

    arch = {"family": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 2}
    with live_server.client("write") as client:
        assert client.post("/v1/models", json={"name": "ops-mlp", "architecture": arch}).status_code == 201
        x = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
        dataset = client.post("/v1/datasets", content=wire.encode_npy(x), headers={"Content-Type": wire.MEDIA_NPY})
        ref = {"dataset": dataset.json()["id"]}
        before = _samples(client.get("/metrics").text)
        for _ in range(2):  # the second request reuses the first one's side from the cache
            assert client.post("/v1/models/ops-mlp/ntk", json={"x1": ref, "mode": "trace"}).status_code == 200
        job = client.post("/v1/jobs", json={"model": "ops-mlp", "x1": ref, "mode": "trace", "tile_size": 2}).json()
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{job['id']}").json()["status"] != "succeeded":
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(0.2)
        after = _samples(client.get("/metrics").text)

    def delta(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert after[("process_resident_memory_bytes", ())] > 50 * 2**20  # torch alone is bigger
    assert after[("process_cpu_seconds_total", ())] > 0
    build = [labels for name, labels in after if name == "ntk_build_info"]
    assert build == [(("torch", torch.__version__), ("version", __version__))]
    assert delta("ntk_side_cache_hits_total") >= 1 and delta("ntk_side_cache_misses_total") >= 1
    assert after[("ntk_jobs", (("status", "succeeded"),))] >= 1
    assert {labels for name, labels in after if name == "ntk_jobs"} == {
        (("status", s),) for s in ("queued", "running", "succeeded", "failed", "cancelled")
    }
    assert delta("ntk_job_tiles_done") >= job["tiles_total"] == 3  # 4 examples in tiles of 2: the upper triangle
    assert delta("ntk_job_tile_seconds") > 0


def test_info_names_versions_limits_executor_and_device(live_server: LiveServer) -> None:
    import platform

    import torch

    from ntk_service import __version__

    with live_server.client("read") as client:
        info = client.get("/v1/info").json()
    with live_server.client(None) as anonymous:
        assert anonymous.get("/v1/info").status_code == 401
    assert (info["version"], info["torch"], info["python"]) == (
        __version__,
        torch.__version__,
        platform.python_version(),
    )
    assert (info["executor"], info["device"]) == ("local", "cpu")
    assert info["limits"]["max_body_bytes"] == 2 * 2**20  # the live server's NTK_MAX_BODY_BYTES
    assert info["limits"]["max_json_response_bytes"] == 64 * 2**10
    assert info["limits"]["memory_budget_bytes"] == 256 * 2**20
