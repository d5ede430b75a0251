"""Kernel modes: which part of Θ(x1, x2) = J(x1) J(x2)ᵀ a call returns.

The modes, their table and their parsers live in ``ntk_service.vocabulary`` (torch-free, shared with the client,
the CLI and the server's schemas); this module is the engine's name for them. The table is ``vocabulary.MODES``
(``vocabulary.mode_table()`` prints it): a row per mode, with its axes.

``DerivedMode`` holds the modes that are not contractions of the engine but the kernel of a derived model
(``derived.py``): the implementations, planner and jobs only ever see a ``KernelMode``.

NOTE [mode contractions]: the implementations contract four things, keyed to a mode's axes (``ModeSpec.examples``
× ``ModeSpec.outputs``), never to which mode it is: a block of example pairs with all outputs, their diagonal or
their sum (``NtkAlgorithm.pair``, which reads the outputs axis), and the per-example blocks of all outputs
(``NtkAlgorithm.diagonal``). A mode's ``contraction`` is the mode they are given: a mode of example pairs itself, a
per-example mode the contracted mode of the per-example blocks of all outputs, reduced per example to its own
outputs (``blocks.reduce_outputs``: an n·k² block, never a block of pairs), a derived mode its base. So a new
contracted mode whose axes are one of these combinations is a row of the table: no implementation chooses by mode.
A new axis value is a new contraction in each implementation (docs/development.md, "Adding a mode").
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
