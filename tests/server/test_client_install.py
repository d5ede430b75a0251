"""A client-only install: a fresh virtual environment with ``pip install ntk-service`` (no extras) at the lowest
versions ``pyproject.toml`` allows, without torch or FastAPI, talks to a real server.

The package is built as a wheel from this checkout; its declared dependencies are installed pinned to their lower
bounds (``httpx>=0.27`` becomes ``httpx==0.27``), so this test is also what verifies those bounds. The kernel the
fresh environment receives is checked here against the float64 reference on the model rebuilt from its weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REPO_ROOT, LiveServer
from tests.reference import reference_ntk
from tests.server.support import TINY_ARCHITECTURES, assert_close_to_reference, rebuild

INSTALL_TIMEOUT_S = 300
"""pip from a warm cache takes seconds; a cold one downloads numpy and friends (~20 MB)."""

_SCRIPT = """
import importlib.util, json, sys
import numpy as np
from ntk_service import Client, __version__
from ntk_service.client import KernelResult

missing = [m for m in ("torch", "fastapi", "uvicorn", "zarr", "pydantic") if importlib.util.find_spec(m) is not None]
assert not missing, f"a client-only install pulled in {missing}"
client = Client()  # NTK_URL and NTK_API_KEY from the environment
record = client.register_model("client-only-mlp", json.loads(sys.argv[1]), seed=5)
x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
result = client.ntk_result("client-only-mlp", x, mode="full")
assert isinstance(result, KernelResult)
np.save(sys.argv[2], result.theta)
print(json.dumps({"version": __version__, "record": record, "implementation": result.implementation}))
"""


def _lower_bounds() -> list[str]:
    """The plain install's requirements with each ``>=`` bound pinned exactly (``httpx>=0.27`` -> ``httpx==0.27``)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pins = []
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement.strip())
        assert match, f"pyproject.toml: {requirement!r} is not 'name>=version'; update this test"
        pins.append(f"{match.group(1)}=={match.group(2)}")
    return pins


def _run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_client_only_install_talks_to_a_server(live_server: LiveServer, tmp_path: Path) -> None:
    dist, venv = tmp_path / "dist", tmp_path / "venv"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(REPO_ROOT),
        ]
    )
    wheel = next(dist.glob("ntk_service-*.whl"))
    # No pip inside the venv (ensurepip costs seconds of CPU): this pip installs into it through --python.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NTK_", "PIP_CONSTRAINT", "VIRTUAL_ENV"))}
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check"]
    _run([*pip, *_lower_bounds(), str(wheel)], env=env)

    env.update(NTK_URL=live_server.url, NTK_API_KEY=live_server.write_key)
    theta_path = tmp_path / "theta.npy"
    arch = json.dumps(TINY_ARCHITECTURES["mlp"])
    out = _run([python, "-c", _SCRIPT, arch, str(theta_path)], env=env, cwd=tmp_path).stdout
    info = json.loads(out.strip().splitlines()[-1])
    assert info["record"]["name"] == "client-only-mlp" and info["implementation"] != "auto"

    # The kernel the fresh environment got, against the float64 reference on the registered weights.
    with live_server.client("read") as client:
        weights = client.get("/v1/models/client-only-mlp/versions/1/weights").content
    model = rebuild(info["record"], weights)
    x = torch.linspace(-1, 1, 12, dtype=torch.float32).reshape(3, 4)
    assert_close_to_reference(np.load(theta_path), reference_ntk(model, x, None, "full"))

    # The CLI works from the same install; `serve` says how to get the server instead of a traceback.
    listed = _run([str(venv / "bin" / "ntk-service"), "models", "list", "--json"], env=env, cwd=tmp_path).stdout
    assert "client-only-mlp" in listed
    serve = subprocess.run(
        [str(venv / "bin" / "ntk-service"), "serve"], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert serve.returncode == 2 and "pip install 'ntk-service[server]'" in serve.stderr, serve.stderr
