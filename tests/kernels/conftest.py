"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch

from ntk_service.kernels import structured_capture, structured_contract


@pytest.fixture
def shared_deltas(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every Δ (k, k) the structured contraction takes its example-independent shortcut with (NOTE
    [example-independent δ]), recorded by a spy around the real ``_example_independent``."""
    shared: list[torch.Tensor] = []
    real = structured_contract._example_independent

    def spy(d1: torch.Tensor, d2: torch.Tensor) -> torch.Tensor | None:
        delta = real(d1, d2)
        if delta is not None:
            shared.append(delta)
        return delta

    monkeypatch.setattr(structured_contract, "_example_independent", spy)
    return shared


@pytest.fixture
def autograd_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain ``nn.Sequential`` models take the autograd capture too (NOTE [sequential chains] would otherwise
    capture them in closed form), for tests of that capture's own shortcuts."""
    monkeypatch.setattr(structured_capture, "sequential_chain", lambda *args: None)
