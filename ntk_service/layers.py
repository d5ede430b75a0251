"""The few modules the declarative ``sequential`` architecture needs beyond ``torch.nn``: build the same model locally.

    >>> from torch import nn
    >>> from ntk_service.layers import MeanPool, PositionEmbedding, Residual
    >>> block = Residual(nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU()),
    ...                  shortcut=nn.Sequential(nn.Conv2d(16, 32, 1, stride=2)))
    >>> block(torch.zeros(5, 16, 8, 8)).shape                    # body(x) + shortcut(x)
    torch.Size([5, 32, 4, 4])
    >>> MeanPool(dim=1)(torch.zeros(5, 7, 32)).shape             # mean over the 7 tokens
    torch.Size([5, 32])
    >>> PositionEmbedding(16, 32)(torch.zeros(5, 7, 32)).shape   # x + weight of positions 0..6
    torch.Size([5, 7, 32])

Every class is a plain ``nn.Module``: its forward calls its child modules and does one elementwise or reduction
step, with no state, so the kernel engine's layer rules see the ``torch.nn`` layers inside (a ``Residual``'s convs
are covered by the Conv rule) and the rest is differentiated exactly. Parameter and buffer names are those of
``nn.Sequential`` nesting (``3.body.0.weight``, ``3.shortcut.0.weight``, ``1.embedding.weight``), so the
``state_dict()`` of a model built from these uploads to a ``sequential`` architecture without renaming.

``NtkLinear``, ``NtkConv1d`` and ``NtkConv2d`` are ``Linear``/``Conv`` layers in NTK parameterization (NOTE
[NTK parameterization]); their parameters keep the names ``weight`` and ``bias``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MeanPool", "NtkConv1d", "NtkConv2d", "NtkLinear", "PositionEmbedding", "Residual"]


class Residual(nn.Module):
    """``body(x) + shortcut(x)``, or ``body(x) + x`` without a shortcut (a ResNet basic block, a pre-norm sublayer).

    Args:
        body (nn.Sequential): the main path; its output must have the shape of the shortcut's output.
        shortcut (nn.Sequential | None): the skip path, e.g. a strided 1x1 conv + BatchNorm when the shape changes.
            Default: None (identity).

    Shapes: x (B, *in) -> (B, *out), where body and shortcut both map (B, *in) -> (B, *out).
    """

    def __init__(self, body: nn.Sequential, shortcut: nn.Sequential | None = None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.shortcut is None else self.shortcut(x)
        out: torch.Tensor = self.body(x) + skip
        return out


class MeanPool(nn.Module):
    """The mean over one dimension: ``x.mean(dim)`` (token pooling, (B, T, d) -> (B, d) with dim=1).

    Args:
        dim (int): the dimension of the batched tensor (B, ...) to average over; never 0, the batch (that would mix
            examples). Negative values count from the end.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class PositionEmbedding(nn.Module):
    """A learned position embedding added to a sequence: ``x + embedding([0, 1, ..., T-1])``.

    Args:
        num_positions (int): the longest sequence T it can take.
        embedding_dim (int): d, the width of x.

    Shapes: x (B, T, d) float, T <= num_positions -> (B, T, d). Parameter: ``embedding.weight`` (num_positions, d),
    an ``nn.Embedding`` (so the engine's Embedding rule covers it), initialised N(0, 1) like one.
    """

    def __init__(self, num_positions: int, embedding_dim: int) -> None:
        super().__init__()
        # _weight skips nn.Embedding's own init, which on the meta device (the registry sizes specs there) imports
        # torch's compiler stack (seconds); reset_parameters draws the same N(0, 1).
        self.embedding = nn.Embedding(num_positions, embedding_dim, _weight=torch.empty(num_positions, embedding_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.embedding.weight.is_meta:
            nn.init.normal_(self.embedding.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-2], device=x.device)
        out: torch.Tensor = x + self.embedding(positions)
        return out


# NOTE [NTK parameterization]
# As neural-tangents' ``stax.Dense(parameterization="ntk")`` and ``stax.Conv``: the parameters are N(0, 1) at
# initialisation and the forward scales them, y = (w_std / sqrt(fan_in)) · x Wᵀ + b_std · b, with fan_in =
# in_features (Linear) or C_in/groups · prod(kernel_size) (Conv). The function class is the standard one; the
# gradient w.r.t. W is smaller by w_std/sqrt(fan_in), which is what makes the NTK converge as the width grows. The
# forward is F.linear / F.conv on the parameters times numbers, which the kernel engine's op rules read as scaled
# uses of W and b (structured derivatives, as for nn.Linear; also in an exported program); NtkLinear declares
# its forward fixed (``ntk_fixed_pipeline``), so a pipeline of NtkLinear layers and activations takes the
# closed-form chain capture as one of nn.Linear does.


class NtkLinear(nn.Linear):
    """``nn.Linear`` in NTK parameterization: y = (w_std/√in_features) x Wᵀ + b_std b; W, b ~ N(0, 1) at init.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        w_std (float): weight scale σ_w. Default: 1.0.
        b_std (float): bias scale σ_b. Default: 1.0.

    Shapes: (*, in_features) -> (*, out_features). See NOTE [NTK parameterization].
    """

    ntk_fixed_pipeline = True  # the same F.linear on every call (NOTE [sequential chains] in the kernel engine)

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, w_std: float = 1.0, b_std: float = 1.0
    ) -> None:
        self.w_std, self.b_std = float(w_std), float(b_std)
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        _normal_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias * self.b_std
        return F.linear(x, self.weight * (self.w_std / math.sqrt(self.in_features)), bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, w_std={self.w_std}, b_std={self.b_std}"


def _normal_init(module: nn.Linear | nn.Conv1d | nn.Conv2d) -> None:
    if module.weight.is_meta:  # nothing to draw; normal_ on meta imports torch's compiler stack (seconds)
        return
    nn.init.normal_(module.weight)
    if module.bias is not None:
        nn.init.normal_(module.bias)


def _scaled(module: nn.Conv1d | nn.Conv2d, w_std: float, b_std: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W·w_std/√fan_in, b·b_std) with fan_in = C_in/groups · prod(kernel_size)."""
    fan_in = module.weight[0].numel()
    bias = None if module.bias is None else module.bias * b_std
    return module.weight * (w_std / math.sqrt(fan_in)), bias


class NtkConv1d(nn.Conv1d):
    """``nn.Conv1d`` in NTK parameterization (W·w_std/√(C_in/groups·K), b·b_std; N(0, 1) init).

    Args: as ``nn.Conv1d``, plus keyword-only ``w_std`` and ``b_std`` (Default: 1.0 each). (B, C_in, L) ->
    (B, C_out, L'). See NOTE [NTK parameterization].
    """

    def __init__(self, *args: Any, w_std: float = 1.0, b_std: float = 1.0, **kwargs: Any) -> None:
        self.w_std, self.b_std = float(w_std), float(b_std)
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        _normal_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._conv_forward(x, *_scaled(self, self.w_std, self.b_std))
        return out


class NtkConv2d(nn.Conv2d):
    """``nn.Conv2d`` in NTK parameterization (W·w_std/√(C_in/groups·kh·kw), b·b_std; N(0, 1) init).

    Args: as ``nn.Conv2d``, plus keyword-only ``w_std`` and ``b_std`` (Default: 1.0 each). (B, C_in, H, W) ->
    (B, C_out, H', W'). See NOTE [NTK parameterization].
    """

    def __init__(self, *args: Any, w_std: float = 1.0, b_std: float = 1.0, **kwargs: Any) -> None:
        self.w_std, self.b_std = float(w_std), float(b_std)
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        _normal_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._conv_forward(x, *_scaled(self, self.w_std, self.b_std))
        return out
