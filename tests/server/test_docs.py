"""``/docs`` and ``/redoc`` work with no network beyond the server: the pages reference only the server's own
paths, and every script, stylesheet and icon they reference is served by it."""

from __future__ import annotations

import re

import pytest

from ntk_service.server.docs import assets_dir
from tests.conftest import LiveServer


@pytest.mark.parametrize(("page", "script"), [("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")])
def test_docs_pages_load_everything_from_the_server(live_server: LiveServer, page: str, script: str) -> None:
    with live_server.client(None) as client:
        html = client.get(page)
        assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
        assert not re.search(r"https?://", html.text), f"{page} references another host:\n{html.text}"
        references = re.findall(r'(?:src|href|spec-url)="([^"]+)"', html.text) + re.findall(
            r"url: '([^']+)'", html.text
        )
        assert any(ref.endswith(script) for ref in references), references
        for ref in references:
            assert ref.startswith("/"), f"{page}: {ref} is not on this server"
            response = client.get(ref)
            assert response.status_code == 200, (ref, response.status_code)
            if ref.endswith(".js"):
                assert "javascript" in response.headers["content-type"]
                assert response.content == (assets_dir() / ref.rsplit("/", 1)[1]).read_bytes()
            elif ref.endswith(".css"):
                assert response.headers["content-type"].startswith("text/css") and len(response.content) > 10_000
            elif ref == "/openapi.json":
                assert response.json()["info"]["title"] == "ntk-service"
    if page == "/docs":
        assert "validatorUrl" in html.text and '"validatorUrl": null' in html.text


def test_docs_pages_are_not_in_the_api_document(live_server: LiveServer) -> None:
    with live_server.client(None) as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith(("/docs", "/redoc"))]
