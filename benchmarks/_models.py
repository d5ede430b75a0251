"""The two benchmark models, in torch, seeded so every benchmark script builds the same weights.

- ``make_mlp()``: 784-512-512-10, ReLU, biases. Input (N, 784), output (N, 10), P = 669,706.
- ``make_mlp_wide()``: 784-2048-2048-10, the same otherwise. P = 5,824,522.
- ``make_cnn()``: input (N, 3, 32, 32); conv 3x3 3->32, ReLU, conv 3x3 stride 2 32->32, ReLU, flatten,
  Linear 6272->10; no padding. Output (N, 10), P = 72,906.
- ``make_resnet()``: a CIFAR-style ResNet on (N, 3, 32, 32): conv 3x3 3->16 + BN + ReLU, three basic blocks
  (16, 32/2, 64/2; two conv 3x3 + BN each, 1x1 conv + BN shortcuts where the shape changes), global average
  pool, Linear 64->10. BatchNorm in eval mode with non-trivial running statistics. Output (N, 10), P = 78,042.
- ``make_transformer()``: a two-layer pre-norm transformer classifier on token ids (N, 32) below 256: token and
  learned position embeddings (d = 128), two ``nn.TransformerEncoderLayer`` (4 heads, d_ff = 512,
  ``norm_first``, GELU, batch_first), final LayerNorm, mean over positions, Linear 128->10. Output (N, 10),
  P = 434,954.

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

INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "mlp": (784,),
    "mlp2048": (784,),
    "cnn": (3, 32, 32),
    "resnet": (3, 32, 32),
    "transformer": (32,),
}
"""Per-example input shape of each benchmark model (torch layout, NCHW for the CNN; token ids for the transformer)."""

VOCAB_SIZE = 256
"""Token ids of the transformer are below this."""


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    # fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.eval()


def make_mlp(seed: int = MODEL_SEED, width: int = 512) -> nn.Module:
    """MLP 784-width-width-10 with ReLU and biases (torch's default init, seeded). Output (N, 10)."""
    return _seeded(
        lambda: nn.Sequential(
            nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        ),
        seed,
    )


def make_mlp_wide(seed: int = MODEL_SEED) -> nn.Module:
    """MLP 784-2048-2048-10 (``make_mlp`` with width 2048)."""
    return make_mlp(seed, width=2048)


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


def _norm(kind: str, channels: int) -> nn.Module:
    """BatchNorm2d (eval: running statistics), or GroupNorm of groups of 4 channels (``kind`` "group")."""
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(max(1, channels // 4), channels)


class BasicBlock(nn.Module):
    """y = ReLU(BN(conv3x3(ReLU(BN(conv3x3(x))))) + shortcut(x)); the shortcut is 1x1 conv + BN when the channels or
    the stride change, else the identity. (n, c_in, h, w) -> (n, c_out, h / stride, w / stride). ``norm``: "batch"
    or "group" (``_norm``)."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = _norm(norm, c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(norm, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: stem conv 3x3 + BN + ReLU, ``depth`` BasicBlocks per width (the first of a width at stride
    1 for the first width, 2 for the others), global average pool, Linear head. (n, c, h, w) -> (n, k). ``norm``:
    "batch" (eval BatchNorm) or "group" (GroupNorm)."""

    def __init__(
        self,
        widths: tuple[int, ...] = (16, 32, 64),
        in_channels: int = 3,
        k: int = 10,
        depth: int = 1,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), _norm(norm, widths[0]))
        blocks = []
        c_in = widths[0]
        for i, width in enumerate(widths):
            for j in range(depth):
                blocks.append(BasicBlock(c_in, width, 2 if i > 0 and j == 0 else 1, norm))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(torch.relu(self.stem(x)))
        return self.head(y.mean(dim=(2, 3)))


def randomize_batchnorm(model: nn.Module, generator: torch.Generator) -> nn.Module:
    """Give every BatchNorm non-trivial affine parameters and running statistics (as after training), in place."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                c = module.num_features
                module.weight.copy_(1 + 0.2 * torch.randn(c, generator=generator))
                module.bias.copy_(0.1 * torch.randn(c, generator=generator))
                module.running_mean.copy_(0.1 * torch.randn(c, generator=generator))
                module.running_var.copy_(0.5 + torch.rand(c, generator=generator))
    return model


class TransformerClassifier(nn.Module):
    """Token + learned position embeddings, pre-norm ``nn.TransformerEncoderLayer`` s, final LayerNorm, mean over
    positions, Linear head. Token ids (n, t) with t <= max_len -> (n, k)."""

    def __init__(
        self,
        vocab: int = VOCAB_SIZE,
        max_len: int = 32,
        d: int = 128,
        heads: int = 4,
        d_ff: int = 512,
        layers: int = 2,
        k: int = 10,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(0.02 * torch.randn(max_len, d))
        self.encoder = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(
                    d, heads, d_ff, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
                )
                for _ in range(layers)
            )
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, k)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.encoder(h)).mean(dim=1))


def make_resnet(seed: int = MODEL_SEED) -> nn.Module:
    """The benchmark ResNet (widths 16, 32, 64, k = 10, P = 78,042), BatchNorm statistics seeded too."""
    model = _seeded(ResNet, seed)
    return randomize_batchnorm(model, torch.Generator().manual_seed(seed + 100)).eval()


def make_transformer(seed: int = MODEL_SEED) -> nn.Module:
    """The benchmark transformer (d = 128, 4 heads, 2 layers, T = 32, vocab 256, k = 10, P = 434,954)."""
    return _seeded(TransformerClassifier, seed)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": make_mlp,
    "mlp2048": make_mlp_wide,
    "cnn": make_cnn,
    "resnet": make_resnet,
    "transformer": make_transformer,
}
"""Benchmark model name -> builder; each matches ``peer_neural_tangents.py --models``."""


def make_inputs(name: str, n: int, seed: int = INPUT_SEED) -> torch.Tensor:
    """Inputs for model ``name``: standard-normal float32 (n, 784) or (n, 3, 32, 32), or token ids (n, 32)."""
    generator = torch.Generator().manual_seed(seed)
    if name == "transformer":
        return torch.randint(0, VOCAB_SIZE, (n, *INPUT_SHAPES[name]), generator=generator)
    return torch.randn(n, *INPUT_SHAPES[name], generator=generator)


def model_name(model: nn.Module) -> str:
    """'cnn' if ``model`` has a Conv2d, else 'mlp' (the two architectures above)."""
    return "cnn" if any(isinstance(m, nn.Conv2d) for m in model.modules()) else "mlp"


def export_weights_npz(
    model: nn.Module, x1: torch.Tensor, path: str | Path, x2: torch.Tensor | None = None, name: str | None = None
) -> None:
    """Write ``model``'s weights and the inputs for ``peer_neural_tangents.py --check``.

    Args:
        model: one of the benchmark models (any weights).
        x1: (N, *input) inputs, torch layout (NCHW for images).
        path: the .npz file to write.
        x2: (M, *input) second inputs. Default: ``x1``.
        name: the benchmark model's name (``MODELS``). Default: ``model_name(model)`` ('mlp' or 'cnn').

    The file holds ``model`` (the name), ``x1``, ``x2`` and, for 'mlp', 'mlp2048' and 'cnn', for the i-th
    Linear/Conv2d in forward order, ``layer{i}_weight`` (torch layout: Linear (out, in), Conv2d (out, in, kh, kw))
    and ``layer{i}_bias``; for 'resnet' and 'transformer' every parameter as ``param:<name>`` and every buffer as
    ``buffer:<name>`` (torch names and layouts).
    """
    x2 = x1 if x2 is None else x2
    name = model_name(model) if name is None else name
    arrays: dict[str, np.ndarray] = {
        "model": np.array(name),
        "x1": x1.detach().numpy() if name == "transformer" else x1.detach().float().numpy(),
        "x2": x2.detach().numpy() if name == "transformer" else x2.detach().float().numpy(),
    }
    if name in ("resnet", "transformer"):
        arrays |= {f"param:{key}": value.detach().float().numpy() for key, value in model.named_parameters()}
        arrays |= {f"buffer:{key}": value.detach().float().numpy() for key, value in model.named_buffers()}
    else:
        layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
        for i, layer in enumerate(layers):
            arrays[f"layer{i}_weight"] = layer.weight.detach().float().numpy()
            arrays[f"layer{i}_bias"] = layer.bias.detach().float().numpy()
    np.savez(path, **arrays)
