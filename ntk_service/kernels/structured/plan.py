"""The frozen plan of the structured engine: which op calls the rules cover (``StructurePlan``, its ``Site`` s), how
each selected parameter is contracted (``FactoredTerm``, ``JacobianTerm``) and the facts learned on real blocks
(``StructuredTerms``). Made by ``coverage.analyze`` and kept on the prepared problem; a fact learned on a real
block (the model is batch safe, and where its op tensors keep the examples) or a failed assumption (the model views
a channels-last convolution output) yields a new plan through ``StructuredTerms.learned``, never a change to the old
one.

Shapes are per example: a site's ``in_shape`` / ``out_shape`` are the op call's input and output shapes in the
one-example probe (a leading 1 where the op sees a batch dimension); a factored term's dims are (G, T, da, dd)
(groups, positions summed over its uses, A's and D's widths).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch

from ntk_service.kernels.structured.chain import Chain
from ntk_service.kernels.structured.descriptors import SiteAxes
from ntk_service.kernels.structured.rules import ParamMap, Rule

__all__ = ["FactoredTerm", "JacobianTerm", "Site", "StructurePlan", "StructuredTerms"]


@dataclass(frozen=True, eq=False)
class Site:
    """One call of an op that a rule covers (a *use* of its parameters).

    Attributes:
        rule: the rule; config: its frozen reading of the call (``rules.Call.config``).
        family: the op family (``ops.Op.family``); op: the callable's name, for reports ("aten.linear",
            "linear", "Tensor.mul").
        input_arg: the bound name of the op's activation input, None when the rule needs none.
        roles: (role, the parameter the op takes in it), for the covered roles only.
        state: the constant tensors the rule's math needs (eval BatchNorm's running statistics).
        in_shape, out_shape: the op's input and output shapes on one example (in_shape () without input).
    """

    rule: Rule
    config: Hashable
    family: str
    op: str
    input_arg: str | None
    roles: tuple[tuple[str, ParamMap], ...]
    state: Mapping[str, torch.Tensor]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    def param(self, role: str) -> ParamMap:
        """The parameter the op takes in ``role``."""
        return dict(self.roles)[role]


@dataclass(frozen=True)
class StructurePlan:
    """The covered op calls of a problem and who covers each selected parameter (NOTE [covered parameters]).

    Attributes:
        sites: every call of an op a rule covers with a selected parameter, in call order.
        param_uses: selected parameter name -> ((site index, role), ...) for rule-covered parameters (a parameter
            no op reads has none: its Jacobian is zero).
        fallback: selected parameters on the Jacobian path, in ``problem.params`` order.
        outside: fallback parameter -> the ops that took it without a rule (why it is on the Jacobian path).
        saved_bytes: bytes autograd saves per example in the probed forward (activations only: tensors sharing
            storage with parameters or buffers are not per example and not counted).
        chain: the model as a sequential chain, captured without autograd (NOTE [sequential chains] in
            ``chain.py``); None for every other model.
    """

    sites: tuple[Site, ...]
    param_uses: Mapping[str, tuple[tuple[int, str], ...]]
    fallback: tuple[str, ...]
    outside: Mapping[str, tuple[str, ...]]
    saved_bytes: float
    chain: Chain | None


@dataclass(frozen=True)
class FactoredTerm:
    """A weight contracted in factored form; ``bias`` is folded into it (+ ``bias_scale``² in G^A) when set.

    Attributes:
        name: the weight; uses: its sites, in side order; bias: the folded bias, or None.
        index: A is token ids (an embedding).
        dims: (G, T summed over uses, da, dd), per example.
        scales: the factor each use takes the weight with (A is scaled by it; D for ids).
        bias_scale: the factor every use takes the folded bias with.
    """

    name: str
    uses: tuple[int, ...]
    bias: str | None
    index: bool
    dims: tuple[int, int, int, int]
    scales: tuple[float, ...] = ()
    bias_scale: float = 1.0

    @property
    def plus(self) -> float:
        """What the folded bias adds to every entry of G^A (0 without one)."""
        return self.bias_scale**2 if self.bias is not None else 0.0


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
        batch_safe: every site sees the examples of a batch where ``axes`` says, in order (``recorder.batch_axes``);
            None until a block of >= 2 real examples decides it.
        axes: per site, where a batched forward keeps the examples (set when batch safe).
        channels_last: the batched capture of a convolutional model may run its 2-D convolutions channels-last
            (NOTE [channels-last capture]); False once that forward failed (a model viewing them).
    """

    plan: StructurePlan
    factored: tuple[FactoredTerm, ...]
    jacobian: tuple[JacobianTerm, ...]
    batch_safe: bool | None = None
    axes: tuple[SiteAxes, ...] | None = None
    channels_last: bool = True

    @property
    def fallback(self) -> tuple[str, ...]:
        return self.plan.fallback

    def learned(
        self,
        *,
        batch_safe: bool | None = None,
        axes: tuple[SiteAxes, ...] | None = None,
        channels_last: bool | None = None,
    ) -> StructuredTerms:
        """A new plan with these facts set (the others kept)."""
        return dataclasses.replace(
            self,
            batch_safe=self.batch_safe if batch_safe is None else batch_safe,
            axes=self.axes if axes is None else axes,
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
