"""What a new user of the command line meets: examples in ``--help``, the CLI finding a server started with
``NTK_HOST`` / ``NTK_PORT``, ``jobs list``, and a progress bar on a terminal even with ``--json``."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import uuid
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.client import Client
from ntk_service.client._base import url_from_environment
from tests.conftest import REPO_ROOT, LiveServer
from tests.jobs.conftest import SLOW_MODEL, TINY_MLP


def test_top_level_help_shows_examples() -> None:
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    examples = result.stdout.split("Examples:")[1]
    for line in ("ntk-service serve", "export NTK_URL=", "ntk-service jobs list", "-o kernel.zarr.zip"):
        assert line in examples, line
    assert "  ntk-service models list\n" in examples  # one command per line: click did not rewrap them


@pytest.mark.parametrize(
    ("environ", "url"),
    [
        ({}, "http://127.0.0.1:8000"),
        ({"NTK_PORT": "9000"}, "http://127.0.0.1:9000"),
        ({"NTK_HOST": "0.0.0.0", "NTK_PORT": "9000"}, "http://127.0.0.1:9000"),  # listening everywhere: loopback
        ({"NTK_HOST": "lab-box"}, "http://lab-box:8000"),
        ({"NTK_HOST": "::1", "NTK_PORT": "9001"}, "http://[::1]:9001"),
        ({"NTK_URL": "http://other:1", "NTK_PORT": "9000"}, "http://other:1"),  # NTK_URL wins
        ({"NTK_URL": "", "NTK_PORT": "9000"}, "http://127.0.0.1:9000"),  # an empty one is unset
    ],
)
def test_url_from_environment(environ: dict[str, str], url: str) -> None:
    assert url_from_environment(environ) == url


def test_the_cli_and_client_find_a_server_by_ntk_host_and_port(live_server: LiveServer) -> None:
    parts = urlsplit(live_server.url)
    env = {"NTK_URL": None, "NTK_HOST": parts.hostname, "NTK_PORT": str(parts.port), "NTK_API_KEY": None}
    result = CliRunner().invoke(app, ["health"], env=env)  # type: ignore[arg-type]
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == f"{live_server.url}: ok"


@pytest.fixture(scope="module")
def jobs(live_server: LiveServer) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    x = np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32)
    with Client(live_server.url, api_key=live_server.write_key) as client:
        client.register_model(f"cli-list-{suffix}", TINY_MLP)
        client.register_model(f"cli-slow-{suffix}", SLOW_MODEL)
        dataset = client.upload_dataset(x)["id"]
        done = client.wait(client.submit_job(f"cli-list-{suffix}", dataset, mode="trace", tile_size=4), progress=False)
    return {"done": done, "slow": f"cli-slow-{suffix}", "dataset": dataset}


def test_jobs_list_is_a_table_of_every_job(live_server: LiveServer, jobs: dict[str, Any]) -> None:
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.read_key}
    result = CliRunner().invoke(app, ["jobs", "list"], env=env)
    assert result.exit_code == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["ID", "STATUS", "MODEL", "VERSION", "MODE", "TILES", "DURATION", "ETA", "SIZE"] + [
        "CREATED_AT"
    ]
    row = next(r.split() for r in rows if r.startswith(jobs["done"]["id"]))
    assert row[1:6] == ["succeeded", jobs["done"]["model"], "1", "trace", "3/3"]
    assert row[6].endswith("s") and row[7] == "-" and row[8:10] == ["192", "B"]  # 3 stored tiles of 4 x 4 float32
    as_json = CliRunner().invoke(app, ["--json", "jobs", "list"], env=env)
    assert jobs["done"]["id"] in {job["id"] for job in json.loads(as_json.stdout)}


def _run_on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (as in a shell) and stdout on a pipe (as in ``| jq``)."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "ntk_service", *args], stdout=subprocess.PIPE, stderr=slave, env=env, cwd=REPO_ROOT
    )
    os.close(slave)
    terminal = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            process.kill()
            raise AssertionError(f"no output for 120 s; so far: {terminal!r}")
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        terminal += chunk
    os.close(master)
    assert process.stdout is not None
    with process.stdout:
        stdout = process.stdout.read()
    return process.wait(timeout=60), stdout.decode(), terminal.decode(errors="replace")


def test_json_watch_draws_the_progress_bar_on_a_terminal(live_server: LiveServer, jobs: dict[str, Any]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NTK_")}
    env |= {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.write_key}
    submit = ["--json", "jobs", "submit", jobs["slow"], "--x1", f"dataset:{jobs['dataset']}", "--tile-size", "4"]
    code, stdout, terminal = _run_on_a_terminal([*submit, "--watch"], env)
    assert code == 0, terminal
    assert json.loads(stdout)["status"] == "succeeded"  # stdout holds only the JSON
    assert "3/3 tiles 100%" in terminal and "succeeded" in terminal  # the bar, on the terminal
    piped = subprocess.run(
        [sys.executable, "-m", "ntk_service", *submit, "--watch"], capture_output=True, text=True, env=env, timeout=300
    )
    assert piped.returncode == 0 and json.loads(piped.stdout)["status"] == "succeeded"
    assert "tiles" not in piped.stderr  # no terminal: no bar in a log file
