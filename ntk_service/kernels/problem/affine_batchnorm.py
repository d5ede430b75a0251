"""Eval-mode BatchNorm as its explicit affine map for the duration of a block, in this thread only.

In eval mode ``F.batch_norm`` is y = (x - μ) · (σ² + ε)^-½ · γ + β with constant running statistics μ, σ². Under
``vmap(jacrev)`` its backward, ``aten::native_batch_norm_backward``, has no cheap batching rule for per-example
γ, β gradients: on the benchmark ResNet (N = 32) it and its children took ~58 % of the profiled CPU time of
the Jacobian build. The same function from elementwise primitives differentiates into a few multiplies and
reductions: the ResNet's ``vmap(jacrev)`` side took 0.91 of the CPU time (in-process A/B, docs/engine.md).

``affine_batchnorm()`` is a ``TorchFunctionMode`` (thread-local, scoped, like ``math_attention``): only calls
with ``training=False`` and running statistics are rewritten, ``F.batch_norm`` of a module's forward and
``aten.batch_norm`` of an exported program's graph alike; every other call runs as it is.
``batchnorm_scope(module)`` is the mode for a model with BatchNorm modules or a graph calling ``aten.batch_norm``,
and a no-op for the rest.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ntk_service.kernels.problem.rewrites import ArgumentRewrite, graph_calls

__all__ = ["affine_batchnorm", "batchnorm_scope"]

_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
"""``F.batch_norm``'s parameters in order."""

_ATEN = torch.ops.aten.batch_norm.default
_ATEN_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
"""``aten.batch_norm``'s parameters in order (then ``cudnn_enabled``, which changes nothing on the CPU)."""


def _eval_batch_norm(
    input: torch.Tensor,  # noqa: A002 - F.batch_norm's own name
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """(x - μ) · (σ² + ε)^-½ · γ + β over dim 1 of ``input`` (n, c, *spatial)."""
    shape = (1, -1) + (1,) * (input.dim() - 2)
    out = (input - running_mean.view(shape)) * torch.rsqrt(running_var.view(shape) + eps)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out


class affine_batchnorm(ArgumentRewrite):  # noqa: N801 - used like a function: ``with affine_batchnorm():``
    """Run eval-mode ``F.batch_norm`` as its affine map inside the ``with`` block (see the module docstring)."""

    signatures = {F.batch_norm: _ARGS, _ATEN: _ATEN_ARGS}

    def rewrite(self, bound: dict[str, Any]) -> torch.Tensor | None:
        mean, var = bound.get("running_mean"), bound.get("running_var")
        if bound.get("training", False) or mean is None or var is None:
            return None
        return _eval_batch_norm(
            bound["input"], mean, var, bound.get("weight"), bound.get("bias"), bound.get("eps", 1e-5)
        )


def batchnorm_scope(module: nn.Module) -> contextlib.AbstractContextManager[object]:
    """``affine_batchnorm()`` when ``module`` has BatchNorm modules or is a graph module calling ``aten.batch_norm``
    (an exported program), else a no-op context."""
    has = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    return affine_batchnorm() if has or graph_calls(module, (_ATEN,)) else contextlib.nullcontext()
