"""Models of the kind researchers write as classes (not ``nn.Sequential``), for the ``exported`` family's tests.

Each ``*_case()`` returns ``(module, example)``: a small float64-ready module in eval mode with non-trivial weights
and an example batch (B = 3) of its input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.registry.sequential_models import nested_resnet, train_steps


class GatedLoop(nn.Module):
    """A forward that loops over a ``ModuleList``, each step gated by a learned scalar: x + g·tanh(block(x))."""

    def __init__(self, width: int = 5, depth: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.gate = nn.Parameter(torch.tensor(0.7))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + self.gate * torch.tanh(block(x))
        out: torch.Tensor = self.head(x)
        return out


class PreNormBlock(nn.Module):
    """x + fc2(GELU(fc1(LayerNorm(x)))), a transformer's MLP sublayer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return out


class ResidualMlp(nn.Module):
    """Residual blocks with LayerNorm and GELU, then a head."""

    def __init__(self, width: int = 6, depth: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(PreNormBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


class TinyAttention(nn.Module):
    """Single-head self-attention with ``F.scaled_dot_product_attention`` over (B, T, d), mean-pooled, a head."""

    def __init__(self, d: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + self.out(F.scaled_dot_product_attention(q, k, v))
        out: torch.Tensor = self.head(h.mean(dim=1))
        return out


class ConvBn(nn.Module):
    """Conv2d -> BatchNorm2d (eval, trained running statistics) -> ReLU -> global pool -> Linear."""

    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        out: torch.Tensor = self.head(h.mean(dim=(2, 3)))
        return out


class TwoBranch(nn.Module):
    """A researcher's two-branch block: a LayerNorm'd input feeds a tanh branch and a GELU gate, multiplied, plus a
    Linear skip from the raw input, then a head (issue 37's custom class)."""

    def __init__(self, d: int = 5, hidden: int = 6, classes: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.branch = nn.Linear(d, hidden)
        self.gate = nn.Linear(d, hidden)
        self.skip = nn.Linear(d, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out: torch.Tensor = self.head(torch.tanh(self.branch(h)) * F.gelu(self.gate(h)) + self.skip(x))
        return out


def _trained(module: nn.Module, example: torch.Tensor, seed: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    for parameter in module.parameters():  # weights away from their initial values
        parameter.data.add_(0.1 * torch.randn_like(parameter))
    train_steps(module, example, 2, seed=seed)  # type: ignore[arg-type]  # BatchNorm running statistics move
    return module.eval(), example


def case(name: str) -> tuple[nn.Module, torch.Tensor]:
    """The module (eval mode, trained a little) and an example batch of 3 for a case of ``CASES``."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "gated_loop":
        return _trained(GatedLoop(), torch.randn(3, 5, generator=generator), 1)
    if name == "residual_mlp":
        return _trained(ResidualMlp(), torch.randn(3, 4, generator=generator), 2)
    if name == "attention":
        return _trained(TinyAttention(), torch.randn(3, 3, 4, generator=generator), 3)
    if name == "conv_bn":
        return _trained(ConvBn(), torch.randn(3, 2, 5, 5, generator=generator), 4)
    if name == "nested_resnet":
        return _trained(nested_resnet(width=2), torch.randn(3, 3, 8, 8, generator=generator), 5)
    raise KeyError(name)


CASES = ("gated_loop", "residual_mlp", "attention", "conv_bn", "nested_resnet")
"""The researchers' models of the issue: a ModuleList loop with a gate, residual LayerNorm+GELU blocks, attention,
eval BatchNorm with real running statistics, a nested-Sequential ResNet."""
