"""mkdocs hook: the docs' tables of modes are made from ``ntk_service.vocabulary.MODES`` when the site is built.

A page writes ``<!-- mode table: mode, shape, entry -->`` (columns of ``vocabulary.mode_table``; add ``contracted``
after the columns for the contracted modes alone) where the table goes, so a mode added to the table is in the
docs without editing them.
"""

from __future__ import annotations

import re
from typing import Any

from ntk_service.vocabulary import mode_table

_MARKER = re.compile(r"<!--\s*mode table:\s*(?P<columns>[\w ,]+?)(?P<contracted>\s+contracted)?\s*-->")


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Every marker replaced by its table."""

    def table(match: re.Match[str]) -> str:
        columns = tuple(c.strip() for c in match["columns"].split(","))
        return mode_table(columns, derived=match["contracted"] is None)

    return _MARKER.sub(table, markdown)
