"""Run the neural-tangents peer (``peer_neural_tangents.py``) from our benchmarks, in its own venv.

The peer needs jax 0.4.25 and numpy<2, which must not touch the project's ``.venv``, so it lives in
``.peer-venv`` (``make peer-venv``) and runs as a subprocess; results come back as JSON lines (timings) or an
.npz (kernels for the cross-check).

    from _peer import run_peer, check_peer_kernel
    rows = run_peer(["mlp"], [64], ["structured_derivatives"], repeats=3)
    # [{"model": "mlp", "n": 64, "implementation": "structured_derivatives", "seconds": 0.025, ...}]
"""

from __future__ import annotations

import json
import select
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _models import export_weights_npz
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = ROOT / ".peer-venv" / "bin" / "python"
PEER_SCRIPT = ROOT / "benchmarks" / "peer_neural_tangents.py"

PEER_IMPLEMENTATIONS = ("jacobian_contraction", "ntk_vector_products", "structured_derivatives")
"""neural-tangents' three implementations, under our names."""

CHECK_RTOL = 1e-4
"""float32 agreement required between our kernel and the peer's, relative to max|theta|."""


class PeerUnavailableError(RuntimeError):
    """``.peer-venv`` is missing or the peer script failed."""


def _require_venv() -> None:
    if not PEER_PYTHON.exists():
        raise PeerUnavailableError(
            f"run_peer: the neural-tangents venv {PEER_PYTHON.parent.parent} does not exist; "
            "create it with `make peer-venv` (jax 0.4.25, neural-tangents 0.6.5; about 300 MB)"
        )


class PeerSession:
    """A long-lived peer process (``--serve``) timing one run per request, to alternate with ours.

    with PeerSession() as peer:
        seconds = peer.time_once("mlp", 64, "structured_derivatives")  # first call compiles and warms up

    ``memory_limit_bytes``: the peer is killed (``PeerUnavailableError``, ``out_of_memory`` set) once its resident
    memory passes this, so a case that cannot run on a shared machine is reported instead of taking the machine's
    memory; ``time_once(..., timeout=)`` likewise for time. A killed session cannot be used again.
    """

    def __init__(self, memory_limit_bytes: int | None = None) -> None:
        _require_venv()
        self.memory_limit_bytes = memory_limit_bytes
        self.last: dict[str, Any] = {}
        self._proc = subprocess.Popen(
            [str(PEER_PYTHON), str(PEER_SCRIPT), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _rss_bytes(self) -> int:
        try:
            with open(f"/proc/{self._proc.pid}/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return 0

    def _kill(self, why: str) -> PeerUnavailableError:
        self._proc.kill()
        self._proc.wait(timeout=60)
        return PeerUnavailableError(f"PeerSession: {why}")

    def time_once(
        self, model: str, n: int, implementation: str, mode: str = "full", timeout: float | None = None
    ) -> float:
        """Seconds of one run of the peer's kernel (N = M = n; mode 'full' or 'trace'); the peer's whole answer
        (``compile_seconds`` on the first request of a case, ``vmhwm_kib``) is kept in ``last``."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{model} {n} {implementation} {mode}\n")
        self._proc.stdin.flush()
        start = time.monotonic()
        while not select.select([self._proc.stdout], [], [], 0.2)[0]:
            if self.memory_limit_bytes is not None and self._rss_bytes() > self.memory_limit_bytes:
                raise self._kill(f"out of memory: the peer passed {self.memory_limit_bytes / 2**30:.0f} GiB resident")
            if timeout is not None and time.monotonic() - start > timeout:
                raise self._kill(f"timed out: no answer within {timeout:.0f} s")
        line = self._proc.stdout.readline()
        if not line:
            stderr = self._proc.stderr.read() if self._proc.stderr else ""
            raise PeerUnavailableError(f"PeerSession: the peer exited; its stderr ends:\n{stderr[-3000:]}")
        self.last = json.loads(line)
        return float(self.last["seconds"])

    def close(self) -> None:
        if self._proc.poll() is not None:
            return
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=60)

    def __enter__(self) -> PeerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run(args: Sequence[str], timeout: float | None) -> str:
    _require_venv()
    command = [str(PEER_PYTHON), str(PEER_SCRIPT), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise PeerUnavailableError(
            f"run_peer: `{' '.join(command)}` exited with {proc.returncode}; its stderr ends:\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def run_peer(
    models: Sequence[str],
    sizes: Sequence[int],
    implementations: Sequence[str] = PEER_IMPLEMENTATIONS,
    repeats: int = 3,
    *,
    max_seconds: float = 60.0,
    default_skips: bool = True,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """Time neural-tangents' empirical NTK (full kernel, N = M) in ``.peer-venv``.

    Args:
        models: benchmark model names ('mlp', 'cnn').
        sizes: N = M values.
        implementations: subset of ``PEER_IMPLEMENTATIONS``. Default: all three.
        repeats: timed runs after a warm-up; ``seconds`` is their median. Default: 3.
        max_seconds: per combination: caps the timed runs; skips one whose N^2 extrapolation exceeds twice
            this. Default: 60.
        default_skips: skip the combinations measured too slow (``SKIPPED_BY_DEFAULT`` in the peer
            script). Default: True.
        timeout: seconds before the subprocess is killed. Default: none.

    Returns:
        One dict per (model, n, implementation): ``seconds`` (median, or None with ``skipped`` the reason),
        ``runs``, ``compile_and_first_seconds``.

    Raises:
        PeerUnavailableError: ``.peer-venv`` is missing (run ``make peer-venv``) or the peer failed.
    """
    args = ["--models", *models, "--sizes", *map(str, sizes), "--implementations", *implementations]
    args += ["--repeats", str(repeats), "--max-seconds", str(max_seconds)]
    if not default_skips:
        args.append("--no-default-skips")
    stdout = _run(args, timeout)
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def peer_kernel(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None = None,
    implementations: Sequence[str] = PEER_IMPLEMENTATIONS,
    name: str | None = None,
) -> dict[str, torch.Tensor]:
    """neural-tangents' full kernel of a benchmark model on our weights and inputs.

    Args:
        model: a benchmark model's architecture (any weights).
        x1: (N, *input) torch layout. x2: (M, *input). Default: ``x1``.
        implementations: which NT implementations to run. Default: all three.
        name: the benchmark model's name (``_models.MODELS``). Default: 'cnn' if it has a Conv2d, else 'mlp'.

    Returns:
        implementation -> theta (N, M, k, k) float32.
    """
    with tempfile.TemporaryDirectory(prefix="ntk-peer-") as tmp:
        weights, out = Path(tmp) / "weights.npz", Path(tmp) / "theta.npz"
        export_weights_npz(model, x1, weights, x2=x2, name=name)
        _run(["--check", str(weights), "--out", str(out), "--implementations", *implementations], None)
        with np.load(out) as data:
            return {impl: torch.from_numpy(data[f"theta_{impl}"]) for impl in implementations}


def check_peer_kernel(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None,
    theta: torch.Tensor,
    implementations: Sequence[str] = PEER_IMPLEMENTATIONS,
    rtol: float = CHECK_RTOL,
    name: str | None = None,
) -> dict[str, float]:
    """Check that our full kernel ``theta`` (N, M, k, k) equals neural-tangents' on the same weights.

    Returns:
        implementation -> max|theta - theta_nt| / max|theta_nt|.

    Raises:
        AssertionError: an implementation differs by more than ``rtol`` (relative to max|theta|).
    """
    errors = {}
    for implementation, theta_nt in peer_kernel(model, x1, x2, implementations, name).items():
        if theta_nt.shape != theta.shape:
            raise AssertionError(
                f"check_peer_kernel: neural-tangents {implementation} gave shape {tuple(theta_nt.shape)}, "
                f"ours is {tuple(theta.shape)}"
            )
        diff = (theta.double() - theta_nt.double()).abs().max()
        errors[implementation] = float(diff / theta_nt.double().abs().max())
    bad = {impl: err for impl, err in errors.items() if err > rtol}
    if bad:
        raise AssertionError(f"check_peer_kernel: relative error above {rtol:g}: {bad}")
    return errors
