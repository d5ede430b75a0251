"""``ntk-service serve``: run the HTTP service, configured by ``NTK_*`` environment variables and a few options.

NOTE [exit status]: uvicorn shuts down gracefully on SIGINT (Ctrl-C) and SIGTERM, restores the handlers it found
and then raises the same signal again, so that the process "dies of it". Under the default handlers that makes a
graceful stop exit 143 (128 + SIGTERM) or 130, which ``make serve``, systemd and CI report as a failure
("make: *** [serve] Error 143"). ``serve`` installs its own handlers for both signals before uvicorn starts:
uvicorn finds and restores those, and the re-raised signal then ends the process with exit status 0, the status
of a server that stopped because it was asked to. A server that fails exits 1 (or 2 for a bad configuration).
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from ntk_service.cli._app import EXIT_USAGE, app, fail

__all__ = ["serve"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals after which a gracefully stopped server exits 0 (NOTE [exit status])."""


def _stopped(signum: int, frame: FrameType | None) -> None:
    """The handler uvicorn re-raises its stop signal into once shut down: exit 0 (NOTE [exit status])."""
    raise SystemExit(0)


@app.command()
def serve(
    host: Annotated[
        str | None, typer.Option(help="Interface to bind (overrides NTK_HOST).", show_default=False)
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (overrides NTK_PORT).", show_default=False)] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Registry and data directory (overrides NTK_DATA_DIR).", show_default=False)
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="critical|error|warning|info|debug (overrides NTK_LOG_LEVEL).")
    ] = None,
) -> None:
    """Run the server until interrupted. Everything else (keys, limits) comes from NTK_* variables."""
    try:
        from pydantic import ValidationError

        from ntk_service.config import Settings
        from ntk_service.server import serve as run_server
    except ImportError as exc:  # a client-only install: `pip install ntk-service` has no server
        fail(
            f"serve: the server is not installed ({exc}); install it with: pip install 'ntk-service[server]'",
            code=EXIT_USAGE,
        )

    overrides: dict[str, Any] = {
        key: value
        for key, value in {"host": host, "port": port, "data_dir": data_dir, "log_level": log_level}.items()
        if value is not None
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in exc.errors()
        )
        fail(f"serve: invalid configuration: {problems}", code=EXIT_USAGE)

    previous = {sig: signal.signal(sig, _stopped) for sig in STOP_SIGNALS}
    try:
        run_server(settings)
    except ValueError as exc:  # e.g. an open server on a non-loopback host
        fail(str(exc), code=EXIT_USAGE)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
