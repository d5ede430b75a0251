"""The HTTP service: ``create_app(settings)`` builds the FastAPI app, ``serve(settings)`` runs it with
uvicorn.

>>> from ntk_service.config import Settings
>>> from ntk_service.server import serve
>>> serve(Settings(api_keys="secret:write", host="0.0.0.0"))  # doctest: +SKIP
"""

from ntk_service.server.app import create_app, serve

__all__ = ["create_app", "serve"]
