"""The floor of the HTTP stack the service runs on: a bare ASGI app for uvicorn that reads the request body and
answers ``?bytes=B`` zero bytes, with no FastAPI, middleware, auth, registry, engine or thread hop.

``bench_exported_kernels.py --parts http`` times it beside the service with the same bytes each way (x1 and x2 in,
theta out) through the same httpx client stack, so HTTP / library has a best case with this stack beside it:
(library + this round trip) / library.

    .venv/bin/python -m uvicorn _bare_asgi:app --app-dir benchmarks --port 8001 --log-level warning
"""

from __future__ import annotations

from typing import Any

_PAYLOADS: dict[int, bytes] = {}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:  # the whole body read, as a route that decodes it does
        message = await receive()
        more = message.get("more_body", False)
    query = dict(part.split(b"=", 1) for part in scope["query_string"].split(b"&") if b"=" in part)
    size = int(query.get(b"bytes", b"0"))
    payload = _PAYLOADS.setdefault(size, bytes(size))
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
