"""Typed descriptors of what a capture returns and what a side holds: each tensor with the facts about it that the
contraction dispatches on (its memory layout, whether it is the same for every example), declared by whoever made
the tensor instead of read back from its strides or data pointer.

Shapes: a use's input a (n, *in_shape), its δ (n, k, *out_shape); a factored term's A (n, G, T, da) (or ids
(n, 1, T)) and D (n, k, G, T, dd); a Jacobian (n, k, p). Sides are tuples and dicts of these (named tuples), so
``algorithm.side_nbytes`` and the side cache walk them like any other side.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from ntk_service.kernels.types import NamedTensors

__all__ = ["Axis", "Capture", "Delta", "FactorSide", "JacobianSide", "Layout", "SiteAxes", "StructuredSide"]


class Layout(enum.Enum):
    """The memory order of an (n, k, ...) tensor's two leading axes (NOTE [accumulator memory])."""

    EXAMPLE_MAJOR = "example_major"
    """(n, k, ...) memory: rows (i, c) (the chain, rule Jacobians, jacrev)."""

    OUTPUT_MAJOR = "output_major"
    """(k, n, ...) memory: rows (c, i) (the autograd capture's reverse pass batched over the output basis)."""

    @staticmethod
    def of(t: torch.Tensor) -> Layout:
        """The layout of a tensor whose producer cannot declare it (torch's vmap/jacrev, a rule's reshape):
        read once, where the descriptor is made. A tensor with one example or one output lies either way."""
        output_major = t.shape[0] > 1 and t.shape[1] > 1 and t.stride(1) > t.stride(0) != 0
        return Layout.OUTPUT_MAJOR if output_major else Layout.EXAMPLE_MAJOR


class Axis(NamedTuple):
    """Where a batched forward keeps the examples in one op tensor: along ``dim``, which holds n·R entries for R
    per example (the per-example shape's size at ``dim``); ``major``: example i's entries are i·R .. i·R + R − 1
    (a batch dimension, or positions flattened into it, GPT-2's (n·T, d)); else r·n + i (positions outermost: the
    (T·n, d) rows of ``nn.MultiheadAttention``'s output projection). Found on two real examples
    (``recorder.batch_axes``)."""

    dim: int
    major: bool

    def examples(self, t: torch.Tensor, n: int, lead: int = 0) -> torch.Tensor:
        """t (*lead, *batched shape) as (*lead, n, *per-example shape): a view."""
        d = lead + self.dim
        r = t.shape[d] // n
        if self.major:
            return torch.unflatten(t, d, (n, r)).movedim(d, lead)
        return torch.unflatten(t, d, (r, n)).movedim(d + 1, lead)


class SiteAxes(NamedTuple):
    """The example axis of a site's input (None: it takes none) and of its output in a batched forward."""

    input: Axis | None
    output: Axis


class Delta(NamedTuple):
    """A δ (n, k, ...) with its declared facts.

    Attributes:
        tensor: the cotangents.
        layout: its memory order.
        shared: the same for every example (the identity δ_c = e_c of a layer whose output is the model's output,
            expanded over the examples with stride 0): the contraction may take it as one k×k Δ.
    """

    tensor: torch.Tensor
    layout: Layout
    shared: bool = False

    def sliced(self, start: int, stop: int | None, step: int = 1) -> Delta:
        return Delta(self.tensor[start:stop:step], self.layout, self.shared)


class JacobianSide(NamedTuple):
    """A parameter's Jacobian (n, k, p) and its memory order."""

    tensor: torch.Tensor
    layout: Layout

    def sliced(self, start: int, stop: int | None, step: int = 1) -> JacobianSide:
        return JacobianSide(self.tensor[start:stop:step], self.layout)


class FactorSide(NamedTuple):
    """One factored term's factors for a block: A (n, G, T, da) or ids (n, 1, T), and D (n, k, G, T, dd)."""

    a: torch.Tensor
    d: Delta

    def sliced(self, start: int, stop: int | None, step: int = 1) -> FactorSide:
        return FactorSide(self.a[start:stop:step], self.d.sliced(start, stop, step))


class StructuredSide(NamedTuple):
    """What the structured engine keeps of a block of n examples: one ``FactorSide`` per factored term (in the
    terms' order) and one ``JacobianSide`` per other parameter, by name."""

    factored: tuple[FactorSide, ...]
    jacobians: dict[str, JacobianSide]

    @property
    def examples(self) -> int:
        if self.factored:
            return int(self.factored[0].d.tensor.shape[0])
        return int(next(iter(self.jacobians.values())).tensor.shape[0])

    def sliced(self, start: int, stop: int | None, step: int = 1) -> StructuredSide:
        """Examples start:stop:step (views)."""
        return StructuredSide(
            tuple(f.sliced(start, stop, step) for f in self.factored),
            {name: j.sliced(start, stop, step) for name, j in self.jacobians.items()},
        )

    def layouts(self) -> list[Layout]:
        """The layouts of the δ's not shared by all examples and of the Jacobians (shared δ's lie either way)."""
        return [f.d.layout for f in self.factored if not f.d.shared] + [j.layout for j in self.jacobians.values()]


class Capture(NamedTuple):
    """What one capture of a block of n examples gives: per use i, its input a (n, *in_shape) and its δ
    (n, k, *out_shape); per fallback parameter its Jacobian (n, k, p) by jacrev."""

    inputs: list[torch.Tensor]
    deltas: list[Delta]
    fallback_jacobians: NamedTensors
