"""``ntk-service health``: is the server at ``--url`` up? (exit 0 yes, 1 no: handy in scripts and healthchecks)."""

from __future__ import annotations

import typer

from ntk_service.cli._app import JsonFlag, app, state_of
from ntk_service.cli._output import print_answer

__all__ = ["health"]


@app.command()
def health(ctx: typer.Context, json_output: JsonFlag = False) -> None:
    """Check that the server answers (GET /healthz, no key needed); exit 1 if it does not."""
    client = state_of(ctx).client()
    status = client.health()
    print_answer(ctx, json_output, {"url": client.url, **status}, f"{client.url}: {status.get('status', 'ok')}")
