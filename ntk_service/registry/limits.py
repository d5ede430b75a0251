"""Size limits of architecture specs, checked by validation before anything is built."""

from __future__ import annotations

__all__ = ["MAX_LAYERS", "MAX_LEN", "MAX_NESTING", "MAX_SEQUENTIAL_LAYERS", "MAX_WIDTH"]

MAX_LAYERS = 64
"""Most layers (hidden layers, conv layers, transformer blocks) a built-in model may have: deeper nets are no use for
kernel studies at the sizes this service can afford, and each layer costs a Python-level forward step."""

MAX_WIDTH = 1 << 20
"""Largest single size (width, channels, vocabulary, ...). The parameter cap in zoo.py is the real limit; this one only
keeps the arithmetic of the estimate far from overflow."""

MAX_LEN = 4096
"""Longest transformer sequence: attention costs T² per head and layer, and the NTK multiplies that by N·M·k²."""

MAX_NESTING = 4
"""Deepest nesting of combinators (``Residual``, ``Sequential``; a ``Residual`` inside a ``Residual`` body is depth
2) in a ``sequential`` spec: real blocks need 1 to 3 (a ResNet stage holding blocks); the bound keeps validation
and the forward pass far from Python's recursion limit."""

MAX_SEQUENTIAL_LAYERS = 512
"""Most layers of a ``sequential`` spec, nested ones included (a ResNet-50 written out has about 170)."""
