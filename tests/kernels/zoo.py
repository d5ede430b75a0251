"""A small model zoo for the engine tests: each entry builds a model and matching inputs (x1, x2)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


class TiedAutoencoder(nn.Module):
    """Decoder weight tied to the encoder's (the same Parameter used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(5, 3)
        self.decoder = nn.Linear(3, 5)
        self.decoder.weight = self.encoder.weight  # (3, 5) used transposed below
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        y = torch.tanh(h @ self.decoder.weight + self.decoder.bias)
        return self.head(y)


class TokenModel(nn.Module):
    """Embedding over integer tokens (T,), LayerNorm, mean pooling, Linear head."""

    def __init__(self, vocab: int = 7, d: int = 4, k: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, k)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)).mean(dim=1))


class SequenceOutput(nn.Module):
    """Per-position logits: (T, d) -> (T, V), flattened to k = T·V by the engine."""

    def __init__(self, d: int = 3, v: int = 4) -> None:
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(x)))


@dataclass(frozen=True)
class ZooEntry:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    subset: list[str]  # a parameter subset (globs) for the subset tests


def _floats(*shape: int) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    return lambda g: (torch.randn(3, *shape, generator=g), torch.randn(2, *shape, generator=g))


def _mlp(act: type[nn.Module]) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(4, 6), act(), nn.Linear(6, 5), act(), nn.Linear(5, 3))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 2, 2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(8, 2),
    )


def _tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 7, (3, 5), generator=g), torch.randint(0, 7, (2, 5), generator=g)


ZOO = [
    ZooEntry("mlp_relu", _mlp(nn.ReLU), _floats(4), ["2.*"]),
    ZooEntry("mlp_tanh", _mlp(nn.Tanh), _floats(4), ["0.weight", "4.*"]),
    ZooEntry("mlp_gelu", _mlp(nn.GELU), _floats(4), ["0.*"]),
    ZooEntry("cnn", _cnn, _floats(2, 5, 5), ["0.*"]),
    ZooEntry("tied", TiedAutoencoder, _floats(5), ["encoder.weight"]),
    ZooEntry(
        "layernorm",
        lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2)),
        _floats(4),
        ["1.*"],
    ),
    ZooEntry("embedding", TokenModel, _tokens, ["embed.*"]),
    ZooEntry("k1", lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), _floats(3), ["2.bias"]),
    ZooEntry("seq_output", SequenceOutput, _floats(2, 3), ["out.*"]),
]


@functools.cache
def zoo_case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The zoo entry's model (seed 0) and inputs x1, x2 (seed 1), built once per test session; never mutated."""
    entry = next(e for e in ZOO if e.name == name)
    torch.manual_seed(0)
    model = entry.build()
    x1, x2 = entry.inputs(torch.Generator().manual_seed(1))
    return model, x1, x2
