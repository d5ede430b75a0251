"""The lab console: ``GET /`` serves a static page (HTML, CSS, JavaScript shipped in the package, no CDN, nothing
built at install time) that shows the models, data sets and jobs through the same API, under the same keys.

    GET /                      the page (Content-Security-Policy: scripts, styles and requests only from here)
    GET /console/{asset}       its stylesheet and scripts, from a fixed table (never a path the client chose);
                               ``modes.js`` is made from the table of modes (``ntk_service.vocabulary.MODES``)
    GET /v1/whoami             the caller's scope (read key: the page disables what would change something)

The page and its assets carry no data, so they need no key (a browser cannot send a header when it navigates):
the page asks for a key when the API answers 401, keeps it in ``sessionStorage`` and sends it as
``Authorization: Bearer``, never in a URL. Everything it shows comes from the API, under the API's own checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.resources import files
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from ntk_service.errors import NotFound
from ntk_service.server.auth import KeyRing
from ntk_service.server.deps import ReadAccess
from ntk_service.server.media import json_response
from ntk_service.vocabulary import MODES

__all__ = ["ASSETS", "CONTENT_SECURITY_POLICY", "GENERATED", "WhoAmIPublic", "console_file", "modes_js", "router"]

router = APIRouter(tags=["console"])

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",  # no inline script, no eval
        "style-src 'self'",  # no inline <style> or style="" (the scripts set sizes through the CSSOM)
        "img-src 'self' blob: data:",  # the plots are canvases turned into blob: URLs
        "connect-src 'self'",  # fetch() only to this server
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",  # no framing (clickjacking the cancel and delete buttons)
    )
)
"""The page's Content-Security-Policy: nothing it loads or sends leaves this server."""

_SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: an upgraded server's page is seen at the next load
}

ASSETS: dict[str, str] = {
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "format.js": "text/javascript; charset=utf-8",
    "plots.js": "text/javascript; charset=utf-8",
    "views.js": "text/javascript; charset=utf-8",
    "attribution.js": "text/javascript; charset=utf-8",
    "modes.js": "text/javascript; charset=utf-8",
}
"""Every file under ``/console/`` and its media type; anything else is 404."""


def modes_js() -> bytes:
    """``modes.js``: the table of modes as a JavaScript module, so the page reads what each mode is (its axes,
    whether its kernel is a matrix) from the same table as the server, never from a list of its own."""
    table = {
        name: {"shape": spec.shape, "pairs": spec.pairs, "outputs": spec.outputs.value, "matrix": spec.is_matrix}
        for name, spec in MODES.items()
    }
    header = "// Made by the server from ntk_service.vocabulary.MODES (not a file: never edit a copy of it).\n"
    return (header + f"export const MODES = {json.dumps(table)};\n").encode()


GENERATED: dict[str, Callable[[], bytes]] = {"modes.js": modes_js}
"""The assets made by the server rather than read from the package."""

_PAGE = "index.html"

AssetParam = Annotated[str, Path(max_length=64, description="One of the console's files, e.g. console.js.")]


def _unknown(name: str) -> NotFound:
    return NotFound(f"console: no asset {name!r}; the console serves {', '.join(sorted(ASSETS))} under /console/")


def console_file(name: str) -> bytes:
    """The bytes of one of the console's packaged files (``index.html`` or a name in ``ASSETS``).

    Raises:
        NotFound: ``name`` is not one of them.
    """
    if name != _PAGE and name not in ASSETS:
        raise _unknown(name)
    if name in GENERATED:
        return GENERATED[name]()
    return (files("ntk_service.server") / "console" / name).read_bytes()


class WhoAmIPublic(BaseModel):
    """``GET /v1/whoami``: what the caller's key may do."""

    scope: Literal["read", "write"] = Field(description="read: list, show, compute, download; write: also change.")
    open: bool = Field(description="true: the server has no keys configured (every request is allowed).")
    key_id: str = Field(description='A digest prefix of the key (safe to show and log); "open" without keys.')


@router.get("/", include_in_schema=False)
async def console_page() -> Response:
    return Response(console_file(_PAGE), media_type="text/html; charset=utf-8", headers=_SECURITY_HEADERS)


@router.get("/console/{asset}", include_in_schema=False)
async def console_asset(asset: AssetParam) -> Response:
    if asset not in ASSETS:  # the page itself is only at /
        raise _unknown(asset)
    return Response(console_file(asset), media_type=ASSETS[asset], headers=_SECURITY_HEADERS)


@router.get("/v1/whoami", response_model=WhoAmIPublic, summary="The caller's scope (read or write)")
async def whoami(request: Request, principal: ReadAccess) -> Response:
    keyring: KeyRing = request.app.state.keyring
    body = WhoAmIPublic(scope=principal.scope, open=keyring.is_open, key_id=principal.key_id)
    return json_response(body.model_dump(mode="json"))
