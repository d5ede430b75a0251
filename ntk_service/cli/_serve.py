"""``ntk-service serve``: run the HTTP service, configured by ``NTK_*`` environment variables and a few options."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ntk_service.cli._app import EXIT_USAGE, app, fail

__all__ = ["serve"]


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

    try:
        run_server(settings)
    except ValueError as exc:  # e.g. an open server on a non-loopback host
        fail(str(exc), code=EXIT_USAGE)
