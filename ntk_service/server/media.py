"""Content negotiation: request bodies by ``Content-Type``, responses by ``Accept``, and the body-size limit.

Bodies are read and decoded here with the ``wire`` codecs (never through pydantic for tensors); responses are
encoded with ``wire.json_dumps`` (orjson) or the binary codecs. Every failure is a domain error, so the client
sees 400 (unparsable), 406 (no acceptable response type), 413 (too large) or 415 (wrong Content-Type).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio.to_thread
import numpy as np
from fastapi import Request
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ntk_service import wire
from ntk_service.errors import (
    InvalidInput,
    NotAcceptable,
    NtkServiceError,
    PayloadTooLarge,
    UnsupportedMediaType,
    format_bytes,
    operation_name,
)
from ntk_service.server.error_responses import error_response

__all__ = [
    "BINARY_TENSOR_TYPES",
    "MIN_JSON_BYTES_PER_VALUE",
    "BodyLimitMiddleware",
    "collection_response",
    "encode_theta",
    "json_too_large",
    "content_type",
    "json_response",
    "negotiate",
    "parse_off_loop",
    "take_tensor",
    "wire_detail",
    "read_json",
    "read_tensors",
    "require_content_type",
]

MIN_JSON_BYTES_PER_VALUE = 4
"""The shortest a float can be in JSON data ("0.0,"): an answer whose value count times this exceeds the JSON cap
is refused before computing; otherwise the encoded length decides."""

BINARY_TENSOR_TYPES = (wire.MEDIA_NPY, wire.MEDIA_SAFETENSORS)
"""Binary media types a tensor body or response may use."""

PARSE_INLINE_MAX_BYTES = 1 << 20
"""Bodies below 1 MiB are parsed on the event loop (well under a millisecond); larger ones in a worker thread."""

T = TypeVar("T")


def content_type(request: Request) -> str:
    """The request's media type without parameters, lower case; ``""`` when absent."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def require_content_type(request: Request, allowed: Sequence[str], *, operation: str | None = None) -> str:
    """The request's media type if it is one of ``allowed``.

    Args:
        operation: names the error here; None: the route's boundary does (NOTE [operation names] in errors.py).
            The same holds for every ``operation`` argument of this module.

    Raises:
        UnsupportedMediaType: missing or other Content-Type (415), naming the allowed ones.
    """
    media = content_type(request)
    if media not in allowed:
        got = repr(media) if media else "no Content-Type"
        with operation_name(operation):
            raise UnsupportedMediaType(
                detail=f"expected Content-Type {' or '.join(allowed)}, got {got}; "
                "set the Content-Type header to match the body"
            )
    return media


def wire_detail(decode: Callable[[], T]) -> T:
    """``decode()``, a wire codec given the name of what it decodes ("body", "x1"): its errors, which start with
    that name, become details the operation's boundary names (NOTE [operation names] in errors.py)."""
    try:
        return decode()
    except NtkServiceError as exc:
        raise exc.leave_operation() from None


async def parse_off_loop(fn: Callable[[], T], *, size: int) -> T:
    """``fn()`` (a parser of ``size`` input bytes) inline when small, else in a worker thread.

    Parsing a large body (a 100 MB JSON tensor takes ~1 s) on the event loop would stall every other request,
    /healthz included; a thread hop costs ~0.1 ms, so small bodies stay inline.
    """
    if size < PARSE_INLINE_MAX_BYTES:
        return fn()
    return await anyio.to_thread.run_sync(fn)


async def read_json(request: Request, *, operation: str | None = None) -> Any:
    """The parsed JSON body (orjson).

    Raises:
        UnsupportedMediaType: Content-Type is not application/json (415).
        MalformedRequest: the body is not valid JSON (400).
    """
    if operation is not None:  # a caller that names its operation here
        with operation_name(operation):
            return await read_json(request)
    require_content_type(request, (wire.MEDIA_JSON,))
    body = await request.body()
    return await parse_off_loop(lambda: wire_detail(lambda: wire.json_loads(body, name="body")), size=len(body))


async def read_tensors(request: Request, *, npy_name: str, operation: str | None = None) -> dict[str, np.ndarray]:
    """Named arrays from an ``application/x-npy`` body (one array, named ``npy_name``) or a safetensors body.

    Raises:
        UnsupportedMediaType: another Content-Type (415).
        MalformedRequest: the body cannot be decoded (400).
        InvalidInput: a dtype that cannot travel on the wire (422).
    """
    if operation is not None:  # a caller that names its operation here
        with operation_name(operation):
            return await read_tensors(request, npy_name=npy_name)
    media = require_content_type(request, BINARY_TENSOR_TYPES)
    body = await request.body()

    def decode() -> dict[str, np.ndarray]:
        if media == wire.MEDIA_NPY:
            return {npy_name: wire.decode_npy(body, name="body")}
        return wire.decode_safetensors(body, name="body")[0]

    return await parse_off_loop(lambda: wire_detail(decode), size=len(body))


def take_tensor(tensors: dict[str, np.ndarray], name: str, *, operation: str | None = None) -> np.ndarray:
    """Remove and return ``tensors[name]``.

    Raises:
        InvalidInput: the tensor is missing (422), naming the tensors that came.
    """
    array = tensors.pop(name, None)
    if array is None:
        with operation_name(operation):
            raise InvalidInput(
                detail=f"the safetensors body has no tensor {name!r} (it has {sorted(tensors) or 'none'}); "
                f"name the tensor {name!r}"
            )
    return array


def _parse_accept(header: str) -> list[tuple[str, float]]:
    ranges: list[tuple[str, float]] = []
    for part in header.split(","):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        if not media:
            continue
        q = 1.0
        for param in fields[1:]:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        ranges.append((media, q))
    return ranges


def _quality(offer: str, ranges: list[tuple[str, float]]) -> float:
    """q of the most specific range matching ``offer`` (exact beats ``type/*`` beats ``*/*``)."""
    kind = offer.split("/", 1)[0]
    best: tuple[int, float] | None = None
    for media, q in ranges:
        specificity = 2 if media == offer else 1 if media == f"{kind}/*" else 0 if media == "*/*" else -1
        if specificity >= 0 and (best is None or specificity > best[0]):
            best = (specificity, q)
    return best[1] if best is not None else 0.0


def negotiate(request: Request, offered: Sequence[str], *, operation: str | None = None) -> str:
    """The response media type: the offered type the client's ``Accept`` ranks highest (ties: offer order).

    Args:
        request: the request whose ``Accept`` header is read; absent or empty means ``offered[0]``.
        offered: media types this route can produce, preferred first.
        operation: names the route in the error message (None: the route's boundary does).

    Raises:
        NotAcceptable: no offered type is acceptable (406), naming the offered ones.
    """
    header = request.headers.get("accept", "").strip()
    if not header:
        return offered[0]
    ranges = _parse_accept(header)
    scored = [(_quality(offer, ranges), -i, offer) for i, offer in enumerate(offered)]
    q, _, best = max(scored)
    if q <= 0:
        with operation_name(operation):
            raise NotAcceptable(
                detail=f"cannot produce any of Accept: {header!r}; this route offers {', '.join(offered)}"
            )
    return best


def json_response(content: Any, *, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``content`` serialized by orjson (numpy arrays written natively) as an application/json response."""
    return Response(wire.json_dumps(content), status_code=status_code, media_type=wire.MEDIA_JSON, headers=headers)


def collection_response(items: Sequence[Any]) -> Response:
    """A list route's body: ``{"data": [...], "count": len(data)}`` (the ``XsPublic`` shape)."""
    return json_response({"data": list(items), "count": len(items)})


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with 413 and the usual JSON error body.

    A declared ``Content-Length`` over the limit is answered before the body is read; a chunked body is
    counted as it arrives and the read fails with ``PayloadTooLarge``, which the error handlers render.
    (FastAPI's own ``max_body_size`` answers plain text, and rewrites any response to an over-long request
    into it.)
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self, size: str) -> str:
        return (
            f"request body of {size} exceeds the server's limit of {format_bytes(self.max_bytes)} "
            "(NTK_MAX_BODY_BYTES); upload large inputs as a data set in several parts, or ask the operator"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(413, "payload_too_large", self._message(format_bytes(int(declared))))
            await response(scope, receive, send)
            return
        received = 0

        async def receive_with_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise PayloadTooLarge(self._message(f"more than {format_bytes(self.max_bytes)}"))
            return message

        await self.app(scope, receive_with_limit, send)


def json_too_large(size: str, cap: int, *, hint: str = "", operation: str | None = None) -> NotAcceptable:
    """The 406 for a JSON kernel over ``NTK_MAX_JSON_RESPONSE_BYTES``, pointing to the binary types."""
    error = NotAcceptable(
        detail=f"the JSON response would be {size}, over the server's JSON limit of {format_bytes(cap)} "
        f"(NTK_MAX_JSON_RESPONSE_BYTES); send 'Accept: {wire.MEDIA_NPY}' or 'Accept: {wire.MEDIA_SAFETENSORS}'" + hint
    )
    if operation is not None:
        error.name_operation(operation)
    return error


def encode_theta(
    theta: np.ndarray, media: str, meta: dict[str, Any], *, cap: int, hint: str = "", operation: str | None = None
) -> Response:
    """A kernel (or a block of one) as ``media``: ``.npy`` with ``X-NTK-*`` headers, safetensors (tensor ``theta``,
    metadata as strings) or JSON ``{"theta": tensor, **meta}`` (406 over ``cap`` bytes)."""
    if media == wire.MEDIA_NPY:
        headers = {f"X-NTK-{key.replace('_', '-').title()}": str(value) for key, value in meta.items()}
        return Response(wire.encode_npy(theta), media_type=media, headers=headers)
    if media == wire.MEDIA_SAFETENSORS:
        metadata = {key: str(value) for key, value in meta.items()}
        return Response(wire.encode_safetensors({"theta": theta}, metadata), media_type=media)
    body = wire.json_dumps({"theta": wire.tensor_to_json(theta), **meta})
    if len(body) > cap:
        raise json_too_large(format_bytes(len(body)), cap, operation=operation, hint=hint)
    return Response(body, media_type=wire.MEDIA_JSON)
