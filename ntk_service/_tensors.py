"""Telling a torch tensor from other arrays without importing torch (the client, the CLI and ``plot`` run where
torch is not installed; the analyses take numpy or torch).

A torch tensor can exist only in a process that has imported torch, so ``sys.modules`` answers exactly, with no
probing of attributes (asking whether an object has ``detach`` and ``cpu`` took any object with such methods
for a tensor).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_torch_tensor"]


def is_torch_tensor(value: Any) -> bool:
    """True for a ``torch.Tensor`` (an ``nn.Parameter`` included); never imports torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
