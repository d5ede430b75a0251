"""The CLI with a model taking several inputs, against the real server: ``kernel`` and ``analyze spectrum`` read
named arrays from a ``.npz`` (``allow_pickle=False``) or a ``.safetensors`` file, ``models list``/``show`` print
the inputs, and an ``.npz`` holding an object array is refused with one error line, never unpickled."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.client import Client
from tests.conftest import LiveServer
from tests.reference import assert_matches, reference_ntk
from tests.server.test_named_inputs_http import DTYPES, SHAPES, _MaskedBag, _tokens, _torch


def _cli(live_server: LiveServer, *args: str) -> Any:
    env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.write_key}
    return CliRunner().invoke(app, list(args), env=env)


def _ok(result: Any) -> Any:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result


@pytest.mark.slow
def test_kernel_and_spectrum_read_npz_and_safetensors_of_named_arrays(live_server: LiveServer, tmp_path: Path) -> None:
    torch.manual_seed(5)
    module = _MaskedBag().eval()
    name = f"cli-bag-{uuid.uuid4().hex[:6]}"
    with Client(live_server.url, api_key=live_server.write_key) as client:
        client.register_module(name, module, input_shape=SHAPES, input_dtype=DTYPES)
    x1, x2 = _tokens(3, 8, padded=True), _tokens(2, 9, padded=False)
    np.savez(tmp_path / "x1.npz", **x1)
    safetensors.numpy.save_file(x2, str(tmp_path / "x2.safetensors"))
    expected = reference_ntk(module, _torch(x1), _torch(x2))
    _ok(_cli(live_server, "kernel", name, "--x1", str(tmp_path / "x1.npz"), "--x2", str(tmp_path / "x2.safetensors"),
             "--dtype", "float64", "-o", str(tmp_path / "theta.npy")))  # fmt: skip
    assert_matches(torch.from_numpy(np.load(tmp_path / "theta.npy")), expected, 1e-9)

    spectrum = _ok(_cli(live_server, "analyze", "spectrum", name, "--x", str(tmp_path / "x1.npz"), "--json"))
    assert '"eigenvalues"' in spectrum.stdout

    listing = _ok(_cli(live_server, "models", "list")).stdout
    assert "input_ids [5] int64, attention_mask [5] int64" in listing
    shown = _ok(_cli(live_server, "models", "show", name)).stdout
    assert "attention_mask" in shown


def test_an_npz_with_an_object_array_or_an_odd_name_is_refused(live_server: LiveServer, tmp_path: Path) -> None:
    np.savez(tmp_path / "objects.npz", input_ids=np.array([{"a": 1}, None], dtype=object))
    np.savez(tmp_path / "odd.npz", **{"input ids": np.zeros((2, 5), dtype=np.int64)})
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 16)
    for path, needle in (
        ("objects.npz", "not a .npz of plain numeric arrays"),
        ("odd.npz", "is not an identifier"),
        ("junk.safetensors", "safetensors"),
    ):
        result = _cli(live_server, "kernel", "any-model", "--x1", str(tmp_path / path))
        assert result.exit_code != 0 and result.stderr.startswith("error: "), (path, result.stderr)
        assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, (path, result.stderr)
