"""Tiny model factories for the factory family (an operator would list e.g. ``mylab.models:make_net``)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_mlp(width: int = 4, outputs: int = 2) -> nn.Module:
    """(B, 3) float32 -> (B, outputs)."""
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, outputs))


def not_a_module() -> int:
    return 42


class TiedLM(nn.Module):
    """Token ids (B, T) -> (B, vocab): the output layer shares the embedding matrix; a buffer scales the features."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0))
        self.embedding = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(dim=-2) * self.scale)


def tied_lm(vocab: int = 5, width: int = 3) -> nn.Module:
    return TiedLM(vocab, width)


def huge_on_meta(width: int = 10_000) -> nn.Module:
    """width² parameters that take no memory (meta device): for the parameter cap."""
    with torch.device("meta"):
        return nn.Linear(width, width)
