"""API keys: ``Authorization: Bearer <key>``, each key with scope ``read`` or ``write`` (write implies read).

Keys are kept only as SHA-256 digests and looked up by digest, so the comparison time does not depend on how
much of a guessed key is right. With no keys configured the server is open (every request is allowed);
``serve`` then refuses to bind anything but loopback.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from ntk_service.config import Scope
from ntk_service.errors import AuthenticationError, PermissionDenied

__all__ = ["KeyRing", "Principal"]

_SCOPE_RANK: Mapping[str, int] = {"read": 1, "write": 2}


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``key_id`` is a digest prefix (safe to log), ``scope`` what the key may do."""

    key_id: str
    scope: Scope


OPEN_PRINCIPAL = Principal(key_id="open", scope="write")
"""The caller of an open server (no keys configured): allowed everything, reachable only from loopback."""


class KeyRing:
    """The configured keys, checked per request.

    Args:
        keys: ``{key: scope}`` from ``Settings.api_key_scopes()``; empty means an open server.
    """

    def __init__(self, keys: Mapping[str, Scope]) -> None:
        self._scopes = {_digest(k): s for k, s in keys.items()}

    @property
    def is_open(self) -> bool:
        return not self._scopes

    def authorize(self, token: str | None, needed: Scope, *, operation: str, header_sent: bool = False) -> Principal:
        """The caller of ``token`` if its scope covers ``needed``.

        Args:
            token (str | None): the key of an ``Authorization: Bearer <key>`` header, or None.
            needed (Scope): "read" or "write".
            operation (str): prefix of error messages, e.g. "GET /v1/models".
            header_sent (bool): an ``Authorization`` header came but not in the Bearer form (so ``token`` is None):
                the message says which form is expected (never what was sent: it may hold the key). Default: False.

        Raises:
            AuthenticationError: no token, a header of another form, or a token that is not a configured key (401).
            PermissionDenied: a valid key whose scope is too small (403).
        """
        if self.is_open:
            return OPEN_PRINCIPAL
        if not token and header_sent:
            raise AuthenticationError(
                f"{operation}: the Authorization header is not of the form 'Bearer <key>'; send "
                "'Authorization: Bearer <key>' (the word Bearer, one space, then the key; not Basic, Token or the "
                "key alone)"
            )
        if not token:
            raise AuthenticationError(
                f"{operation}: no API key; send 'Authorization: Bearer <key>' with a key from the operator"
            )
        digest = _digest(token)
        scope = self._scopes.get(digest)
        if scope is None:
            raise AuthenticationError(f"{operation}: the API key is not valid; check the key you were given")
        if _SCOPE_RANK[scope] < _SCOPE_RANK[needed]:
            raise PermissionDenied(
                f"{operation}: needs a key with '{needed}' scope, this key has '{scope}'; "
                f"ask the operator for a '{needed}' key"
            )
        return Principal(key_id=digest[:8], scope=scope)
