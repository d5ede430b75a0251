"""Kernel modes: which part of Θ(x1, x2) = J(x1) J(x2)ᵀ a call returns.

Names are chosen so no one can confuse the two diagonals:

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
(``family/pseudo.py``): the implementations, planner and jobs only ever see a ``KernelMode``.
"""

from __future__ import annotations

from enum import StrEnum

from ntk_service.errors import UnknownMode

__all__ = ["DerivedMode", "KernelMode", "parse_any_mode", "parse_mode", "result_shape"]


class KernelMode(StrEnum):
    """What part of the kernel to compute; each is contracted directly, never reduced from a FULL block."""

    FULL = "full"
    """(N, M, k, k): every output pair of every example pair."""
    TRACE = "trace"
    """(N, M): Σ_a Θ_aa, the plain sum over the k outputs (neural-tangents' ``trace_axes`` divides by k)."""
    EXAMPLE_DIAGONAL = "example_diagonal"
    """(N, k, k): Θ(x1_n, x1_n) for each example of x1 alone; needs only N per-example terms."""
    OUTPUT_DIAGONAL = "output_diagonal"
    """(N, M, k): Θ_aa for every example pair; the torch.func tutorial's ``compute='diagonal'``."""


class DerivedMode(StrEnum):
    """Modes computed as an engine kernel of a derived model, never by the implementations themselves."""

    PSEUDO = "pseudo"
    """(N, M): (1/k) Σ_ab Θ_ab, the pseudo-NTK (Mohamadi, Bae & Sutherland 2023): the NTK of Σ_a f_a / √k, one
    gradient per example instead of k (``family/pseudo.py``)."""


def parse_any_mode(mode: KernelMode | DerivedMode | str, *, operation: str = "compute_ntk") -> KernelMode | DerivedMode:
    """The KernelMode or DerivedMode for ``mode`` or its wire value; raises UnknownMode naming the valid ones."""
    for kind in (KernelMode, DerivedMode):
        try:
            return kind(mode)
        except ValueError:
            pass
    valid = ", ".join(repr(m.value) for m in (*KernelMode, *DerivedMode))
    raise UnknownMode(f"{operation}: unknown mode {mode!r}; expected one of {valid}") from None


def parse_mode(mode: KernelMode | str) -> KernelMode:
    """The KernelMode for ``mode`` or its wire value; raises UnknownMode naming the valid ones."""
    try:
        return KernelMode(mode)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in KernelMode)
        raise UnknownMode(f"compute_ntk: unknown mode {mode!r}; expected one of {valid}") from None


def result_shape(mode: KernelMode | DerivedMode, n: int, m: int, k: int) -> tuple[int, ...]:
    """Shape of theta for ``mode`` with N = n, M = m examples and k outputs."""
    if mode is KernelMode.FULL:
        return (n, m, k, k)
    if mode is KernelMode.TRACE or mode is DerivedMode.PSEUDO:
        return (n, m)
    if mode is KernelMode.EXAMPLE_DIAGONAL:
        return (n, k, k)
    return (n, m, k)
