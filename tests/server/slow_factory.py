"""An operator-style model factory for the server tests: a Linear model whose forward pass sleeps first.

It makes a kernel computation last a known time on any machine, so tests can observe the server while a
computation runs (health checks, 429 under overload). Registered through ``NTK_MODEL_FACTORIES``, the way an
operator allows a lab's own models.

A ``gate`` (a file path) holds every forward call until the file exists: a test that must see a job unfinished
(a page loading, a SIGTERM arriving) releases it when it has looked, instead of racing a sleep against a loaded
machine. A gate file holding a number n lets n forward calls through (counted per gate in this process) and holds
the next, writing the count to ``<gate>.held`` while it waits: a test steps a job to a point it chose (a solve
past two checkpoints) and stops it there, whatever the machine's speed. An empty gate file lets every call through.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from torch import nn

GATE_TIMEOUT_S = 180.0
"""A gate never opened lets forward calls through after this long, so a failed test cannot hang its server."""


_PASSED: dict[str, int] = {}
"""Forward calls each counted gate has let through in this process."""

_LOCK = threading.Lock()


def _pass(gate: Path) -> None:
    """Wait until ``gate`` lets one more call through (module docstring), or ``GATE_TIMEOUT_S``."""
    deadline = time.monotonic() + GATE_TIMEOUT_S
    key, told = str(gate), -1
    while time.monotonic() < deadline:
        if gate.exists():
            text = gate.read_text().strip()
            with _LOCK:
                passed = _PASSED.get(key, 0)
                if not text or passed < int(text):
                    _PASSED[key] = passed + 1
                    return
            if told != passed:  # say once per count that a call waits here
                held = gate.with_name(gate.name + ".held")
                partial = held.with_name(held.name + ".partial")
                partial.write_text(str(passed))
                os.replace(partial, held)
                told = passed
        time.sleep(0.005)


class SlowLinear(nn.Module):
    """(N, in_dim) -> (N, out_dim), sleeping ``delay_s`` in each forward call (vmap calls it once per block), after
    waiting for the file ``gate`` to exist when one is given."""

    def __init__(self, in_dim: int, out_dim: int, delay_s: float, gate: str | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)
        self.delay_s = delay_s
        self.gate = None if gate is None else Path(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None and not x.is_meta:  # shape probes on meta tensors compute nothing: not held
            _pass(self.gate)
        time.sleep(self.delay_s)
        # "* 1.0": an operation of its own, so the structured engine must run this forward for every block; a bare
        # pipeline of known layers is captured without calling it (NOTE [sequential chains]), and would not sleep.
        return self.linear(x) * 1.0


def build(in_dim: int = 4, out_dim: int = 2, delay_s: float = 0.0, gate: str | None = None) -> nn.Module:
    """The factory named ``tests.server.slow_factory:build`` in the test servers' allow-list."""
    return SlowLinear(in_dim, out_dim, delay_s, gate)
