"""The ``ntk-service`` CLI used as a user would: ``CliRunner`` against the real server of ``tests/conftest.py``,
and one real ``ntk-service serve`` process.

Kernels written with ``-o`` are compared with the float64 reference loop on the downloaded weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy
import torch
from typer.testing import CliRunner

from ntk_service.cli import app
from tests.cli.support import launch_serve
from tests.conftest import REPO_ROOT, LiveServer
from tests.reference import reference_ntk
from tests.server.support import TINY_ARCHITECTURES, assert_close_to_reference, rebuild, sample_inputs

MLP = TINY_ARCHITECTURES["mlp"]


@pytest.fixture
def cli(live_server: LiveServer):
    """Run the CLI with NTK_URL / NTK_API_KEY from the environment (as a user's shell would set them)."""
    runner = CliRunner()

    def invoke(*args: str, key: str | None = "write") -> Any:
        token = {"read": live_server.read_key, "write": live_server.write_key}.get(key or "", key)
        env = {"NTK_URL": live_server.url, "NTK_API_KEY": token or ""}
        return runner.invoke(app, list(args), env=env)

    return invoke


@pytest.fixture
def model_name(cli) -> str:
    name = f"cli-mlp-{uuid.uuid4().hex[:8]}"
    result = cli("models", "register", name, "--architecture", json.dumps(MLP), "--seed", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"registered {name} version 1: 67 parameters")
    return name


def _ok(result: Any) -> Any:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result


def test_models_commands(cli, model_name: str, tmp_path: Path) -> None:
    listed = json.loads(_ok(cli("--json", "models", "list")).stdout)
    assert model_name in {m["name"] for m in listed}
    table = _ok(cli("models", "list", key="read")).stdout.splitlines()
    assert table[0].split() == ["NAME", "VERSION", "FAMILY", "NUM_PARAMS", "INPUT_SHAPE", "OUTPUT_DIM"]
    assert any(line.split()[:3] == [model_name, "1", "mlp"] for line in table[1:])

    families = _ok(cli("models", "architectures", key="read")).stdout
    assert families.startswith("mlp: ") and "  input_dim (" in families and '"family": "transformer"' in families

    record = json.loads(_ok(cli("models", "show", model_name, "--json")).stdout)
    assert record["num_params"] == 67 and record["version"] == 1
    shown = _ok(cli("models", "show", model_name)).stdout
    assert "  layers.0.weight  [8, 4]\n  layers.0.bias    [8]\n" in shown and "num_params" in shown

    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(MLP))
    other = f"{model_name}-file"
    assert json.loads(_ok(cli("models", "register", other, "-a", f"@{spec_file}", "--json")).stdout)["name"] == other

    weights_file = tmp_path / "w.safetensors"
    record = json.loads(_ok(cli("models", "show", other, "--json")).stdout)
    weights = {p["name"]: np.full(p["shape"], 0.5, np.float32) for p in record["parameters"]}
    weights_file.write_bytes(safetensors.numpy.save(weights))
    assert _ok(cli("models", "upload-weights", other, str(weights_file))).stdout.startswith(
        f"uploaded {other} version 2"
    )

    assert _ok(cli("models", "delete", other)).stdout.strip() == f"deleted model {other}"
    missing = cli("models", "show", other)
    assert missing.exit_code == 1
    assert missing.stderr.startswith("error: model_not_found: ") and other in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1 and missing.stdout == ""


def test_kernel_to_file_matches_the_reference(cli, live_server: LiveServer, model_name: str, tmp_path: Path) -> None:
    record = json.loads(_ok(cli("models", "show", model_name, "--json")).stdout)
    x1, x2 = sample_inputs(record, 4, seed=7), sample_inputs(record, 2, seed=8)
    np.save(tmp_path / "x1.npy", x1)
    np.save(tmp_path / "x2.npy", x2)
    out = tmp_path / "theta.npy"
    result = _ok(
        cli(
            "kernel",
            model_name,
            "--x1",
            str(tmp_path / "x1.npy"),
            "--x2",
            str(tmp_path / "x2.npy"),
            "-o",
            str(out),
            key="read",
        )
    )
    assert result.stdout.startswith(f"wrote {out}: (4, 2, 3, 3) float32 (full, ")

    with httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {live_server.read_key}"}) as http:
        weights = http.get(f"/v1/models/{model_name}/versions/1/weights").content
    reference = rebuild(record, weights)
    assert_close_to_reference(np.load(out), reference_ntk(reference, torch.from_numpy(x1), torch.from_numpy(x2)))

    traced = json.loads(
        _ok(
            cli(
                "--json",
                "kernel",
                model_name,
                "--x1",
                str(tmp_path / "x1.npy"),
                "--mode",
                "trace",
                "--params",
                "layers.1.*",
            )
        ).stdout
    )
    assert traced["shape"] == [4, 4] and traced["mode"] == "trace" and traced["output"] is None
    theta = np.asarray(traced["theta"]["data"], dtype=np.float32).reshape(traced["theta"]["shape"])
    expected = reference_ntk(reference, torch.from_numpy(x1), None, "trace", params=["layers.1.*"])
    assert_close_to_reference(theta, expected)


def test_datasets_and_dataset_references(cli, model_name: str, tmp_path: Path) -> None:
    x = np.random.default_rng(9).standard_normal((5, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    uploaded = json.loads(_ok(cli("datasets", "upload", str(tmp_path / "x.npy"), "--name", "cli-ds", "--json")).stdout)
    dataset_id = uploaded["id"]
    assert uploaded["shape"] == [5, 4]
    assert any(line.startswith(dataset_id) for line in _ok(cli("datasets", "list")).stdout.splitlines())
    assert "cli-ds" in _ok(cli("datasets", "show", dataset_id)).stdout

    out_ref, out_inline = tmp_path / "ref.npy", tmp_path / "inline.npy"
    np.save(tmp_path / "rows.npy", x[1:3])
    _ok(cli("kernel", model_name, "--x1", f"dataset:{dataset_id}[1:3]", "-o", str(out_ref)))
    _ok(cli("kernel", model_name, "--x1", str(tmp_path / "rows.npy"), "-o", str(out_inline)))
    np.testing.assert_allclose(np.load(out_ref), np.load(out_inline), rtol=1e-6, atol=1e-7)

    _ok(cli("datasets", "delete", dataset_id))
    gone = cli("kernel", model_name, "--x1", f"dataset:{dataset_id}")
    assert gone.exit_code == 1 and gone.stderr.startswith("error: dataset_not_found: ")


@pytest.mark.parametrize(
    ("args", "key", "code", "pattern"),
    [
        (("models", "list"), "not-a-key", 1, "error: unauthenticated: "),
        (("models", "register", "x", "-a", json.dumps(MLP)), "read", 1, "error: permission_denied: .*write"),
        (("models", "register", "x", "-a", "{family: mlp"), "write", 2, "error: --architecture: not valid JSON"),
        (
            ("models", "register", "x", "-a", "@/nonexistent/spec.json"),
            "write",
            2,
            "error: --architecture file .*cannot read",
        ),
        (("kernel", "m", "--x1", "/nonexistent/x.npy"), "read", 2, "error: --x1: cannot read"),
        (
            ("kernel", "m", "--x1", "dataset:abc[1:x]"),
            "read",
            2,
            "error: --x1: 'dataset:abc\\[1:x\\]' is not a data set reference",
        ),
        (("kernel", "m", "--x1", "x.npy", "--mode", "diagonal"), "read", 2, "Invalid value for '--mode'"),
        (("models", "frobnicate"), "read", 2, "No such command 'frobnicate'"),
    ],
)
def test_errors_are_one_line_with_exit_codes(cli, args: tuple[str, ...], key: str, code: int, pattern: str) -> None:
    result = cli(*args, key=key)
    assert result.exit_code == code, result.output
    assert __import__("re").search(pattern, result.stderr), result.stderr


def test_kernel_refuses_a_non_npy_file_and_prints_small_results(cli, model_name: str, tmp_path: Path) -> None:
    (tmp_path / "bad.npy").write_text("not numpy")
    bad = cli("kernel", model_name, "--x1", str(tmp_path / "bad.npy"))
    assert bad.exit_code == 2 and "expected an application/x-npy body" in bad.stderr
    np.save(tmp_path / "one.npy", np.ones((1, 4), np.float32))
    printed = _ok(cli("kernel", model_name, "--x1", str(tmp_path / "one.npy"), "--mode", "trace"))
    assert printed.stdout.splitlines()[0].startswith("theta: (1, 1) float32 (trace, ")


def test_health(cli, live_server: LiveServer) -> None:
    assert _ok(cli("health", key=None)).stdout.strip() == f"{live_server.url}: ok"
    assert json.loads(_ok(cli("health", "--json", key=None)).stdout) == {"url": live_server.url, "status": "ok"}


def test_unreachable_server_exits_1() -> None:
    result = CliRunner().invoke(app, ["--url", "http://127.0.0.1:9", "models", "list"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: service_unavailable: GET /v1/models: cannot reach http://127.0.0.1:9")
    down = CliRunner().invoke(app, ["--url", "http://127.0.0.1:9", "health"])
    assert down.exit_code == 1 and "cannot reach" in down.stderr


def test_serve_refuses_an_open_server_on_a_public_host(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)], env={"NTK_API_KEYS": ""}
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("error: serve: refusing to bind '0.0.0.0' without API keys")


def test_serve_reports_invalid_configuration(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--port", "70000", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: serve: invalid configuration: port: ")


def test_serve_runs_a_real_server(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "ntk-service"
    command = [str(script)] if script.exists() else [sys.executable, "-c", "from ntk_service.cli import main; main()"]
    log_path = tmp_path / "serve.log"
    # --port overrides the env's NTK_PORT
    process, port = launch_serve(
        command, tmp_path / "data", log_path, NTK_API_KEYS="cli-key:write", NTK_LOG_LEVEL="info", NTK_PORT="1"
    )
    try:
        log = log_path.read_text(errors="replace")  # the start-up log says where the console, docs and API are
        assert f"console:   http://127.0.0.1:{port}/\n" in log and f"API docs:  http://127.0.0.1:{port}/docs\n" in log
        assert f"clients:   export NTK_URL=http://127.0.0.1:{port}   " in log
        runner = CliRunner()
        env_cli = {"NTK_URL": f"http://127.0.0.1:{port}", "NTK_API_KEY": "cli-key"}
        result = runner.invoke(app, ["models", "register", "m", "-a", json.dumps(MLP)], env=env_cli)
        assert result.exit_code == 0, result.stderr
        assert (tmp_path / "data").is_dir() and any((tmp_path / "data").iterdir())
    finally:
        process.terminate()
        returncode = process.wait(timeout=30)
    # NOTE [exit status] in cli/_serve.py: a graceful stop on SIGTERM is a success, not "killed by SIGTERM" (143)
    assert returncode == 0, log_path.read_text(errors="replace")


def test_cli_import_is_light() -> None:
    """``--help`` must not pay for torch, fastapi, the server, httpx or numpy."""
    script = textwrap.dedent(
        """
        import sys
        import ntk_service.cli
        heavy = sorted(m for m in ("torch", "fastapi", "ntk_service.server", "httpx", "numpy") if m in sys.modules)
        print(",".join(heavy))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
    help_run = subprocess.run(
        [sys.executable, "-c", "from ntk_service.cli import main; main()", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert help_run.returncode == 0 and "serve" in help_run.stdout and "kernel" in help_run.stdout
