"""An operator-style model factory for the server tests: a Linear model whose forward pass sleeps first.

It makes a kernel computation last a known time on any machine, so tests can observe the server while a
computation runs (health checks, 429 under overload). Registered through ``NTK_MODEL_FACTORIES``, the way an
operator allows a lab's own models.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class SlowLinear(nn.Module):
    """(N, in_dim) -> (N, out_dim), sleeping ``delay_s`` in each forward call (vmap calls it once per block)."""

    def __init__(self, in_dim: int, out_dim: int, delay_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        # "* 1.0": an operation of its own, so the structured engine must run this forward for every block; a bare
        # pipeline of known layers is captured without calling it (NOTE [sequential chains]), and would not sleep.
        return self.linear(x) * 1.0


def build(in_dim: int = 4, out_dim: int = 2, delay_s: float = 0.0) -> nn.Module:
    """The factory named ``tests.server.slow_factory:build`` in the test servers' allow-list."""
    return SlowLinear(in_dim, out_dim, delay_s)
