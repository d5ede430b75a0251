"""Shared fixtures: real uvicorn servers in subprocesses, configured only through ``NTK_*`` environment variables.

``live_server`` (session) is one server for the whole run; ``start_server`` starts extra ones (restart persistence,
overload) and stops them after the test. Each server gets its own data directory and free port, and the keys
``read-key:read,write-key:write``.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

import ntk_service  # noqa: F401  (first: sets OMP_WAIT_POLICY=PASSIVE before any test module imports torch)

REPO_ROOT = Path(__file__).resolve().parent.parent
READ_KEY = "read-key"
WRITE_KEY = "write-key"
SLOW_FACTORY = "tests.server.slow_factory:build"
STARTUP_TIMEOUT_S = 90.0
"""Generous: importing torch on a busy 2-core machine can take many seconds."""

_SERVE = "from ntk_service.config import Settings; from ntk_service.server import serve; serve(Settings())"


PORT_RANGE = (20000, 32768)
"""Where test servers listen: below Linux's default ephemeral range (32768-60999, where every outbound connection
and every ``bind(port=0)`` lands) and above Ray's worker ports (10002-19999). A port chosen from the ephemeral
range can be taken by any outbound connection in the seconds the server spends importing torch before it binds, and
the server then exits with "address already in use"."""

BIND_RETRIES = 3
"""How many times a server whose port was chosen here is relaunched on another after "address already in use"."""


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, drawn at random from ``PORT_RANGE`` (a random draw, not a
    counter: two pytest runs on one machine must not walk the same sequence)."""
    low, high = PORT_RANGE
    for _ in range(100):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 100 drawn from {low}-{high - 1}")


def lost_its_port(log: str) -> bool:
    """Whether a server's log says it exited because another process took its port first."""
    return "address already in use" in log


@dataclass
class LiveServer:
    """A running ``ntk-service`` subprocess."""

    url: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    read_key: str = READ_KEY
    write_key: str = WRITE_KEY
    env: dict[str, str] = field(default_factory=dict)
    relaunch: Callable[[], LiveServer] | None = None
    """Launch the same server on another free port (None: the caller chose the port, so it cannot move)."""

    def client(self, key: str | None = "write", *, timeout: float = 60.0) -> httpx.Client:
        """An httpx client for this server; ``key`` is "read", "write", None (no header) or a literal key."""
        token = {"read": self.read_key, "write": self.write_key}.get(key or "", key)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts down gracefully), then SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_live_server(data_dir: Path, *, keys: bool = True, port: int | None = None, **settings: str) -> LiveServer:
    """Start a server on a free port and wait until ``/readyz`` answers 200.

    Args:
        data_dir: the server's ``NTK_DATA_DIR`` (created if missing).
        keys: configure ``read-key:read,write-key:write``; False runs an open server.
        port: the port, e.g. a stopped server's to restart it at the same URL. Default: a free one.
        **settings: more settings by field name, e.g. ``max_queue="0"`` becomes ``NTK_MAX_QUEUE=0``.
    """
    return wait_until_ready(launch_live_server(data_dir, keys=keys, port=port, **settings))


def launch_live_server(data_dir: Path, *, keys: bool = True, port: int | None = None, **settings: str) -> LiveServer:
    """``start_live_server`` without the wait: the process starts while the caller does other work; call
    ``wait_until_ready`` before using it."""
    chosen = port is not None
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NTK_")}
    env.update(
        NTK_HOST="127.0.0.1",
        NTK_PORT=str(port),
        NTK_DATA_DIR=str(data_dir),
        NTK_LOG_LEVEL="warning",
        NTK_MODEL_FACTORIES=SLOW_FACTORY,
    )
    if keys:
        env["NTK_API_KEYS"] = f"{READ_KEY}:read,{WRITE_KEY}:write"
    env.update({f"NTK_{name.upper()}": value for name, value in settings.items()})
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / f"{data_dir.name}-server-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", _SERVE], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    relaunch = None if chosen else lambda: launch_live_server(data_dir, keys=keys, **settings)
    return LiveServer(f"http://127.0.0.1:{port}", data_dir, process, log_path, env=env, relaunch=relaunch)


def wait_until_ready(server: LiveServer) -> LiveServer:
    """Wait until a launched server's ``/readyz`` answers 200 (stopping it and raising if it never does).

    A server that lost its port to another process before binding it is relaunched on another port (up to
    ``BIND_RETRIES`` times, only where the port was chosen here); use the server this returns.
    """
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    retries = BIND_RETRIES
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            if server.relaunch is not None and retries > 0 and lost_its_port(server.log()):
                retries -= 1
                server = server.relaunch()
                continue
            raise RuntimeError(f"server exited with {server.process.returncode} during startup:\n{server.log()}")
        try:
            ready = httpx.get(f"{server.url}/readyz", timeout=2.0).status_code == 200
        except httpx.TransportError:
            ready = False
        if ready and server.process.poll() is None:  # if ours has exited, whoever took its port answered
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{server.log()}")


HEAVY_FIRST = (
    "tests/docs/test_snippets.py",
    "tests/jobs/test_ray_operator.py",
    "tests/server/test_fuzz.py",
    "tests/server/test_console.py",
    "tests/jobs/test_ray.py",
    "tests/jobs/test_routes.py",
    "tests/jobs/test_ray_cluster.py",
    "tests/server/test_job_routes.py",
    "tests/server/test_compute.py",
    "tests/jobs/test_named_jobs.py",
    "tests/server/routes/test_attribution_jobs.py",
    "tests/jobs/test_attribution_kinds.py",
    "tests/cli/test_cli.py",
    "tests/server/test_shutdown_ray.py",
)
"""The test files of the longest run time, longest first (per-file sums of a whole-suite run). Under pytest-xdist
(``make test``: a file per worker at a time, ``--no-loadscope-reorder``) the workers take them first, so the many
short files even out the end of the run instead of one worker finishing a minute-long file alone."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, move the files of ``HEAVY_FIRST`` to the front in that order (the rest keep theirs)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    missing = [name for name in HEAVY_FIRST if not (REPO_ROOT / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py HEAVY_FIRST names files that do not exist: {missing}")
    rank = {name: place for place, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(REPO_ROOT).as_posix(), len(rank)))


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One real server for the session: 2 MiB body limit, 64 KiB JSON responses, the slow factory allowed."""
    server = start_live_server(
        tmp_path_factory.mktemp("live") / "data",
        max_body_bytes=str(2 * 2**20),
        max_json_response_bytes=str(64 * 2**10),
        memory_budget_bytes=str(256 * 2**20),
    )
    yield server
    server.stop()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """Start extra servers (``start_server(data_dir=..., **settings)``); all are stopped after the test."""
    started: list[LiveServer] = []

    def start(data_dir: Path | None = None, **settings: str) -> LiveServer:
        server = start_live_server(data_dir or tmp_path / f"data{len(started)}", **settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
