"""The frozen plan of the structured engine: which layer calls the rules cover (``StructurePlan``), how each selected
parameter is contracted (``FactoredTerm``, ``JacobianTerm``) and the facts learned on real blocks
(``StructuredTerms``). Made by ``analysis.analyze`` and kept on the prepared problem; a fact learned on a real block
(the model is batch safe) or a failed assumption (the model views a channels-last convolution output) yields a new
plan through ``StructuredTerms.learned``, never a change to the old one.

Shapes are per example: a use's ``in_shape`` / ``out_shape`` are the layer call's input and output shapes with the
leading 1 of the one-example probe; a factored term's dims are (G, T, da, dd) (groups, positions summed over its
uses, A's and D's widths).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ntk_service.kernels.structured.chain import Chain
from ntk_service.kernels.structured.rules import Rule

__all__ = ["FactoredTerm", "JacobianTerm", "StructurePlan", "StructuredTerms", "Use"]


@dataclass(frozen=True)
class Use:
    """One call of a covered layer, with its per-example (logical) input and output shapes."""

    layer: int
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


@dataclass(frozen=True)
class StructurePlan:
    """The rule layers of a problem and who covers each selected parameter (NOTE [covered parameters]).

    Attributes:
        layers: covered layers (modules with at least one covered parameter), in first-call order.
        rules: the rule of each layer.
        states: each layer's parameters and buffers (compute dtype) by attribute name.
        uses: every call of a covered layer, in call order.
        param_uses: selected parameter name -> ((use index, role attribute), ...) for rule-covered parameters.
        fallback: selected parameters on the Jacobian path, in ``problem.params`` order.
        saved_bytes: bytes autograd saves per example in the probed forward (activations only: tensors sharing
            storage with parameters or buffers are not per example and not counted).
        chain: the model as a sequential chain, captured without autograd (NOTE [sequential chains] in
            ``chain.py``); None for every other model.
    """

    layers: tuple[nn.Module, ...]
    rules: tuple[Rule, ...]
    states: tuple[dict[str, torch.Tensor], ...]
    uses: tuple[Use, ...]
    param_uses: Mapping[str, tuple[tuple[int, str], ...]]
    fallback: tuple[str, ...]
    saved_bytes: float
    chain: Chain | None


@dataclass(frozen=True)
class FactoredTerm:
    """A weight contracted in factored form; ``bias`` is folded into it (+1 in G^A) when set."""

    name: str
    uses: tuple[int, ...]
    bias: str | None
    index: bool
    dims: tuple[int, int, int, int]  # (G, T summed over uses, da, dd), per example


@dataclass(frozen=True)
class JacobianTerm:
    """A rule-covered parameter whose J (n, k, p) is built from a and δ, summed over its uses."""

    name: str
    uses: tuple[tuple[int, str], ...]
    numel: int
    build_flops: float  # per example


@dataclass(frozen=True)
class StructuredTerms:
    """The whole plan: the structure, how each selected parameter is contracted (NOTE [factored or Jacobian]),
    and what real blocks showed about the model.

    Attributes:
        plan: the structure.
        factored: the weights in factored form, in side order.
        jacobian: the rule-covered parameters in Jacobian form.
        batch_safe: every covered call sees the examples along dim 0 in order (``recorder.is_batch_safe``);
            None until a block of >= 2 real examples decides it.
        channels_last: the batched capture of a convolutional model may run its Conv2d outputs channels-last
            (NOTE [channels-last capture]); False once that forward failed (a model viewing them).
    """

    plan: StructurePlan
    factored: tuple[FactoredTerm, ...]
    jacobian: tuple[JacobianTerm, ...]
    batch_safe: bool | None = None
    channels_last: bool = True

    @property
    def fallback(self) -> tuple[str, ...]:
        return self.plan.fallback

    def learned(self, *, batch_safe: bool | None = None, channels_last: bool | None = None) -> StructuredTerms:
        """A new plan with these facts set (the others kept)."""
        return dataclasses.replace(
            self,
            batch_safe=self.batch_safe if batch_safe is None else batch_safe,
            channels_last=self.channels_last if channels_last is None else channels_last,
        )

    def covered(self) -> list[tuple[str, str]]:
        """(name, how) for every parameter a term contracts: "factored", "rule" (J from a and δ) or "fallback"
        (J by jacrev). Each selected parameter must appear exactly once."""
        out = [(t.name, "factored") for t in self.factored]
        out += [(t.bias, "factored") for t in self.factored if t.bias is not None]
        out += [(t.name, "rule") for t in self.jacobian]
        return out + [(name, "fallback") for name in self.plan.fallback]

    def coverage(self) -> dict[str, str]:
        """Selected parameter name -> how it is contracted (see ``covered``)."""
        return dict(self.covered())
