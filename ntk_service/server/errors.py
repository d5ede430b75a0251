"""The old name of ``server/error_responses.py`` (renamed so that ``errors`` names one module, the exception
tree in ``ntk_service/errors.py``); kept for one release so imports of ``ntk_service.server.errors`` keep working.
New code imports from ``ntk_service.server.error_responses``."""

from __future__ import annotations

from ntk_service.server.error_responses import error_response, format_validation_errors, install_error_handlers

__all__ = ["error_response", "format_validation_errors", "install_error_handlers"]
