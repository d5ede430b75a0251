"""Every dotted ``ntk_service.…`` name written in a tracked file (code, subprocess programs inside strings,
docs, configuration, scripts) resolves: a module that imports, and the attributes after it. A move that misses
a reference in a string or a page fails here, not in CI's docs build or a user's copy-paste."""

from __future__ import annotations

import importlib
import re
import subprocess
import warnings

from tests.conftest import REPO_ROOT

_NAME = re.compile(r"\bntk_service(?:\.[A-Za-z_]\w*)+")

_NOT_NAMES = {
    "ntk_service.nope": "tests/test_exported_members.py asserts the lazy __getattr__ refuses it",
    "ntk_service.x": "mkdocs.yml: the pattern of the API reference pages' headings",
}
"""Written on purpose without being a name."""


def _tracked() -> list[str]:
    globs = ["*.py", "*.md", "*.yml", "*.yaml", "*.toml", "*.sh", "*.cfg", "Makefile", "Dockerfile"]
    out = subprocess.run(["git", "ls-files", *globs], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return out.stdout.split()


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def test_every_dotted_name_in_the_repository_resolves() -> None:
    where: dict[str, set[str]] = {}
    for path in _tracked():
        text = (REPO_ROOT / path).read_text(errors="replace")
        for match in _NAME.finditer(text):
            where.setdefault(match.group(0), set()).add(path)
    assert len(where) > 100, "the scan found too few names to be reading the repository"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # old homes are names too, for one release
        broken = {
            name: sorted(paths) for name, paths in where.items() if name not in _NOT_NAMES and not _resolves(name)
        }
    assert not broken, "names that do not resolve (fix the reference, or keep an alias at the old home):\n" + "\n".join(
        f"{name}: {', '.join(paths)}" for name, paths in sorted(broken.items())
    )
    assert all(not _resolves(name) for name in _NOT_NAMES)
