"""The seeded random draws of sketched features: every random matrix of a sketch, by name and column block.

NOTE [sketch determinism]: each random matrix of a sketch is drawn per parameter tensor (and per factor), per block
of ``BLOCK`` columns, from a ``torch.Generator`` seeded with blake2b(seed, name, block): nothing depends on the
process (not Python's salted ``hash``), on the chunking of the examples or on the memory budget, and the first D
columns of a larger D are the D-column sketch (Φ grows by appending columns). Draws are float64 on the CPU, then
cast, so float32 and float64 features share one sketch.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["BLOCK", "gaussian_block"]

BLOCK = 32
"""Columns of a sketch drawn together (and, for the Gaussian sketch, pushed through one vmapped jvp)."""


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{name}\x00{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def gaussian_block(seed: int, name: str, block: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Columns block·BLOCK ... (block+1)·BLOCK − 1 of the Gaussian matrix called ``name``: (BLOCK, *shape),
    entries N(0, 1) i.i.d., drawn in float64 then cast to ``dtype`` (NOTE [sketch determinism])."""
    g = torch.Generator().manual_seed(_block_seed(seed, name, block))
    return torch.randn((BLOCK, *shape), generator=g, dtype=torch.float64).to(dtype)
