"""``python -m ntk_service`` (ntk_service/__main__.py) is the CLI: its help, a command, and ``serve`` stopped by
Ctrl-C exiting 0 after its graceful shutdown (NOTE [exit status] in cli/_serve.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.cli.support import launch_serve
from tests.conftest import REPO_ROOT, LiveServer


def _module(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ntk_service", *args],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )


def test_python_m_ntk_service_is_the_cli(live_server: LiveServer) -> None:
    help_run = _module("--help")
    assert help_run.returncode == 0, help_run.stderr
    assert "serve" in help_run.stdout and "kernel" in help_run.stdout
    env = {**os.environ, "NTK_URL": live_server.url}
    health = _module("health", env=env)
    assert health.returncode == 0, health.stderr
    assert health.stdout.strip() == f"{live_server.url}: ok"


def test_ctrl_c_stops_serve_gracefully_with_exit_status_0(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "ntk_service"]
    process, _ = launch_serve(command, tmp_path / "data", log_path, NTK_API_KEYS="main-key:write", NTK_LOG_LEVEL="info")
    try:
        process.send_signal(signal.SIGINT)
        returncode = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    log = log_path.read_text(errors="replace")
    assert "Application shutdown complete" in log, log  # uvicorn's graceful path ran to its end
    assert returncode == 0, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
