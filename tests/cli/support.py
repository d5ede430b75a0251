"""Typed helpers shared by the CLI tests: a real ``serve`` process, started and waited for."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.conftest import REPO_ROOT, _free_port

READY_TIMEOUT_S = 90
"""A cold start imports torch and warms the engine up: seconds idle, tens of seconds on a loaded machine."""


def launch_serve(command: list[str], data_dir: Path, log_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], int]:
    """Run ``command serve --port P --data-dir data_dir`` (``command``: the CLI, e.g. ``["ntk-service"]``), with the
    ``NTK_*`` environment replaced by ``env``, and wait until ``/readyz`` answers 200.

    Returns:
        (process, port): the running server and its port; the caller stops it.
    """
    port = _free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NTK_")} | env
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*command, "serve", "--port", str(port), "--data-dir", str(data_dir)],
            cwd=REPO_ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        assert process.poll() is None, log_path.read_text(errors="replace")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return process, port
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(
                f"{' '.join(command)} serve did not become ready: {log_path.read_text(errors='replace')}"
            )
        time.sleep(0.2)
