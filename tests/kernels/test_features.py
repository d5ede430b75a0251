"""ntk_features against the exact float64 kernel of tests/reference.py: the error's rate in D and its constant
(Wick's theorem, written out by hand below), unbiasedness over seeds, determinism in one process, across
processes and over chunkings, for both sketches, and the limits (the structured sketch's own math:
test_product_sketch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch, UnknownMode, UnsupportedModel
from ntk_service.kernels import MAX_FEATURE_DIM, SketchKind, feature_kernel, ntk_features
from tests.reference import reference_ntk


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _x(n: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _matrix(full: torch.Tensor) -> np.ndarray:
    n, m, k, _ = full.shape
    return full.permute(0, 2, 1, 3).reshape(n * k, m * k).numpy()


SKETCHES = [SketchKind.GAUSSIAN, SketchKind.STRUCTURED]
REPO = Path(__file__).resolve().parents[2]


def test_error_falls_like_one_over_sqrt_d_with_the_gaussian_constant() -> None:
    model, x = _mlp(), _x()
    exact = _matrix(reference_ntk(model, x))
    dims, seeds = (16, 64, 256, 1024), range(10)
    rms = []
    for d in dims:
        squared = [
            np.sum((_matrix(feature_kernel(ntk_features(model, x, dim=d, seed=s, sketch="gaussian"))) - exact) ** 2)
            for s in seeds
        ]
        rms.append(np.sqrt(np.mean(squared)))
    slope = np.polyfit(np.log(dims), np.log(rms), 1)[0]
    assert -0.6 < slope < -0.4, slope
    # E‖ΦΦᵀ − Θ‖²_F = (‖Θ‖²_F + (tr Θ)²) / D for a Gaussian sketch (NOTE [sketch error])
    predicted = np.sqrt((np.sum(exact**2) + np.trace(exact) ** 2) / np.asarray(dims))
    np.testing.assert_allclose(rms, predicted, rtol=0.35)


@pytest.mark.parametrize("sketch", SKETCHES)
def test_the_mean_over_seeds_is_unbiased_full_and_trace(sketch: SketchKind) -> None:
    model, x = _mlp(), _x(4)
    x2 = _x(3, seed=7)
    exact = reference_ntk(model, x, x2).numpy()
    exact_trace = reference_ntk(model, x, x2, mode="trace").numpy()
    samples, traces = [], []
    for s in range(200):  # deterministic seeds: the test is reproducible, its tolerance statistical
        phi1 = ntk_features(model, x, dim=4, seed=s, sketch=sketch)
        phi2 = ntk_features(model, x2, dim=4, seed=s, sketch=sketch)
        samples.append(feature_kernel(phi1, phi2).numpy())
        traces.append(feature_kernel(phi1, phi2, mode="trace").numpy())
    for draws, target in ((np.stack(samples), exact), (np.stack(traces), exact_trace)):
        mean, sem = draws.mean(0), draws.std(0, ddof=1) / np.sqrt(draws.shape[0])
        z = np.abs(mean - target) / sem
        # 48 (or 12) entries: P(max |z| > 4.5) < 48 · 7e-6 for an unbiased estimate (CLT at 200 draws)
        assert float(z.max()) < 4.5, float(z.max())
        assert np.abs(mean - target).max() < 0.2 * np.abs(target).max()  # and it is near, not just noisy


@pytest.mark.parametrize("sketch", SKETCHES)
def test_the_same_seed_gives_the_same_sketch_on_any_chunking(sketch: SketchKind) -> None:
    model, x = _mlp(), _x(6)
    phi = ntk_features(model, x, dim=40, seed=3, sketch=sketch)
    assert phi.shape == (6, 2, 40)
    torch.testing.assert_close(ntk_features(model, x, dim=40, seed=3, sketch=sketch), phi, rtol=0, atol=0)
    parts = torch.cat(
        [
            ntk_features(model, x[:2], dim=40, seed=3, sketch=sketch),
            ntk_features(model, x[2:], dim=40, seed=3, sketch=sketch),
        ]
    )
    torch.testing.assert_close(parts, phi, rtol=1e-14, atol=1e-14)
    chunked = ntk_features(model, x, dim=40, seed=3, memory_budget_bytes=200_000, sketch=sketch)  # a few per call
    torch.testing.assert_close(chunked, phi, rtol=1e-14, atol=1e-14)
    longer = ntk_features(model, x, dim=70, seed=3, sketch=sketch)  # the first 40 columns are the 40-column sketch
    torch.testing.assert_close(longer[:, :, :40] * np.sqrt(70 / 40), phi, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(ntk_features(model, x, dim=40, seed=4, sketch=sketch), phi)


_OTHER_PROCESS = """
import sys, torch
from safetensors.torch import load_file, save_file
from torch import nn
from ntk_service.kernels import ntk_features
folder, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
model.load_state_dict(load_file(folder + "/model.safetensors"))
x = load_file(folder + "/x.safetensors")["x"]
out = {s: ntk_features(model, x, dim=70, seed=3, sketch=s) for s in ("gaussian", "structured")}
save_file({s: phi.contiguous() for s, phi in out.items()}, folder + "/phi.safetensors")
"""


def test_the_same_seed_gives_the_same_bits_in_another_process(tmp_path: Path) -> None:
    """Another interpreter (another PYTHONHASHSEED: nothing may hang on Python's salted hash) gives the same bits
    with the same threads; NOTE [sketch determinism]."""
    model, x = _mlp(), _x(6)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    save_file({"x": x.contiguous()}, tmp_path / "x.safetensors")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"}
    command = [sys.executable, "-c", _OTHER_PROCESS, str(tmp_path), str(torch.get_num_threads())]
    subprocess.run(command, check=True, env=env, capture_output=True, cwd=tmp_path)
    theirs = load_file(tmp_path / "phi.safetensors")  # plain tensors: nothing is unpickled
    for sketch in SKETCHES:
        ours = ntk_features(model, x, dim=70, seed=3, sketch=sketch)
        assert torch.equal(theirs[sketch.value], ours), sketch  # bit for bit
        # and another tiling of the examples agrees to rounding (NOTE [sketch determinism])
        tiles = torch.cat([ntk_features(model, x[i : i + 4], dim=70, seed=3, sketch=sketch) for i in (0, 4)])
        torch.testing.assert_close(tiles, theirs[sketch.value], rtol=1e-14, atol=1e-14)
    assert not torch.allclose(theirs["gaussian"], theirs["structured"])  # two sketches, not one


@pytest.mark.parametrize("sketch", SKETCHES)
def test_a_parameter_subset_sketches_that_subset_s_kernel(sketch: SketchKind) -> None:
    model, x = _mlp(), _x(3)
    exact = _matrix(reference_ntk(model, x, params=["2.*"]))
    est = np.mean(
        [
            _matrix(feature_kernel(ntk_features(model, x, dim=512, seed=s, params=["2.*"], sketch=sketch)))
            for s in range(8)
        ],
        0,
    )
    assert np.linalg.norm(est - exact) / np.linalg.norm(exact) < 0.1


class _BranchesOnValues(nn.Module):
    """A forward that branches on the input's values: vmap over examples refuses it (NOTE [per-example loop])."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 5).all():
            x = 2 * x
        return self.lin(torch.tanh(x))


def test_a_model_refusing_vmap_gets_the_gaussian_sketch_only() -> None:
    torch.manual_seed(0)
    model, x = _BranchesOnValues().double(), _x(4)
    with pytest.raises(UnsupportedModel, match="refuses .* pass sketch='gaussian'"):
        ntk_features(model, x, dim=8, sketch="structured")
    exact = _matrix(reference_ntk(model, x))
    est = np.mean(
        [_matrix(feature_kernel(ntk_features(model, x, dim=256, seed=s, sketch="gaussian"))) for s in range(8)], 0
    )
    assert np.linalg.norm(est - exact) / np.linalg.norm(exact) < 0.15


def test_limits_and_bad_input() -> None:
    model, x = _mlp(), _x()
    for dim in (0, -3, MAX_FEATURE_DIM + 1, 2.5, True):
        with pytest.raises(InvalidInput, match=r"dim must be an integer in \[1, 65536\]"):
            ntk_features(model, x, dim=dim)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"sketch must be one of \['gaussian', 'structured'\], got 'srht'"):
        ntk_features(model, x, dim=8, sketch="srht")
    for sketch in SKETCHES:
        with pytest.raises(MemoryEstimateExceeded, match="ntk_features: .*features of N=5") as info:
            ntk_features(model, x, dim=4096, memory_budget_bytes=100_000, sketch=sketch)
        assert info.value.estimate_bytes > 100_000
    phi = ntk_features(model, x, dim=8)
    with pytest.raises(ShapeMismatch):
        feature_kernel(phi, phi[:, :1])
    with pytest.raises(UnknownMode):
        feature_kernel(phi, mode="example_diagonal")
