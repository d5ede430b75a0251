"""Human-readable output for the CLI: aligned tables and key/value records (``--json`` bypasses these)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import typer

from ntk_service.cli._app import UsageError, print_json, wants_json

__all__ = ["format_value", "print_answer", "print_record", "print_table", "write_output"]


def format_value(value: Any) -> str:
    """One cell: lists as ``[a, b]``, ``None`` as ``-``, the rest as ``str``."""
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def print_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str], *, empty: str) -> None:
    """Rows as aligned columns under an upper-case header; ``empty`` when there are no rows."""
    cells = [[format_value(row.get(col)) for col in columns] for row in rows]
    if not cells:
        typer.echo(empty)
        return
    header = [col.upper() for col in columns]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(columns))]
    for line in [header, *cells]:
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def print_record(record: Mapping[str, Any]) -> None:
    """``key: value`` lines; a list of parameter records becomes indented ``name shape`` lines."""
    width = max((len(key) for key in record), default=0)
    for key, value in record.items():
        if key == "parameters" and isinstance(value, list):
            typer.echo(f"{key.ljust(width)}:")
            items = [item for item in value if isinstance(item, Mapping)]
            name_width = max((len(str(item.get("name"))) for item in items), default=0)
            for item in items:
                typer.echo(f"  {str(item.get('name')).ljust(name_width)}  {format_value(item.get('shape'))}")
            continue
        if isinstance(value, Mapping):
            value = ", ".join(f"{k}={format_value(v)}" for k, v in value.items())
        typer.echo(f"{key.ljust(width)}: {format_value(value)}")


def print_answer(
    ctx: typer.Context, json_output: bool, value: Any, text: str | Callable[[], object] | None = None
) -> None:
    """A command's answer: ``value`` as JSON with ``--json`` (before or after the command); else ``text`` (a line,
    or a function that prints, e.g. a table), or without it ``value`` as ``key: value`` lines."""
    if wants_json(ctx, json_output):
        print_json(value)
    elif text is None:
        print_record(value)
    elif isinstance(text, str):
        typer.echo(text)
    else:
        text()


def write_output(path: Path, write: Callable[[Path], object], *, option: str = "-o") -> None:
    """``write(path)``, an unwritable path (no such folder, no permission, a full disk) a usage error.

    Raises:
        UsageError: ``{option}: cannot write '<path>' (<reason>)``.
    """
    try:
        write(path)
    except OSError as exc:
        raise UsageError(f"{option}: cannot write {str(path)!r} ({exc.strerror or exc})") from exc
