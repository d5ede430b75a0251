"""Derived modes: the kernel, in a contracted mode, of a model whose outputs are a linear map of the model's.

A derived mode's row in ``vocabulary.MODES`` names its ``base`` mode; its ``OutputMap`` here is the linear map
g = W f of each example's k outputs to k' (W is (k', k)), so its kernel is Θ_g = W Θ Wᵀ in the base mode. Every
consumer applies the map where the outputs appear, from this one table: the engine computes the base kernel of
``DerivedOutputs(model, ...)`` (J_g = W J), the NNGP maps the features, Monte Carlo the Jacobians, and the
operators take W Θ Wᵀ v as W (Θ (Wᵀ v)) (``apply`` and ``adjoint``).

The pseudo-NTK (Mohamadi, Bae & Sutherland 2023): Θ_p(x1, x2) = (1/k) Σ_{a,b} Θ_ab(x1, x2), shape (N, M), is the
NTK of the scalar model g(x) = Σ_a f_a(x) / √k: its Jacobian is one gradient per example, (1/√k) Σ_a J_a(x), so
Θ_g = (1/k) (Σ_a J_a(x1)) · (Σ_b J_b(x2)) = (1/k) Σ_ab Θ_ab. ``compute_ntk(mode="pseudo")`` therefore computes the
TRACE kernel (k' = 1) of ``SummedOutputs(model)`` with whichever implementation it picks: k times fewer reverse
passes and a k²-times smaller contraction than FULL.

Approximation claim (Mohamadi et al. 2023, their Theorem 1): at initialization and for a wide final layer, the
NTK is close to Θ_p ⊗ I_k (the off-diagonal output blocks vanish and the diagonal ones agree), with an error
falling as O(1/√width) of the readout, so Θ_p stands in for the full kernel in kernel regression, and its
eigenvectors for those of Θ. Away from that regime (trained networks, narrow readouts) it is a different kernel,
not an approximation with a guarantee.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.problem.outputs import OutputPath, select_output

__all__ = [
    "DERIVED_PREFIX",
    "OUTPUT_MAPS",
    "SUMMED_OUTPUTS_PREFIX",
    "DerivedOutputs",
    "OutputMap",
    "SummedOutputs",
    "derived_key",
    "derived_model",
    "derived_params",
    "map_of",
    "outputs_of",
    "pseudo_key",
    "pseudo_params",
]


@dataclass(frozen=True)
class OutputMap:
    """A derived mode's linear map g = W f of each example's k outputs to k' = ``size(k)``.

    Attributes:
        apply: W along dim 1: (n, k, *rest) -> (n, k', *rest) (outputs, features, or Jacobians (n, k, p)).
        adjoint: Wᵀ along dim 1, given k: (n, k') -> (n, k).
        size: k -> k'.
    """

    apply: Callable[[torch.Tensor], torch.Tensor]
    adjoint: Callable[[torch.Tensor, int], torch.Tensor]
    size: Callable[[int], int]


def _summed(f: torch.Tensor) -> torch.Tensor:
    """Σ_a f_a / √k along dim 1, kept: (n, k, *rest) -> (n, 1, *rest)."""
    summed: torch.Tensor = f.sum(1, keepdim=True) * (1.0 / math.sqrt(f.shape[1]))
    return summed


def _spread(u: torch.Tensor, k: int) -> torch.Tensor:
    """Its adjoint: u (n, 1) -> u / √k on every output (n, k)."""
    return u.expand(-1, k) * (1.0 / math.sqrt(k))


OUTPUT_MAPS: dict[DerivedMode, OutputMap] = {
    DerivedMode.PSEUDO: OutputMap(_summed, _spread, lambda k: 1),
}
"""Every derived mode's output map (its row in ``vocabulary.MODES`` names the base mode)."""

DERIVED_PREFIX = "model."
"""The wrapped model's parameters are ``model.<name>`` inside ``DerivedOutputs``."""

SUMMED_OUTPUTS_PREFIX = DERIVED_PREFIX
"""The pseudo-NTK's name for ``DERIVED_PREFIX`` (kept for old imports)."""


def map_of(mode: DerivedMode) -> OutputMap:
    """The output map of a derived mode."""
    return OUTPUT_MAPS[mode]


def outputs_of(mode: KernelMode | DerivedMode, k: int) -> int:
    """The outputs per example the kernel of ``mode`` is taken over: k', or k for a contracted mode."""
    return OUTPUT_MAPS[mode].size(k) if isinstance(mode, DerivedMode) else k


class DerivedOutputs(nn.Module):
    """g(x) = W f(x): a batch (n, *input) -> (n, k'), whose NTK in the base mode is the derived mode's kernel.

    Args:
        model: the model f; a batch (n, *input) maps to (n, *out), k = prod(out).
        output_map: W (``OUTPUT_MAPS``).
        output: which tensor of what ``model`` returns is f (``problem/outputs.py``). Default: None (a tensor).
    """

    def __init__(self, model: nn.Module, output_map: OutputMap, output: OutputPath | None = None) -> None:
        super().__init__()
        self.model = model
        self.output_map = output_map
        self.output = output

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        # positional or keyword inputs pass through unchanged (``batch.call_module``)
        raw = self.model(*args, **kwargs)
        out = raw if isinstance(raw, torch.Tensor) and self.output is None else select_output(raw, self.output)
        return self.output_map.apply(out.reshape(out.shape[0], -1))


class SummedOutputs(DerivedOutputs):
    """g(x) = Σ_a f_a(x) / √k: a batch (n, *input) -> (n, 1), whose NTK is the pseudo-NTK of ``model``.

    Args:
        model: the model f; a batch (n, *input) maps to (n, *out), k = prod(out).
        output: which tensor of what ``model`` returns is f (``problem/outputs.py``). Default: None (a tensor).
    """

    def __init__(self, model: nn.Module, output: OutputPath | None = None) -> None:
        super().__init__(model, OUTPUT_MAPS[DerivedMode.PSEUDO], output)


def derived_model(mode: DerivedMode, model: nn.Module, output: OutputPath | None = None) -> DerivedOutputs:
    """The derived model whose ``mode.spec.base`` kernel is ``mode``'s kernel of ``model``."""
    return DerivedOutputs(model, OUTPUT_MAPS[mode], output)


def derived_params(params: Sequence[str] | None) -> Sequence[str] | None:
    """The parameter globs of ``model`` as globs over ``DerivedOutputs(model)`` (its names gain a literal prefix)."""
    if params is None or isinstance(params, str):
        return params  # a bare string is refused by select_parameters with its own message
    return [DERIVED_PREFIX + p if isinstance(p, str) else p for p in params]


def derived_key(key: Hashable | None, mode: DerivedMode) -> Hashable | None:
    """A side-cache key for the derived model's sides: never the key of the model's own sides (nor another
    derived mode's)."""
    return None if key is None else (mode.value, key)


pseudo_params = derived_params
"""The pseudo-NTK's name for ``derived_params`` (kept for old imports)."""


def pseudo_key(key: Hashable | None) -> Hashable | None:
    """``derived_key`` for the pseudo-NTK (kept for old imports)."""
    return derived_key(key, DerivedMode.PSEUDO)
