"""An operator-style model factory for the Ray test: its forward pass kills the Ray worker process once, like an
OOM kill would.

The model remembers the pid of the process that built it (the server, or the test driver). In any other process
(a Ray worker) the first forward pass that finds no marker file creates it and exits at once with ``os._exit(1)``,
so exactly one task dies mid-tile and Ray must retry it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn


class KillOnceMLP(nn.Module):
    """(N, in_dim) -> (N, out_dim): Linear, tanh, Linear; kills its worker once (see the module docstring)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, marker: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, out_dim))
        self.marker = marker
        self.builder_pid = os.getpid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.getpid() != self.builder_pid:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os._exit(1)
        return self.net(x)


def build_kill_once(in_dim: int = 4, hidden: int = 6, out_dim: int = 3, marker: str = "") -> nn.Module:
    """The factory ``tests.jobs.factories:build_kill_once``; ``marker`` is the file that records the one kill."""
    if not marker:
        raise ValueError("build_kill_once: pass marker, a path the first killed worker creates")
    Path(marker).parent.mkdir(parents=True, exist_ok=True)
    return KillOnceMLP(in_dim, hidden, out_dim, marker)


class SlowTanhMLP(nn.Module):
    """(N, 4) -> (N, 3): Linear, tanh, Linear, sleeping ``delay_s`` in every forward call, so a tiled run takes a known
    while and a test can kill it mid-run (the ``* 1.0`` keeps the structured engine calling this forward)."""

    def __init__(self, delay_s: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.net(x) * 1.0


def slow_tiled_problem() -> tuple[nn.Module, torch.Tensor]:
    """The model (seeded) and x (12, 4) of the kill -9 test, identical in the child process and in the test."""
    torch.manual_seed(0)
    model = SlowTanhMLP()
    return model, torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
