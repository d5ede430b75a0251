"""Shared types of the kernel engine: the result and tensor aliases; the implementation enum (``NtkImplementation``)
and its parser live in ``ntk_service.vocabulary`` and are the engine's names here too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ntk_service.vocabulary import DerivedMode, KernelMode, NtkImplementation, parse_implementation

__all__ = ["NamedTensors", "NtkImplementation", "NtkResult", "parse_implementation"]

NamedTensors = dict[str, torch.Tensor]
"""Parameters (or per-parameter Jacobians) by their ``named_parameters()`` name."""


@dataclass(frozen=True)
class NtkResult:
    """What ``compute_ntk`` returns.

    Attributes:
        theta: the kernel block in the mode's shape (``ModeSpec.shape``), e.g. (N, M, k, k) for FULL, (N, M)
            for TRACE.
        mode: the mode computed.
        implementation: the implementation that ran (never AUTO).
        estimate_bytes: the planned peak memory of the computation, result included.
        block_size: examples per block along N and M (N when unchunked).
        per_example_loop: the model refused ``vmap`` over examples (data-dependent control flow), so its
            Jacobians were built one example at a time (NOTE [per-example loop] in jacobian_contraction.py).
    """

    theta: torch.Tensor
    mode: KernelMode | DerivedMode
    implementation: NtkImplementation
    estimate_bytes: int
    block_size: int
    per_example_loop: bool = False
