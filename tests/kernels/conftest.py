"""Fixtures and helpers shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntk_service.kernels import KernelMode, compute_ntk
from ntk_service.kernels.structured import StructuredOptions
from ntk_service.kernels.structured import contraction as structured_contraction

AUTOGRAD_CAPTURE = StructuredOptions(chain=False)
"""Plain ``nn.Sequential`` models take the autograd capture too (NOTE [sequential chains] would otherwise capture
them in closed form), for tests of that capture's own shortcuts."""


def structured_ntk(
    model: nn.Module,
    x1: torch.Tensor,
    x2: torch.Tensor | None,
    mode: KernelMode,
    *,
    options: StructuredOptions,
    params: list[str] | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The structured kernel under ``options``, by the public path (``compute_ntk(structured_options=...)``)."""
    return compute_ntk(
        model, x1, x2, mode=mode, implementation="structured", params=params, dtype=dtype, structured_options=options
    ).theta


@pytest.fixture
def shared_deltas(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every Δ (k, k) the structured contraction takes its example-independent shortcut with (NOTE
    [example-independent δ]), recorded by a spy that returns what the real ``shared_gram`` returns (it observes,
    it does not steer)."""
    shared: list[torch.Tensor] = []
    real = structured_contraction.shared_gram

    def spy(*args: object) -> torch.Tensor | None:
        delta = real(*args)  # type: ignore[arg-type]
        if delta is not None:
            shared.append(delta)
        return delta

    monkeypatch.setattr(structured_contraction, "shared_gram", spy)
    return shared
