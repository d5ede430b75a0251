"""Shared types of the kernel engine: the implementation enum, the result, and tensor aliases."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from ntk_service.errors import UnknownImplementation
from ntk_service.kernels.modes import DerivedMode, KernelMode

__all__ = ["NamedTensors", "NtkImplementation", "NtkResult", "parse_implementation"]

NamedTensors = dict[str, torch.Tensor]
"""Parameters (or per-parameter Jacobians) by their ``named_parameters()`` name."""


class NtkImplementation(StrEnum):
    """How the kernel is computed. All give the same numbers; they differ in time and memory.

    Attributes:
        AUTO: pick from the cost model (P, k, N, M, per-layer shapes, the counted forward cost).
        JACOBIAN_CONTRACTION: build J per block with ``vmap(jacrev)``, one einsum per parameter tensor. Best for
            small k and an expensive forward pass. Time (N+M)·k·[FP] + N·M·k²·P; memory (n+m)·k·P per block.
        NTK_VECTOR_PRODUCTS: J(x2) is never built: ``jvp`` on x2 of the ``vjp`` rows of x1. Best for a cheap
            forward pass and huge P. Time N·M·k·[FP]; memory of one block of VJPs.
        STRUCTURED: per-layer structure rules (a Linear layer's Jacobian is δ aᵀ, so its term is (δ1·δ2)(a1·a2)).
            Fastest where rules cover the parameters; the rest falls back to the Jacobian path.
    """

    AUTO = "auto"
    JACOBIAN_CONTRACTION = "jacobian_contraction"
    NTK_VECTOR_PRODUCTS = "ntk_vector_products"
    STRUCTURED = "structured"


def parse_implementation(implementation: NtkImplementation | str) -> NtkImplementation:
    """The NtkImplementation for ``implementation`` or its wire value; raises UnknownImplementation."""
    try:
        return NtkImplementation(implementation)
    except ValueError:
        valid = ", ".join(repr(i.value) for i in NtkImplementation)
        raise UnknownImplementation(
            f"compute_ntk: unknown implementation {implementation!r}; expected one of {valid}"
        ) from None


@dataclass(frozen=True)
class NtkResult:
    """What ``compute_ntk`` returns.

    Attributes:
        theta: the kernel block; shape (N, M, k, k) for FULL, (N, M) for TRACE, (N, k, k) for
            EXAMPLE_DIAGONAL, (N, M, k) for OUTPUT_DIAGONAL, (N, M) for PSEUDO.
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
