"""``ntk-service plot`` in a client-only install with the [plot] extra: torch and scipy absent.

A subprocess blocks both imports (``sys.modules[name] = None`` makes ``import name`` raise ImportError, as in an
install without them) and runs the plot commands on stored files: heatmap, spectrum of eigenvalues and training
curves work; the spectrum of a square kernel file, the one plot that computes with the engine, says what to install.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("matplotlib")

_SCRIPT = """
import json, sys
sys.modules.update(torch=None, scipy=None)  # as in `pip install 'ntk-service[plot]'`: neither is installed
from typer.testing import CliRunner
from ntk_service.cli import app
runner = CliRunner()
results = [runner.invoke(app, args) for args in json.loads(sys.argv[1])]
print(json.dumps([[r.exit_code, r.stdout, r.stderr] for r in results]))
"""


def test_plots_of_stored_files_need_neither_torch_nor_scipy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    np.save(tmp_path / "theta.npy", rng.standard_normal((3, 3, 2, 2)))  # FULL (N, N, k, k)
    np.save(tmp_path / "eig.npy", np.array([4.0, 2.0, 0.5, 1e-3]))
    np.savez(tmp_path / "pred.npz", times=np.array([0.0, 1.0, 10.0]), test=rng.standard_normal((3, 2, 2)))
    commands = [
        ["plot", "heatmap", "theta.npy", "-o", "heat.png"],
        ["plot", "spectrum", "eig.npy", "-o", "spectrum.png"],
        ["plot", "training", "pred.npz", "-o", "curves.png"],
        ["plot", "spectrum", "theta.npy", "-o", "from-kernel.png"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(commands)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "MPLBACKEND": "Agg", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (code, stdout, stderr), name in zip(results[:3], ("heat.png", "spectrum.png", "curves.png"), strict=True):
        assert code == 0 and stdout.strip() == f"wrote {name}", stderr
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, stderr = results[3]
    assert code == 2 and "computing its eigenvalues here needs pip install 'ntk-service[server]'" in stderr, stderr
    assert not (tmp_path / "from-kernel.png").exists()
