"""Fixtures and helpers shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ntk_service.kernels import KernelMode
from ntk_service.kernels.blocks import run_blocks
from ntk_service.kernels.functional import eval_semantics, prepare_problem
from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.planning import plan_blocks
from ntk_service.kernels.structured import Structured, StructuredOptions
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
    groups: ParameterGroups | None = None,
) -> torch.Tensor:
    """The structured kernel under ``options``: compute_ntk's pipeline (eval semantics, a prepared problem, the
    block plan and runner) with ``Structured(options)`` as the algorithm; with ``groups`` (G, *theta), one kernel
    per group (``params`` must then select exactly the groups' parameters)."""
    alg = Structured(options)
    with eval_semantics(model) as module:
        problem, x1t, x2t = prepare_problem(module, x1, x2, params=params, dtype=dtype)
        symmetric = x2t is None or mode is KernelMode.EXAMPLE_DIAGONAL
        m = x1t.shape[0] if x2t is None else x2t.shape[0]
        g = 1 if groups is None else len(groups)
        plan = plan_blocks(alg, problem, x1t.shape[0], m, mode, symmetric=symmetric, budget_bytes=2**30, groups=g)
        return run_blocks(alg, problem, x1t, None if symmetric else x2t, mode, plan, groups=groups)


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
