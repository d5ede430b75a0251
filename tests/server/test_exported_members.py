"""The server package's public surface is exactly what its ``__all__`` lists."""

from __future__ import annotations

import ntk_service.server as server


def test_exported_members() -> None:
    assert server.__all__ == ["create_app", "serve"]
    for name in server.__all__:
        assert callable(getattr(server, name))
