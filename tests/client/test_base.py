"""``Client()`` takes the server URL and the API key from ``NTK_URL`` / ``NTK_API_KEY`` when they are not given,
so keys stay out of notebooks; explicit arguments win."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.client import API_KEY_ENV, DEFAULT_URL, URL_ENV, Client
from ntk_service.errors import InvalidInput


def _seen(*args: str, **kwargs: str) -> httpx.Request:
    """The request ``Client(*args, **kwargs).health()`` sends."""
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, json={"status": "ok"})

    with Client(*args, transport=httpx.MockTransport(handler), **kwargs) as client:  # type: ignore[arg-type]
        client.health()
    return requests[0]


def test_environment_supplies_url_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(URL_ENV, "http://ntk.example:9000/")
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    request = _seen()
    assert str(request.url) == "http://ntk.example:9000/healthz"
    assert request.headers["authorization"] == "Bearer env-key"


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(URL_ENV, "http://ntk.example:9000")
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    request = _seen("http://other:1", api_key="arg-key")
    assert str(request.url) == "http://other:1/healthz" and request.headers["authorization"] == "Bearer arg-key"


def test_without_environment_the_default_url_and_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(URL_ENV, raising=False)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    request = _seen()
    assert str(request.url) == f"{DEFAULT_URL}/healthz" and "authorization" not in request.headers


@pytest.mark.parametrize("key", ["clé-secrète", "tab\tkey"])
def test_a_key_a_header_cannot_carry_is_refused_with_what_to_fix(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidInput, match="api_key has a non-ASCII or control character at position [34]; .* ASCII"):
        Client("http://ntk.example:9000", api_key=key)
    monkeypatch.setenv(API_KEY_ENV, key)
    with pytest.raises(InvalidInput, match=f"{API_KEY_ENV} has a non-ASCII or control character"):
        Client("http://ntk.example:9000")
    # The CLI prints it as one line (the client is built on the first command that talks to a server).
    result = CliRunner().invoke(app, ["--url", "http://127.0.0.1:9", "--api-key", key, "models", "list"])
    assert result.exit_code == 1 and result.stderr.startswith("error: invalid_input: Client: api_key has a non-ASCII")


def test_info_returns_the_server_record() -> None:
    body = {"version": "0.1.0", "torch": "2.13.0+cpu", "executor": "local", "device": "cpu", "limits": {}}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/info"
        return httpx.Response(200, json=body)

    with Client("http://ntk.test", transport=httpx.MockTransport(handler)) as client:
        assert client.info() == body


def test_wait_raises_timeout_error_when_the_job_is_still_running() -> None:
    running = {"id": "j1", "status": "running", "tiles_done": 1, "tiles_total": 4, "progress": 0.25, "eta_s": 9.0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            body = b"event: progress\ndata: " + json.dumps(running).encode() + b"\n\n"
            return httpx.Response(200, content=body, headers={"Content-Type": "text/event-stream"})
        return httpx.Response(200, json=running)

    with Client("http://ntk.test", transport=httpx.MockTransport(handler)) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="wait: job j1 still running after 0.3 s"):
            client.wait("j1", timeout=0.3, progress=False)
        assert time.monotonic() - start < 5
