"""``StructuredOptions``: every fast path of the structured engine as one switch, passed as data.

``Structured(options=StructuredOptions(chain=False))`` runs the same kernel without that shortcut: each
switch turns one fast path off and leaves a slower, equally exact way in its place, so a test can check a path
against the float64 reference with the path on and off, and ``benchmarks/bench_fast_paths.py`` can A/B each in one
process. The defaults are the engine's behaviour; docs/engine.md lists what each path buys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = ["FAST_PATHS", "Form", "StructuredOptions"]

Form = Literal["cheaper", "factored", "jacobian"]
"""How a weight with factors is contracted: the cheaper form by the cost model (NOTE [factored or Jacobian]), or
every such weight forced into one form (a testing knob: both forms must give the reference kernel)."""


@dataclass(frozen=True)
class StructuredOptions:
    """The structured engine's choices. Every bool is one fast path (True: taken where it applies).

    Attributes:
        form: "cheaper" (per weight, by the cost model), "factored" or "jacobian" (forced, for tests).
        chain: capture a pure pipeline of Linear layers and activations in closed form (NOTE [sequential chains]).
        batched_capture: capture on the whole block with plain autograd when the model is batch safe (NOTE
            [probes]); off: per example under vmap.
        conv_passes: capture a convolutional model by k plain reverse passes (NOTE [channels-last capture]); off:
            one reverse pass batched over the output basis, as for other models.
        channels_last: run those passes with channels-last convolutions (NOTE [channels-last capture]).
        shared_delta: contract a δ the capture declares shared by all examples as Δ ⊗ G^A (NOTE
            [example-independent δ]); off: as a general δ.
        fused_finish: add the last plain factored term of a FULL block in the pass that writes theta's layout.
        example_major_accumulator: lay a FULL accumulator out like its δ's (NOTE [accumulator memory]); off:
            always (k, n, k, m) memory.
        thin_conv_jacobian: build a thin-patch convolution's J transposed, its bias from the same matmul (rules).
        fold_bias: fold a bias into its weight's factored term (+1 in G^A); off: the bias as a Jacobian term.
    """

    form: Form = "cheaper"
    chain: bool = True
    batched_capture: bool = True
    conv_passes: bool = True
    channels_last: bool = True
    shared_delta: bool = True
    fused_finish: bool = True
    example_major_accumulator: bool = True
    thin_conv_jacobian: bool = True
    fold_bias: bool = True

    def without(self, *paths: str) -> StructuredOptions:
        """These options with the named fast paths (``FAST_PATHS``) switched off."""
        unknown = [p for p in paths if p not in FAST_PATHS]
        if unknown:
            raise ValueError(f"StructuredOptions.without: unknown fast paths {unknown}; known: {list(FAST_PATHS)}")
        off: dict[str, bool] = dict.fromkeys(paths, False)
        return dataclasses.replace(self, **off)  # type: ignore[arg-type]  # every name is a bool field


FAST_PATHS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StructuredOptions) if f.type in ("bool", bool))
"""The names of the switches of ``StructuredOptions``, one per fast path, in declaration order."""
