"""docs/_hooks/mode_tables.py: the docs' tables of modes are made from ``vocabulary.MODES`` at build time."""

from __future__ import annotations

import importlib.util
import re

from ntk_service.vocabulary import CONTRACTED_MODES, MODES
from tests.conftest import REPO_ROOT


def _hook():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("mode_tables", REPO_ROOT / "docs" / "_hooks" / "mode_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_markers_become_tables_of_every_mode() -> None:
    page = "before\n<!-- mode table: mode, shape, dimensions -->\nbetween\n<!-- mode table: mode, entry contracted -->"
    out = _hook().on_page_markdown(page, page=None, config=None, files=None)
    assert "<!--" not in out and out.startswith("before\n| mode | shape | dimensions |")
    rows = re.findall(r"^\| `(\w+)` \|", out, re.MULTILINE)
    assert rows == [*MODES, *(m.value for m in CONTRACTED_MODES)]
    assert "| `full` | (N, M, k, k) | `x1, x2, out1, out2` |" in out


def test_the_docs_tables_of_modes_are_markers() -> None:
    """No page keeps a hand-written table of the modes (it would miss the next mode)."""
    for path in (REPO_ROOT / "docs").glob("*.md"):
        text = path.read_text()
        assert not re.search(r"^\| `output_diagonal` \| \(N, M, k\)", text, re.MULTILINE), path.name
    assert "<!-- mode table:" in (REPO_ROOT / "docs" / "concepts.md").read_text()
