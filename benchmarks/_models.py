"""The two benchmark models, in torch, seeded so every benchmark script builds the same weights.

- ``make_mlp()``: 784-512-512-10, ReLU, biases. Input (N, 784), output (N, 10), P = 669,706.
- ``make_cnn()``: input (N, 3, 32, 32); conv 3x3 3->32, ReLU, conv 3x3 stride 2 32->32, ReLU, flatten,
  Linear 6272->10; no padding. Output (N, 10), P = 72,906.

``benchmarks/peer_neural_tangents.py`` builds the same architectures with neural-tangents' stax;
``export_weights_npz`` hands our weights and inputs to it so both sides can be checked to compute the same
kernel (``_peer.check_peer_kernel``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

MODEL_SEED = 0
"""Seed of the weight initialisation: the same model in every script and every run."""

INPUT_SEED = 1
"""Seed of the random inputs (``make_inputs``); x2 uses ``INPUT_SEED + 1``."""

INPUT_SHAPES: dict[str, tuple[int, ...]] = {"mlp": (784,), "cnn": (3, 32, 32)}
"""Per-example input shape of each benchmark model (torch layout, NCHW for the CNN)."""


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.eval()


def make_mlp(seed: int = MODEL_SEED) -> nn.Module:
    """MLP 784-512-512-10 with ReLU and biases (torch's default init, seeded). Output (N, 10)."""
    return _seeded(
        lambda: nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)),
        seed,
    )


def make_cnn(seed: int = MODEL_SEED) -> nn.Module:
    """CNN on (N, 3, 32, 32): conv 3x3 3->32, ReLU, conv 3x3/2 32->32, ReLU, flatten, Linear 6272->10."""
    return _seeded(
        lambda: nn.Sequential(
            nn.Conv2d(3, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 14 * 14, 10),
        ),
        seed,
    )


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": make_mlp, "cnn": make_cnn}
"""Benchmark model name -> builder; the names match ``peer_neural_tangents.py --models``."""


def make_inputs(name: str, n: int, seed: int = INPUT_SEED) -> torch.Tensor:
    """Standard-normal float32 inputs for model ``name``: (n, 784) or (n, 3, 32, 32)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, *INPUT_SHAPES[name], generator=generator)


def model_name(model: nn.Module) -> str:
    """'cnn' if ``model`` has a Conv2d, else 'mlp' (the two architectures above)."""
    return "cnn" if any(isinstance(m, nn.Conv2d) for m in model.modules()) else "mlp"


def export_weights_npz(model: nn.Module, x1: torch.Tensor, path: str | Path, x2: torch.Tensor | None = None) -> None:
    """Write ``model``'s weights and the inputs for ``peer_neural_tangents.py --check``.

    Args:
        model: one of the benchmark models (``make_mlp()``/``make_cnn()`` architecture, any weights).
        x1: (N, *input) inputs, torch layout (NCHW for the CNN).
        path: the .npz file to write.
        x2: (M, *input) second inputs. Default: ``x1``.

    The file holds ``model`` ('mlp'|'cnn'), ``x1``, ``x2`` and, for the i-th Linear/Conv2d in forward order,
    ``layer{i}_weight`` (torch layout: Linear (out, in), Conv2d (out, in, kh, kw)) and ``layer{i}_bias``.
    """
    x2 = x1 if x2 is None else x2
    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    arrays: dict[str, np.ndarray] = {
        "model": np.array(model_name(model)),
        "x1": x1.detach().float().numpy(),
        "x2": x2.detach().float().numpy(),
    }
    for i, layer in enumerate(layers):
        arrays[f"layer{i}_weight"] = layer.weight.detach().float().numpy()
        arrays[f"layer{i}_bias"] = layer.bias.detach().float().numpy()
    np.savez(path, **arrays)
