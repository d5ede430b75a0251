"""``/docs`` (Swagger UI) and ``/redoc`` from assets shipped in a Python package, so they work offline.

FastAPI's own pages load their JavaScript and CSS from a CDN: blank in a lab without internet, even though the
image builds offline. The assets here come from the ``fastapi-offline`` package (Swagger UI, Apache-2.0; ReDoc,
MIT; the package itself MIT), installed with the server extra and served under ``/docs/assets``; the pages
reference nothing outside this server.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

__all__ = ["ASSETS_URL", "assets_dir", "install_docs"]

ASSETS_URL = "/docs/assets"
"""Where the Swagger UI and ReDoc files are served."""

_OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"


def assets_dir() -> Path:
    """The directory holding ``swagger-ui-bundle.js``, ``swagger-ui.css``, ``redoc.standalone.js``, ``favicon.png``."""
    return Path(str(files("fastapi_offline") / "static"))


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs``, ``/redoc`` and their assets on ``app`` (create it with ``docs_url=None, redoc_url=None``)."""
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")
    router = APIRouter(include_in_schema=False)

    @router.get("/docs")
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{_OAUTH2_REDIRECT_URL}",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            # Swagger UI would otherwise ask validator.swagger.io for a badge: no request leaves this server.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @router.get(_OAUTH2_REDIRECT_URL)
    async def swagger_ui_oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @router.get("/redoc")
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )

    app.include_router(router)
