"""``ntk-service nngp | monte-carlo | matvec`` and ``kernel --mode pseudo`` against a real server, checked against
the float64 reference (or features written out) on the seeded model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.cli._kernel_family import MAX_SEEDS
from ntk_service.kernels.family.monte_carlo import MAX_MONTE_CARLO_SEEDS
from ntk_service.registry.zoo import build_model
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server.support import TINY_ARCHITECTURES

MLP = TINY_ARCHITECTURES["mlp"]
NAME = "cli-family-mlp"


@pytest.fixture(scope="module")
def cli(live_server: LiveServer) -> Any:
    runner = CliRunner()

    def invoke(*args: str, key: str = "read") -> Any:
        token = live_server.read_key if key == "read" else live_server.write_key
        result = runner.invoke(app, list(args), env={"NTK_URL": live_server.url, "NTK_API_KEY": token})
        return result

    registered = invoke("models", "register", NAME, "--architecture", json.dumps(MLP), "--seed", "2", key="write")
    assert registered.exit_code == 0, registered.output
    return invoke


def _ok(result: Any) -> Any:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result


def test_family_commands_write_what_the_reference_gives(cli: Any, tmp_path: Path) -> None:
    model = build_model(MLP, 2)[0]
    rng = np.random.default_rng(0)
    x1 = rng.standard_normal((3, 4)).astype(np.float32)
    np.save(tmp_path / "x1.npy", x1)
    t1 = torch.from_numpy(x1)
    full = reference_ntk(model, t1)

    out = tmp_path / "k.npy"
    args = ("nngp", NAME, "--x1", str(tmp_path / "x1.npy"), "--layer", "activation", "--mode", "trace")
    result = _ok(cli(*args, "--dtype", "float64", "-o", str(out)))
    assert result.stdout.startswith(f"wrote {out}: (3, 3) float64 (mode trace, layer activation, features 8")
    with torch.no_grad():
        phi = torch.tanh(model.double().layers[0](t1.double()))
    np.testing.assert_allclose(np.load(out), (phi @ phi.T).numpy(), rtol=1e-9)

    mean = tmp_path / "mc.npy"
    args = ("monte-carlo", NAME, "--x1", str(tmp_path / "x1.npy"), "--seeds", "3-4", "--mode", "trace")
    _ok(cli(*args, "--dtype", "float64", "-o", str(mean)))
    samples = torch.stack([reference_ntk(build_model(MLP, s)[0], t1, None, "trace") for s in (3, 4)])
    np.testing.assert_allclose(np.load(mean), samples.mean(0).numpy(), rtol=1e-9)
    np.testing.assert_allclose(np.load(tmp_path / "mc.stderr.npy"), (samples.std(0) / np.sqrt(2)).numpy(), rtol=1e-7)

    v = rng.standard_normal((3, 3))
    np.save(tmp_path / "v.npy", v)
    printed = _ok(cli("matvec", NAME, "--x1", str(tmp_path / "x1.npy"), "--v", str(tmp_path / "v.npy"), "--json"))
    product = np.asarray(json.loads(printed.stdout)["product"]["data"]).reshape(3, 3)
    expected = torch.einsum("nmab,mb->na", full, torch.from_numpy(v)).numpy()
    np.testing.assert_allclose(product, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())

    pseudo = tmp_path / "p.npy"
    _ok(
        cli(
            "kernel",
            NAME,
            "--x1",
            str(tmp_path / "x1.npy"),
            "--mode",
            "pseudo",
            "--dtype",
            "float64",
            "-o",
            str(pseudo),
        )
    )
    np.testing.assert_allclose(np.load(pseudo), (full.sum(dim=(2, 3)) / 3).numpy(), rtol=1e-9)


def test_bad_seeds_and_layers_exit_with_clear_messages(cli: Any, tmp_path: Path) -> None:
    np.save(tmp_path / "x1.npy", np.ones((2, 4), np.float32))
    bad = cli("monte-carlo", NAME, "--x1", str(tmp_path / "x1.npy"), "--seeds", "a-b")
    assert bad.exit_code == 2 and "--seeds: expected integers" in bad.stderr
    for text, message in (("0-1024", "more than 1024 seeds"), ("0-10000000000000", "more than 1024"), ("5-1", "empty")):
        bad = cli("monte-carlo", NAME, "--x1", str(tmp_path / "x1.npy"), "--seeds", text)  # refused before any list
        assert bad.exit_code == 2 and "--seeds: " in bad.stderr and message in bad.stderr, (text, bad.stderr)
    bad = cli("nngp", NAME, "--x1", str(tmp_path / "x1.npy"), "--layer", "head")
    assert bad.exit_code == 1 and "unknown_layer" in bad.stderr and "'head' is not a module" in bad.stderr


def test_the_cli_seed_limit_is_the_libraries() -> None:
    assert MAX_SEEDS == MAX_MONTE_CARLO_SEEDS
