"""Strided 1x1 convolutions as a strided slice and a matmul for the duration of a block, in this thread only.

A 1x1 convolution with stride s and no padding is y[n, o, i, j] = Σ_c W[o, c] · x[n, c, s·i, s·j] (+ b[o]): the
matmul of W (o, c) with the slice x[:, :, ::s, ::s]. Under ``vmap(jacrev)`` (the Jacobian contraction's build,
NOTE [strided pointwise convolution]) that form differentiates into a matmul and a strided scatter, where oneDNN's
strided 1x1 backward is slow on the CPU: the ResNet shortcuts' backward (N = 16, batch N·k = 160) was one of the
largest ops of the profiled Jacobian build for 2 % of its FLOPs.

``strided_pointwise_convolution()`` is a ``TorchFunctionMode`` (thread-local, scoped, like ``affine_batchnorm``):
only 2-d convolutions of a batched (4-d) input with a 1x1 kernel, a stride other than 1, no padding and one group
are rewritten, ``F.conv2d`` of a module's forward and ``aten.conv2d`` / ``aten.convolution`` of an exported
program's graph alike; every other call runs as it is. ``pointwise_scope(module)`` is the mode for a model with such
a ``Conv2d`` or a graph calling those ops, and a no-op for the rest.

NOTE [strided pointwise convolution]: measured on the Jacobian contraction's two sides (``jacobian_chunks``), one
process, alternating, 7 rounds, CPU time with the rewrite / without, on the benchmark ResNet and its variants
(GroupNorm, two blocks per width, twice the width) at N = M = 16 and 32: 0.91-1.05 in 14 cells of two runs, median
0.95 (docs/benchmarks.md, "Issue 37, round 5"). Stride-1 1x1 convolutions are left alone (not measured to pay),
and so are the other rewrites tried (every convolution through ``unfold``: 1.35-1.99x; channels-last: 1.02-1.15x).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ntk_service.kernels.problem.rewrites import ArgumentRewrite, graph_calls

__all__ = ["pointwise_scope", "strided_pointwise_convolution"]

_CONV2D = (F.conv2d, torch.ops.aten.conv2d.default)
_CONV2D_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
"""``F.conv2d``'s and ``aten.conv2d``'s parameters in order."""

_ATEN = torch.ops.aten.convolution.default
_ATEN_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
"""``aten.convolution``'s parameters in order."""


def _pair(value: Any) -> tuple[int, ...] | None:
    """An int or a sequence of ints as a tuple of two; None for anything else (a padding string)."""
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, tuple | list) and all(isinstance(v, int) for v in value):
        return tuple(value) * (2 if len(value) == 1 else 1)
    return None


def _stride(bound: dict[str, Any]) -> tuple[int, ...] | None:
    """The stride of a call this mode rewrites, or None to run the call as it is."""
    x, w = bound.get("input"), bound.get("weight")
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 4 or w.dim() != 4:
        return None
    if tuple(w.shape[-2:]) != (1, 1) or bound.get("groups", 1) != 1 or bound.get("transposed", False):
        return None
    stride, padding = _pair(bound.get("stride", 1)), _pair(bound.get("padding", 0))
    if stride is None or len(stride) != 2 or stride == (1, 1) or padding != (0, 0):
        return None
    return stride


def _pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, ...]) -> Any:
    """W (o, c) @ x[:, :, ::s0, ::s1] (n, c, h', w') -> (n, o, h', w'), plus the bias."""
    sliced = x[:, :, :: stride[0], :: stride[1]]
    n, c, h, w = sliced.shape
    out = (weight.reshape(weight.shape[0], c) @ sliced.reshape(n, c, h * w)).view(n, -1, h, w)
    return out if bias is None else out + bias.view(1, -1, 1, 1)


class strided_pointwise_convolution(ArgumentRewrite):  # noqa: N801 - used like a function
    """Run strided 1x1 convolutions as a slice and a matmul inside the ``with`` block (see the module docstring)."""

    signatures = {**dict.fromkeys(_CONV2D, _CONV2D_ARGS), _ATEN: _ATEN_ARGS}

    def rewrite(self, bound: dict[str, Any]) -> torch.Tensor | None:
        stride = _stride(bound)
        return None if stride is None else _pointwise(bound["input"], bound["weight"], bound.get("bias"), stride)


def pointwise_scope(module: nn.Module) -> contextlib.AbstractContextManager[object]:
    """``strided_pointwise_convolution()`` when ``module`` has a strided 1x1 ``Conv2d`` or is a graph module calling
    ``aten.conv2d`` or ``aten.convolution`` (an exported program), else a no-op context."""
    has = any(isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and m.stride != (1, 1) for m in module.modules())
    has = has or graph_calls(module, (*_CONV2D, _ATEN))
    return strided_pointwise_convolution() if has else contextlib.nullcontext()
