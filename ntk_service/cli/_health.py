"""``ntk-service health``: is the server at ``--url`` up? (exit 0 yes, 1 no: handy in scripts and healthchecks)."""

from __future__ import annotations

import typer

from ntk_service.cli._app import JsonFlag, app, print_json, state_of, wants_json

__all__ = ["health"]


@app.command()
def health(ctx: typer.Context, json_output: JsonFlag = False) -> None:
    """Check that the server answers (GET /healthz, no key needed); exit 1 if it does not."""
    client = state_of(ctx).client()
    status = client.health()
    if wants_json(ctx, json_output):
        print_json({"url": client.url, **status})
    else:
        typer.echo(f"{client.url}: {status.get('status', 'ok')}")
