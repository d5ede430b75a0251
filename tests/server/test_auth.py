"""The auth matrix against a real server: no key 401, wrong key 401, read key on a write route 403.

An open server (no keys) is exercised in test_compute.py."""

from __future__ import annotations

import pytest

from tests.conftest import LiveServer

READ_ROUTES = [("GET", "/v1/models"), ("GET", "/v1/datasets"), ("GET", "/v1/architectures")]
WRITE_ROUTES = [("POST", "/v1/models"), ("DELETE", "/v1/models/anything"), ("POST", "/v1/datasets")]


@pytest.mark.parametrize(("method", "path"), READ_ROUTES + WRITE_ROUTES)
def test_no_key_is_401_with_bearer_challenge(live_server: LiveServer, method: str, path: str) -> None:
    with live_server.client(None) as client:
        response = client.request(method, path)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "unauthenticated"
    assert "no API key; send 'Authorization: Bearer <key>'" in error["message"]


@pytest.mark.parametrize(("method", "path"), READ_ROUTES + WRITE_ROUTES)
def test_wrong_key_is_401(live_server: LiveServer, method: str, path: str) -> None:
    with live_server.client("not-a-key") as client:
        response = client.request(method, path)
    assert response.status_code == 401
    assert response.json()["error"] == {
        "type": "unauthenticated",
        "message": f"{method} {path}: the API key is not valid; check the key you were given",
    }


@pytest.mark.parametrize("header", ["Basic {key}", "{key}", "Token {key}", "Bearer", "bearer"])
def test_non_bearer_scheme_is_401_naming_the_form_expected(live_server: LiveServer, header: str) -> None:
    with live_server.client(None) as client:
        response = client.get("/v1/models", headers={"Authorization": header.format(key=live_server.read_key)})
    assert response.status_code == 401
    message = response.json()["error"]["message"]
    assert message.startswith("GET /v1/models: the Authorization header is not of the form 'Bearer <key>'; send")
    assert live_server.read_key not in message  # what was sent may hold the key: never echoed


@pytest.mark.parametrize(("method", "path"), WRITE_ROUTES)
def test_read_key_on_write_route_is_403(live_server: LiveServer, method: str, path: str) -> None:
    with live_server.client("read") as client:
        response = client.request(method, path)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "permission_denied"
    assert "needs a key with 'write' scope, this key has 'read'" in error["message"]


@pytest.mark.parametrize("key", ["read", "write"])
@pytest.mark.parametrize(("method", "path"), READ_ROUTES)
def test_read_and_write_keys_may_read(live_server: LiveServer, key: str, method: str, path: str) -> None:
    with live_server.client(key) as client:
        assert client.request(method, path).status_code == 200


def test_auth_is_checked_before_the_body_is_read(live_server: LiveServer) -> None:
    with live_server.client("read") as client:
        response = client.post("/v1/models", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 403


def test_health_and_metrics_need_no_key(live_server: LiveServer) -> None:
    with live_server.client(None) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        assert client.get("/metrics").status_code == 200
