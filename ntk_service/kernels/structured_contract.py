"""Contractions of the structured NTK, one per mode, accumulated in place into one buffer per block.

A factored term J_c = Σ_g Σ_t D_c[g,t] ⊗ A[g,t] (``structured_rules.Factors``) contributes

    Θ_cd(x1, x2) += Σ_g Σ_{t,s} G^D_cd[g; t, s] · G^A[g; t, s],   G^D = D1 D2ᵀ (Gram of the δ's), G^A = A1 A2ᵀ

(+ 1 inside G^A when a bias over the same uses is folded in: J_b = Σ_t δ[t] ⊗ 1). A Jacobian term contributes
J1 J2ᵀ. Each mode contracts the output axes inside the Grams (TRACE and OUTPUT_DIAGONAL pair c with c only), so
no mode reduces a FULL block.

Accumulator layouts: FULL (n, k, m, k), TRACE (n, m), OUTPUT_DIAGONAL (k, n, m), EXAMPLE_DIAGONAL (n, k, k).
"""

from __future__ import annotations

import torch

from ntk_service.kernels.modes import KernelMode

__all__ = ["add_factored", "add_factored_diagonal", "add_jacobian", "add_jacobian_diagonal", "new_accumulator"]


def new_accumulator(mode: KernelMode, n: int, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero accumulator in the layout above (m is unused for EXAMPLE_DIAGONAL)."""
    shape = {
        KernelMode.FULL: (n, k, m, k),
        KernelMode.TRACE: (n, m),
        KernelMode.OUTPUT_DIAGONAL: (k, n, m),
        KernelMode.EXAMPLE_DIAGONAL: (n, k, k),
    }[mode]
    return torch.zeros(shape, dtype=dtype)


def finish(acc: torch.Tensor, mode: KernelMode) -> torch.Tensor:
    """The accumulator as a theta block: (n, m, k, k), (n, m), (n, m, k) or (n, k, k)."""
    if mode is KernelMode.FULL:
        return acc.permute(0, 2, 1, 3)
    if mode is KernelMode.OUTPUT_DIAGONAL:
        return acc.permute(1, 2, 0)
    return acc


def add_jacobian(acc: torch.Tensor, j1: torch.Tensor, j2: torch.Tensor, mode: KernelMode) -> None:
    """acc += J1 J2ᵀ for j1 (n, k, p), j2 (m, k, p) in ``mode`` (not EXAMPLE_DIAGONAL)."""
    n, k, _ = j1.shape
    m = j2.shape[0]
    if mode is KernelMode.FULL:
        acc.view(n * k, m * k).addmm_(j1.reshape(n * k, -1), j2.reshape(m * k, -1).T)
    elif mode is KernelMode.TRACE:
        acc.addmm_(j1.reshape(n, -1), j2.reshape(m, -1).T)
    else:
        acc.baddbmm_(j1.transpose(0, 1), j2.permute(1, 2, 0))


def add_jacobian_diagonal(acc: torch.Tensor, j: torch.Tensor) -> None:
    """acc (n, k, k) += J_n J_nᵀ for j (n, k, p)."""
    acc.baddbmm_(j, j.transpose(1, 2))


def _gram_a(a1: torch.Tensor, a2: torch.Tensor, index: bool, plus_one: bool, dtype: torch.dtype) -> torch.Tensor:
    """G^A: (G, n·T, m·S) from a1 (n, G, T, da) and a2 (m, G, S, da); ids (n, 1, T) when ``index``."""
    g = a1.shape[1]
    if index:
        gram = (a1.reshape(-1, 1) == a2.reshape(1, -1)).to(dtype).unsqueeze(0)
    else:
        left = a1.transpose(0, 1).reshape(g, -1, a1.shape[-1])
        right = a2.transpose(0, 1).reshape(g, -1, a2.shape[-1])
        gram = torch.bmm(left, right.transpose(1, 2)) if g > 1 else (left[0] @ right[0].T).unsqueeze(0)
    if plus_one:
        gram += 1
    return gram


def add_factored(
    acc: torch.Tensor,
    left: tuple[torch.Tensor, torch.Tensor],
    right: tuple[torch.Tensor, torch.Tensor],
    mode: KernelMode,
    *,
    index: bool,
    plus_one: bool,
) -> None:
    """acc += the factored term of (a1, d1) with (a2, d2) in ``mode`` (not EXAMPLE_DIAGONAL).

    a1 (n, G, T, da) or ids (n, 1, T); d1 (n, k, G, T, dd); likewise a2, d2 with m examples and S positions.
    """
    a1, d1 = left
    a2, d2 = right
    n, k, g, t, dd = d1.shape
    m, s = d2.shape[0], d2.shape[3]
    gram_a = _gram_a(a1, a2, index, plus_one, d1.dtype)  # (G, n·T, m·S)
    if mode is KernelMode.FULL:
        dl = d1.permute(2, 0, 1, 3, 4).reshape(g, n * k * t, dd)
        dr = d2.permute(2, 0, 1, 3, 4).reshape(g, m * k * s, dd)
        if g == 1 and t == 1 and s == 1:
            gram_d = dl[0] @ dr[0].T  # (n·k, m·k)
            acc.addcmul_(gram_d.view(n, k, m, k), gram_a.view(n, 1, m, 1))
            return
        gram_d = torch.bmm(dl, dr.transpose(1, 2)).view(g, n, k, t, m, k, s)
        gram_d.mul_(gram_a.view(g, n, 1, t, m, 1, s))
        acc.add_(gram_d.sum((0, 3, 6)))
        return
    if mode is KernelMode.TRACE:
        dl = d1.permute(2, 0, 3, 1, 4).reshape(g, n * t, k * dd)
        dr = d2.permute(2, 0, 3, 1, 4).reshape(g, m * s, k * dd)
        gram_d = torch.bmm(dl, dr.transpose(1, 2))  # (G, n·T, m·S), summed over c
        if g == 1 and t == 1 and s == 1:
            acc.addcmul_(gram_d.view(n, m), gram_a.view(n, m))
            return
        acc.add_(gram_d.mul_(gram_a).view(g, n, t, m, s).sum((0, 2, 4)))
        return
    # OUTPUT_DIAGONAL: one Gram per output c, acc (k, n, m)
    dl = d1.permute(1, 2, 0, 3, 4).reshape(k * g, n * t, dd)
    dr = d2.permute(1, 2, 0, 3, 4).reshape(k * g, m * s, dd)
    gram_d = torch.bmm(dl, dr.transpose(1, 2)).view(k, g, n, t, m, s)
    gram_d.mul_(gram_a.view(1, g, n, t, m, s))
    acc.add_(gram_d.sum((1, 3, 5)))


def add_factored_diagonal(
    acc: torch.Tensor, side: tuple[torch.Tensor, torch.Tensor], *, index: bool, plus_one: bool
) -> None:
    """acc (n, k, k) += the factored term of each example with itself."""
    a, d = side
    n, k, g, t, dd = d.shape
    if index:
        gram_a = (a.unsqueeze(-1) == a.unsqueeze(-2)).to(d.dtype)  # (n, 1, T, T)
    else:
        gram_a = a @ a.transpose(-1, -2)  # (n, G, T, T)
    if plus_one:
        gram_a += 1
    dd_ = d.permute(0, 2, 1, 3, 4).reshape(n * g, k * t, dd)
    gram_d = torch.bmm(dd_, dd_.transpose(1, 2)).view(n, g, k, t, k, t)
    gram_d.mul_(gram_a.view(n, g, 1, t, 1, t))
    acc.add_(gram_d.sum((1, 3, 5)))
