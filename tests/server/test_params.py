"""Integers beyond 64 bits and over-long strings are refused at the edge with 422, in every place a client can
put them (path, query, JSON body), instead of reaching SQLite or numpy and answering 500."""

from __future__ import annotations

from typing import Any

import pytest

from ntk_service import wire
from tests.conftest import LiveServer
from tests.server.support import TINY_ARCHITECTURES

BIG = 737519074028756018397184
"""Beyond 64 bits (the path the fuzzer found)."""

JUST_OVER = 2**63
"""One past int64: still a u64, so JSON parsers and pydantic take it; SQLite overflowed."""


@pytest.fixture(scope="module")
def model(live_server: LiveServer) -> str:
    with live_server.client("write") as client:
        response = client.post("/v1/models", json={"name": "bounds-mlp", "architecture": TINY_ARCHITECTURES["mlp"]})
        assert response.status_code == 201, response.text
    return "bounds-mlp"


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "field"),
    [
        ("GET", "/v1/models/{m}/versions/{BIG}/weights", {}, "version"),
        ("GET", "/v1/models/{m}/versions/{JUST_OVER}", {}, "version"),
        ("POST", "/v1/jobs", {"json": {"model": "{m}", "version": JUST_OVER, "x1": {"dataset": "d"}}}, "version"),
        (
            "POST",
            "/v1/models",
            {"json": {"name": "b2", "architecture": TINY_ARCHITECTURES["mlp"], "seed": JUST_OVER}},
            "seed",
        ),
        ("POST", "/v1/models/{m}/ntk", {"json": {"x1": {"dataset": "d", "start": JUST_OVER}}}, "start"),
        ("POST", "/v1/models/{m}/ntk", {"json": {"x1": {"dataset": "d"}, "version": JUST_OVER}}, "version"),
        (
            "POST",
            f"/v1/models/{{m}}/ntk?version={JUST_OVER}",
            {"content": b"", "headers": {"Content-Type": wire.MEDIA_NPY}},
            "version",
        ),
        ("GET", "/v1/datasets/" + "d" * 200, {}, "dataset_id"),
        ("GET", "/v1/jobs/x/result?rows=" + "1" * 300, {}, "rows"),
        ("POST", "/v1/models/{m}/ntk", {"json": {"x1": {"dataset": "d"}, "params": ["p" * 300]}}, "params"),
        # the kernel family, analysis and job-analysis routes
        ("POST", "/v1/models/" + "n" * 200 + "/nngp", {"json": {"x1": {"dataset": "d"}}}, "name"),
        ("POST", "/v1/models/{m}/nngp", {"json": {"x1": {"dataset": "d"}, "version": JUST_OVER}}, "version"),
        ("POST", "/v1/models/{m}/nngp", {"json": {"x1": {"dataset": "d"}, "layer": "l" * 300}}, "layer"),
        ("POST", "/v1/models/{m}/monte_carlo", {"json": {"x1": {"dataset": "d"}, "seeds": [JUST_OVER]}}, "seeds"),
        (
            "POST",
            "/v1/models/{m}/operator/matvec",
            {"json": {"x1": {"dataset": "d"}, "v": {"dataset": "d"}, "params": ["p" * 300]}},
            "params",
        ),
        ("POST", "/v1/models/{m}/spectrum", {"json": {"x": {"dataset": "d"}, "top": JUST_OVER}}, "top"),
        ("POST", "/v1/models/{m}/compare", {"json": {"x": {"dataset": "d"}, "versions": [JUST_OVER]}}, "versions"),
        (
            "POST",
            "/v1/models/{m}/compare",
            {"json": {"x": {"dataset": "d"}, "versions": [{"model": "m" * 200}]}},
            "model",
        ),
        ("POST", "/v1/jobs/x/spectrum", {"json": {"top": JUST_OVER}}, "top"),
        ("POST", "/v1/jobs/x/distance", {"json": {"other": "o" * 200}}, "other"),
    ],
)
def test_out_of_range_inputs_get_422(
    live_server: LiveServer, model: str, method: str, path: str, kwargs: dict[str, Any], field: str
) -> None:
    def fill(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("{m}", model).replace("{BIG}", str(BIG)).replace("{JUST_OVER}", str(JUST_OVER))
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return value

    with live_server.client("write") as client:
        response = client.request(method, fill(path), **fill(kwargs))
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_input" and field in error["message"], error
