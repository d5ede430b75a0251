"""Typed helpers shared by the CLI tests: a real ``serve`` process, started and waited for."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.conftest import BIND_RETRIES, REPO_ROOT, free_port, lost_its_port

READY_TIMEOUT_S = 90
"""A cold start imports torch and warms the engine up: seconds idle, tens of seconds on a loaded machine."""


def launch_serve(command: list[str], data_dir: Path, log_path: Path, **env: str) -> tuple[subprocess.Popen[bytes], int]:
    """Run ``command serve --port P --data-dir data_dir`` (``command``: the CLI, e.g. ``["ntk-service"]``), with the
    ``NTK_*`` environment replaced by ``env``, and wait until ``/readyz`` answers 200.

    Returns:
        (process, port): the running server and its port; the caller stops it.
    """
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NTK_")} | env
    for _ in range(BIND_RETRIES + 1):
        port = free_port()
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [*command, "serve", "--port", str(port), "--data-dir", str(data_dir)],
                cwd=REPO_ROOT,
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if _wait_until_ready(process, port, command, log_path):
            return process, port
    raise AssertionError(f"{' '.join(command)} serve lost its port {BIND_RETRIES + 1} times: {_read(log_path)}")


def _wait_until_ready(process: subprocess.Popen[bytes], port: int, command: list[str], log_path: Path) -> bool:
    """True once ``/readyz`` answers 200; False if the server exited because another process took its port."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process.poll() is not None:
            if lost_its_port(_read(log_path)):
                return False
            raise AssertionError(_read(log_path))
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            ready = False
        if ready and process.poll() is None:
            return True
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{' '.join(command)} serve did not become ready: {_read(log_path)}")
        time.sleep(0.2)


def _read(log_path: Path) -> str:
    return log_path.read_text(errors="replace")
