"""The HTTP plumbing every client method shares: timeouts, auth, retries on 429/503, error mapping, decoding.

Resource methods (``Client``, and mixins such as the jobs methods) only build a request and read its decoded
body; everything that touches httpx lives here, so HTTP errors are translated to ``ntk_service.errors`` in one
place (house style rule 14) and no httpx exception reaches a caller.
"""

from __future__ import annotations

import email.utils
import math
import os
import time
from collections.abc import Mapping
from typing import Any, Literal, Self

import httpx
import numpy as np

from ntk_service import __version__, wire
from ntk_service._tensors import is_torch_tensor
from ntk_service.errors import (
    Busy,
    DiskEstimateExceeded,
    InvalidInput,
    MemoryEstimateExceeded,
    NtkServiceError,
    ServiceUnavailable,
    error_class_for,
)

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_MAX_RETRY_WAIT_S",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_URL",
    "URL_ENV",
    "BaseClient",
    "TransportFormat",
    "url_from_environment",
]

TransportFormat = Literal["safetensors", "npy", "json"]
"""How tensors travel: safetensors (default: named tensors + metadata in one body), npy (one array), json."""

DEFAULT_URL = "http://127.0.0.1:8000"
"""Where ``Client()`` connects when neither ``url`` nor ``NTK_URL`` says otherwise (``ntk-service serve``'s default)."""

URL_ENV = "NTK_URL"
"""Environment variable ``Client()`` takes the server URL from when ``url`` is not given (the CLI reads it too)."""

_BIND_ALL = frozenset({"", "0.0.0.0", "::", "[::]"})
"""Hosts a server binds to listen everywhere: a client on the same machine connects through loopback."""


def url_from_environment(environ: Mapping[str, str]) -> str:
    """The server URL a client uses when none is given: ``NTK_URL``; else the address ``ntk-service serve`` binds
    from ``NTK_HOST`` / ``NTK_PORT`` (loopback for a server listening everywhere); else ``DEFAULT_URL``.

    So ``NTK_PORT=9000 make serve`` and a client in a shell with the same variables find each other.

    Args:
        environ (Mapping[str, str]): the environment, e.g. ``os.environ``.

    Returns:
        str: e.g. ``"http://127.0.0.1:9000"``.
    """
    if environ.get(URL_ENV):
        return environ[URL_ENV]
    host, port = environ.get("NTK_HOST", "").strip(), environ.get("NTK_PORT", "").strip()
    if not host and not port:
        return DEFAULT_URL
    host = "127.0.0.1" if host in _BIND_ALL else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{host}:{port or 8000}"


API_KEY_ENV = "NTK_API_KEY"
"""Environment variable ``Client()`` takes the API key from when ``api_key`` is not given: keys stay out of
notebooks."""

DEFAULT_TIMEOUT_S = 600.0
"""Read timeout: a kernel over a few thousand examples legitimately takes minutes on a CPU server."""

DEFAULT_CONNECT_TIMEOUT_S = 5.0
"""Connect timeout: a server that does not accept a connection in 5 s is down or unreachable."""

DEFAULT_MAX_RETRIES = 3
"""Retries after 429/503 before giving up; the server answers those only when it did not start the work."""

DEFAULT_MAX_RETRY_WAIT_S = 30.0
"""Longest single wait a ``Retry-After`` may impose; asking for more counts as not coming back soon."""

_FALLBACK_BACKOFF_S = 0.5
"""First wait when a 429/503 carries no ``Retry-After``; doubles per attempt."""

_RETRY_STATUSES = frozenset({429, 503})

_sleep = time.sleep  # a module attribute so tests can observe waits without sleeping


def _check_header_safe(api_key: str, *, source: str) -> None:
    """Refuse a key httpx could not send: header values are printable ASCII (servers refuse other keys too)."""
    bad = next((i for i, char in enumerate(api_key) if not " " <= char <= "~"), None)
    if bad is not None:
        raise InvalidInput(
            f"Client: {source} has a non-ASCII or control character at position {bad + 1}; an API key travels in "
            "the Authorization header, which carries only printable ASCII: check the key for a typo or a pasted "
            "character (servers accept only ASCII keys)"
        )


class BaseClient:
    """Owns the ``httpx.Client`` and turns responses into Python values or ``ntk_service.errors`` exceptions.

    Args:
        url (str | None): the server's base URL, e.g. ``"http://127.0.0.1:8000"``. Default: ``$NTK_URL``, else
            ``http://$NTK_HOST:$NTK_PORT`` when either is set (``url_from_environment``), else ``DEFAULT_URL``.
        api_key (str | None): sent as ``Authorization: Bearer <key>``. Default: ``$NTK_API_KEY``, else none (an
            open server).
        timeout (float | httpx.Timeout): read timeout in seconds (connect stays short), or a full
            ``httpx.Timeout``. Default: ``DEFAULT_TIMEOUT_S``.
        transport_format (str): ``"safetensors"``, ``"npy"`` or ``"json"``. Default: ``"safetensors"``.
        max_retries (int): retries after 429/503 (waiting ``Retry-After``, at most ``max_retry_wait_s``).
            Default: ``DEFAULT_MAX_RETRIES``.
        max_retry_wait_s (float): cap on one wait. Default: ``DEFAULT_MAX_RETRY_WAIT_S``.
        transport (httpx.BaseTransport | None): a custom transport (tests use ``httpx.MockTransport``).

    Raises:
        ValueError: an unknown ``transport_format`` or a negative ``max_retries``.
        InvalidInput: an ``api_key`` with a character an HTTP header cannot carry (non-ASCII, control characters).
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
        transport_format: TransportFormat = "safetensors",
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_retry_wait_s: float = DEFAULT_MAX_RETRY_WAIT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if transport_format not in ("safetensors", "npy", "json"):
            raise ValueError(
                f"Client: transport_format must be 'safetensors', 'npy' or 'json', got {transport_format!r}"
            )
        if max_retries < 0:
            raise ValueError(f"Client: max_retries must be >= 0, got {max_retries}")
        if not isinstance(timeout, httpx.Timeout):
            timeout = httpx.Timeout(timeout, connect=min(DEFAULT_CONNECT_TIMEOUT_S, timeout))
        # The environment is read here, once, only for what the caller left out (as the CLI's options do).
        url = url if url is not None else url_from_environment(os.environ)
        explicit_key = api_key is not None
        api_key = api_key if explicit_key else os.environ.get(API_KEY_ENV) or None
        headers = {"User-Agent": f"ntk-service-client/{__version__}"}
        if api_key:
            _check_header_safe(api_key, source="api_key" if explicit_key else API_KEY_ENV)
            headers["Authorization"] = f"Bearer {api_key}"
        self.url = url.rstrip("/")
        self.transport_format: TransportFormat = transport_format
        self.max_retries = max_retries
        self.max_retry_wait_s = max_retry_wait_s
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        """Close the connection pool. The client cannot be used afterwards."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, transport_format={self.transport_format!r})"

    # ---- requests ----

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        content_type: str | None = None,
        accept: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> httpx.Response:
        """Send one request, retrying 429/503 up to ``max_retries`` times; return a 2xx response.

        Raises:
            NtkServiceError subclass: the server's error body mapped by ``error_class_for`` (with
                ``.http_status``), or ``ServiceUnavailable`` when the server cannot be reached or times out.
        """
        headers: dict[str, str] = {}
        if json is not None:
            content, content_type = wire.json_dumps(json), wire.MEDIA_JSON
        if content_type is not None:
            headers["Content-Type"] = content_type
        if accept is not None:
            headers["Accept"] = accept
        query = {k: v for k, v in (params or {}).items() if v is not None}
        operation = f"{method} {path}"
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, content=content, headers=headers, params=query)
            except httpx.TimeoutException as exc:
                raise ServiceUnavailable(
                    f"{operation}: no answer from {self.url} in time ({type(exc).__name__}); the server may "
                    "be busy or the computation long: pass a larger Client(timeout=...) or split the request"
                ) from exc
            except httpx.TransportError as exc:
                raise ServiceUnavailable(
                    f"{operation}: cannot reach {self.url} ({exc}); is the server running "
                    "(`ntk-service serve`) and the URL right?"
                ) from exc
            if response.status_code < 400:
                return response
            if response.status_code in _RETRY_STATUSES and attempt < self.max_retries:
                wait = self._retry_wait(response, attempt)
                if wait is not None:
                    attempt += 1
                    _sleep(wait)
                    continue
            raise _error_from_response(response, operation)

    def _retry_wait(self, response: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before the next attempt, or ``None`` when the server asks for more than the cap."""
        wait = _parse_retry_after(response.headers.get("retry-after"))
        if wait is None:
            wait = _FALLBACK_BACKOFF_S * 2**attempt
        return wait if wait <= self.max_retry_wait_s else None

    def _get_json(self, path: str, *, params: Mapping[str, Any] | None = None) -> Any:
        return _decode_json(self._request("GET", path, params=params, accept=wire.MEDIA_JSON))

    def _send_json(self, method: str, path: str, body: Any = None) -> Any:
        response = self._request(method, path, json=body, accept=wire.MEDIA_JSON)
        return _decode_json(response) if response.content else None


# ---- decoding ----


def _media(response: httpx.Response) -> str:
    header: str = response.headers.get("content-type", "")
    return header.split(";", 1)[0].strip().lower()


def _decode_json(response: httpx.Response) -> Any:
    return wire.json_loads(response.content, name=f"response of {response.request.method} {response.request.url}")


def _decode_tensors(response: httpx.Response, *, npy_name: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Named arrays and string metadata from a safetensors or npy response (npy: one array, ``npy_name``)."""
    media = _media(response)
    name = f"response of {response.request.method} {response.request.url.path}"
    if media == wire.MEDIA_SAFETENSORS:
        return wire.decode_safetensors(response.content, name=name)
    if media == wire.MEDIA_NPY:
        return {npy_name: wire.decode_npy(response.content, name=name)}, {}
    raise NtkServiceError(
        f"{name}: expected {wire.MEDIA_SAFETENSORS} or {wire.MEDIA_NPY}, got {media or 'no Content-Type'}; "
        "is the URL an ntk-service server?"
    )


def _error_from_response(response: httpx.Response, operation: str) -> NtkServiceError:
    """The ``ntk_service.errors`` exception for a 4xx/5xx response (``.http_status`` = the HTTP status)."""
    status = response.status_code
    error_type, message, extra = "", "", dict[str, Any]()
    try:
        body = response.json()
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            error_type = str(error.get("type", ""))
            message = str(error.get("message", ""))
            extra = error
    except ValueError:
        pass
    if not message:
        text = response.text.strip().replace("\n", " ")
        message = f"{operation}: HTTP {status} {response.reason_phrase}" + (f": {text[:200]}" if text else "")
    cls = error_class_for(error_type, status)
    exc: NtkServiceError
    if issubclass(cls, Busy):
        retry_after = _parse_retry_after(response.headers.get("retry-after"))
        exc = cls(message, retry_after_s=retry_after if retry_after is not None else 1.0)
    elif issubclass(cls, MemoryEstimateExceeded | DiskEstimateExceeded):
        exc = cls(message, estimate_bytes=extra.get("estimate_bytes"), budget_bytes=extra.get("budget_bytes"))
    else:
        exc = cls(message)
    # Keep what came, even when the class is a broader fallback (a newer server's type, a proxy's status).
    exc.http_status = status
    if error_type:
        exc.error_type = error_type
    return exc


def _parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; ``None`` when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _named_side_json(value: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Named inputs (``{"input_ids": ids, "attention_mask": mask}``, numpy or torch values) as an object of JSON
    tensors, for a model taking several inputs."""
    if not value or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{name}: named inputs need string keys, one array each; got keys {list(value)}")
    out = {}
    for key, array in value.items():
        if is_torch_tensor(array):
            array = array.detach().cpu().numpy()
        out[key] = wire.tensor_to_json(np.asarray(array))
    return out
