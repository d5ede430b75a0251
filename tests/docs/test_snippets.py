"""Every code block of README.md and docs/ runs, so the documentation cannot drift from the code.

One test per document: its ``python`` blocks run in order in one namespace (as a reader runs them in a notebook),
its ``bash`` blocks through ``bash -euo pipefail`` with the venv's scripts on PATH, and its ``json`` blocks must
parse. A document whose blocks talk to a server gets a real one of its own (a uvicorn subprocess, open mode, a
fresh data directory, stopped after the document: no state leaks between pages); the blocks are run as written,
with the documented default address ``http://127.0.0.1:8000`` replaced by that server's. Everything runs in a
temporary working directory. Each page's server is launched while the page before it runs (``_ServerPool``), so
no page waits for a server to import torch.

A block that cannot run here (it starts a long-lived server, builds a Docker image, or runs a benchmark of
minutes) is preceded by ``<!-- snippet: skip (reason) -->``; the test reports every skipped block with its reason.
Blocks of any other language (``text``, ``console``: output shown to the reader) are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, LiveServer, launch_live_server, wait_until_ready

DOCUMENTED_URL = "http://127.0.0.1:8000"
"""The address the docs use: ``ntk-service serve``'s default."""

_FENCE = re.compile(
    r"(?:<!--\s*snippet:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->\s*\n)?^```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```",
    re.MULTILINE | re.DOTALL,
)
_RUN = {"python", "bash", "json"}
_NEEDS_SERVER = ("127.0.0.1:8000", "Client(", "ntk-service ", "NTK_URL")
_BASH_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    path: Path
    line: int
    lang: str
    code: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def _documents() -> list[Path]:
    pages = sorted(path for path in (REPO_ROOT / "docs").rglob("*.md") if path.parent.name != "api")
    return [REPO_ROOT / "README.md", *pages]


def _blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        lang = match["lang"] or ""
        if lang not in _RUN:
            continue
        line = text.count("\n", 0, match.start("code"))
        blocks.append(Block(path, line, lang, match["code"], match["reason"]))
    return blocks


def _needs_server(blocks: list[Block]) -> bool:
    return any(marker in block.code for block in blocks if block.skip_reason is None for marker in _NEEDS_SERVER)


def _run_bash(block: Block, code: str, cwd: Path, server: LiveServer | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NTK_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO_ROOT)
    if server is not None:
        env["NTK_URL"] = server.url
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=_BASH_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (
        f"{block.where}: bash block exited {done.returncode}\n--- code\n{code}\n--- stdout\n{done.stdout}\n"
        f"--- stderr\n{done.stderr}"
    )


def _page_needs_server(path: Path) -> bool:
    return _needs_server([block for block in _blocks(path) if block.skip_reason is None])


class _ServerPool:
    """One fresh open-mode server per page that needs one, each launched ahead, while the page before it runs.

    ``take`` waits until the spare is ready, launches the next page's (as long as pages that need a server remain
    in this run) and returns it; every server has its own data directory and is stopped by its page.
    """

    def __init__(self, root: Path, needed: int) -> None:
        self.root, self.needed, self.launched = root, needed, 0
        self.spare: LiveServer | None = None

    def _launch(self) -> LiveServer:
        self.launched += 1
        return launch_live_server(self.root / f"data{self.launched}", keys=False)

    def take(self, workdir: Path) -> LiveServer:
        """The next server, its data directory also at ``workdir/data`` (where ``serve --data-dir ./data`` would
        put it: docs/results.md opens a job's result.zarr by that path)."""
        server = wait_until_ready(self.spare or self._launch())  # then the next launch: one server starts at a time
        self.spare = self._launch() if self.launched < self.needed else None
        (workdir / "data").symlink_to(server.data_dir, target_is_directory=True)
        return server

    def close(self) -> None:
        if self.spare is not None:
            self.spare.stop()


@pytest.fixture(scope="module")
def server_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_ServerPool]:
    pages = [
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_document_code_blocks_run" and hasattr(item, "callspec")
    ]
    pool = _ServerPool(tmp_path_factory.mktemp("snippet-servers"), sum(map(_page_needs_server, pages)))
    yield pool
    pool.close()


@pytest.mark.slow
@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_document_code_blocks_run(
    path: Path,
    tmp_path: Path,
    server_pool: _ServerPool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocks = _blocks(path)
    runnable = [block for block in blocks if block.skip_reason is None]
    if not runnable:
        pytest.skip(f"{path.name}: no runnable code block")
    server = server_pool.take(tmp_path) if _needs_server(runnable) else None
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NTK_URL", raising=False)
    monkeypatch.delenv("NTK_API_KEY", raising=False)
    if server is not None:
        monkeypatch.setenv("NTK_URL", server.url)
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    try:
        for block in blocks:
            if block.skip_reason is not None:
                with capsys.disabled():
                    print(f"\n  skipped {block.where} ({block.skip_reason})", end="")
                continue
            code = block.code if server is None else block.code.replace(DOCUMENTED_URL, server.url)
            if block.lang == "json":
                try:
                    json.loads(code)
                except json.JSONDecodeError as exc:
                    pytest.fail(f"{block.where}: json block does not parse: {exc}")
            elif block.lang == "bash":
                _run_bash(block, code, tmp_path, server)
            else:
                try:
                    exec(compile(code, block.where, "exec"), namespace)
                except Exception as exc:
                    raise AssertionError(f"{block.where}: python block failed: {exc!r}") from exc
    finally:
        _close_clients(namespace)
        if server is not None:
            server.stop()


def _close_clients(namespace: dict[str, object]) -> None:
    """Close the clients a page left open, as a reader's notebook does when it shuts down."""
    from ntk_service.client import Client

    for value in namespace.values():
        if isinstance(value, Client):
            value.close()


def test_every_skip_has_a_reason() -> None:
    """A skip marker without a reason (or one that marks nothing) is a documentation bug."""
    for path in _documents():
        text = path.read_text()
        markers = len(re.findall(r"^<!--\s*snippet:", text, re.MULTILINE))
        skipped = sum(1 for block in _blocks(path) if block.skip_reason is not None)
        skipped_other = len(re.findall(r"<!--\s*snippet:\s*skip\s*\([^)]+\)\s*-->\s*\n```(?!python|bash|json)", text))
        assert markers == skipped + skipped_other, f"{path.name}: a snippet marker is malformed or marks no block"
