"""Kernel modes: which part of Θ(x1, x2) = J(x1) J(x2)ᵀ a call returns.

The modes, their table and their parsers live in ``ntk_service.vocabulary`` (torch-free, shared with the client,
the CLI and the server's schemas); this module is the engine's name for them:

=================== ============== ==================================================================
mode                shape          entry
=================== ============== ==================================================================
FULL                (N, M, k, k)   Θ[n, m, a, b] = J_a(x1_n) · J_b(x2_m)
TRACE               (N, M)         Σ_a Θ[n, m, a, a]  (the plain sum; neural-tangents divides by k)
EXAMPLE_DIAGONAL    (N, k, k)      Θ(x1_n, x1_n): only the N same-example blocks (x2 is not used)
OUTPUT_DIAGONAL     (N, M, k)      Θ[n, m, a, a]  (what the torch.func tutorial calls "diagonal")
PSEUDO              (N, M)         (1/k) Σ_ab Θ[n, m, a, b]  (the pseudo-NTK; a ``DerivedMode``)
=================== ============== ==================================================================

``DerivedMode`` holds the modes that are not contractions of the engine but the kernel of a derived model
(``derived.py``): the implementations, planner and jobs only ever see a ``KernelMode``.

NOTE [mode contractions]: the implementations contract four things: a block of example pairs with all outputs, their
diagonal or its sum (``NtkAlgorithm.pair`` with FULL, OUTPUT_DIAGONAL, TRACE) and the per-example blocks of all
outputs (``NtkAlgorithm.diagonal``, EXAMPLE_DIAGONAL). A mode's row says which one it is (``ModeSpec.contraction``):
a per-example mode of fewer outputs is the per-example block reduced per example (``blocks.reduce_outputs``), an n·k²
block, never a FULL one; the block runner and the planner ask the implementations for that contraction only.
"""

from __future__ import annotations

from ntk_service.vocabulary import (
    DerivedMode,
    Examples,
    KernelMode,
    ModeSpec,
    Outputs,
    parse_any_mode,
    parse_mode,
    result_shape,
)

__all__ = [
    "DerivedMode",
    "Examples",
    "KernelMode",
    "ModeSpec",
    "Outputs",
    "contraction",
    "parse_any_mode",
    "parse_mode",
    "result_shape",
]


def contraction(mode: KernelMode | DerivedMode) -> KernelMode:
    """What the implementations contract for ``mode`` (NOTE [mode contractions])."""
    return mode.spec.contraction
