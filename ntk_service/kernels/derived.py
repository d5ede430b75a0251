"""The pseudo-NTK (Mohamadi, Bae & Sutherland 2023): Θ_p(x1, x2) = (1/k) Σ_{a,b} Θ_ab(x1, x2), shape (N, M).

Θ_p is the NTK of the scalar model g(x) = Σ_a f_a(x) / √k: its Jacobian is one gradient per example,
(1/√k) Σ_a J_a(x), so Θ_g = (1/k) (Σ_a J_a(x1)) · (Σ_b J_b(x2)) = (1/k) Σ_ab Θ_ab. ``compute_ntk(mode="pseudo")``
therefore computes the TRACE kernel (k = 1) of ``SummedOutputs(model)`` with whichever implementation it picks:
k times fewer reverse passes and a k²-times smaller contraction than FULL.

Approximation claim (Mohamadi et al. 2023, their Theorem 1): at initialization and for a wide final layer, the
NTK is close to Θ_p ⊗ I_k (the off-diagonal output blocks vanish and the diagonal ones agree), with an error
falling as O(1/√width) of the readout, so Θ_p stands in for the full kernel in kernel regression, and its
eigenvectors for those of Θ. Away from that regime (trained networks, narrow readouts) it is a different kernel,
not an approximation with a guarantee.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import nn

from ntk_service.kernels.problem.outputs import OutputPath, select_output

__all__ = ["SUMMED_OUTPUTS_PREFIX", "SummedOutputs", "pseudo_key", "pseudo_params"]

SUMMED_OUTPUTS_PREFIX = "model."
"""The wrapped model's parameters are ``model.<name>`` inside ``SummedOutputs``."""


class SummedOutputs(nn.Module):
    """g(x) = Σ_a f_a(x) / √k: a batch (n, *input) -> (n, 1), whose NTK is the pseudo-NTK of ``model``.

    Args:
        model: the model f; a batch (n, *input) maps to (n, *out), k = prod(out).
        output: which tensor of what ``model`` returns is f (``problem/outputs.py``). Default: None (a tensor).
    """

    def __init__(self, model: nn.Module, output: OutputPath | None = None) -> None:
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        # positional or keyword inputs pass through unchanged (``batch.call_module``)
        raw = self.model(*args, **kwargs)
        out = raw if isinstance(raw, torch.Tensor) and self.output is None else select_output(raw, self.output)
        flat = out.reshape(out.shape[0], -1)
        summed: torch.Tensor = flat.sum(1, keepdim=True) * (1.0 / math.sqrt(flat.shape[1]))
        return summed


def pseudo_params(params: Sequence[str] | None) -> Sequence[str] | None:
    """The parameter globs of ``model`` as globs over ``SummedOutputs(model)`` (its names gain a literal prefix)."""
    if params is None or isinstance(params, str):
        return params  # a bare string is refused by select_parameters with its own message
    return [SUMMED_OUTPUTS_PREFIX + p if isinstance(p, str) else p for p in params]


def pseudo_key(key: Hashable | None) -> Hashable | None:
    """A side-cache key for the summed model's sides: never the key of the model's own sides."""
    return None if key is None else ("pseudo", key)
