"""Whether a model's graph calls an operator: how the scoped rewrites (``affine_batchnorm``,
``pointwise_convolution``) see an exported program, whose layers are ATen calls rather than ``nn.Module`` types."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

__all__ = ["graph_calls"]


def graph_calls(module: nn.Module, targets: Collection[Any]) -> bool:
    """True when ``module`` or a submodule is an ``fx.GraphModule`` (an exported program's module) with a
    ``call_function`` node whose target is one of ``targets``."""
    return any(
        node.op == "call_function" and node.target in targets
        for sub in module.modules()
        if isinstance(sub, torch.fx.GraphModule)
        for node in sub.graph.nodes
    )
