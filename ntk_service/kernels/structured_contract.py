"""Contractions of the structured NTK, one per mode, accumulated in place into one buffer per block.

A factored term J_c = Σ_g Σ_t D_c[g,t] ⊗ A[g,t] (``structured_rules.Factors``) contributes

    Θ_cd(x1, x2) += Σ_g Σ_{t,s} G^D_cd[g; t, s] · G^A[g; t, s],   G^D = D1 D2ᵀ (Gram of the δ's), G^A = A1 A2ᵀ

(+ 1 inside G^A when a bias over the same uses is folded in: J_b = Σ_t δ[t] ⊗ 1). A Jacobian term contributes
J1 J2ᵀ. Each mode contracts the output axes inside the Grams (TRACE and OUTPUT_DIAGONAL pair c with c only), so
no mode reduces a FULL block.

Accumulator layouts: FULL (k, n, k, m), TRACE (n, m), OUTPUT_DIAGONAL (k, n, m), EXAMPLE_DIAGONAL (n, k, k).

NOTE [accumulator memory]: the FULL accumulator is indexed (c, i, d, j) in every case, but its memory follows the
δ's: the autograd capture leaves δ in (k, n, ·) memory, so the δ Grams come out with rows (c, i) and the memory is
(k, n, k, m); the sequential chain (``structured_chain.py``) and rule Jacobians lie example-major, (n, k, ·), so
the Grams come out with rows (i, c) and the memory is (n, k, m, k) (``prefers_example_major`` decides per block).
Either way each Gram is written where it lies, and the one permuting pass that makes theta's (n, m, k, k) layout
(``finish``, ``finish_with_factored``) is the costly part of a small kernel: from (n, k, m, k) memory it moves k-long
runs within one example's rows; from (k, n, k, m) every element comes from another row (MLP 784-512-512-10,
N = M = 256: 6.7 against 13.4 ms for that pass, of a ~110 ms kernel).

NOTE [example-independent δ]: when δ of a weight is the same for every example (stride 0 over the examples, as
the capture leaves it for a Linear layer whose output is the model's output: δ_c = e_c), G^D is one k×k matrix Δ
and the term is Δ ⊗ G^A: an outer product instead of an (n·k)×(m·k) Gram.
"""

from __future__ import annotations

import torch

from ntk_service.kernels.modes import KernelMode

__all__ = [
    "accumulator_shape",
    "add_factored",
    "add_factored_diagonal",
    "add_jacobian",
    "add_jacobian_diagonal",
    "finish",
    "finish_with_factored",
    "fusable",
    "new_accumulator",
    "prefers_example_major",
]


def accumulator_shape(mode: KernelMode, n: int, m: int, k: int) -> tuple[int, ...]:
    """The accumulator's shape in the layout above (m is unused for EXAMPLE_DIAGONAL)."""
    return {
        KernelMode.FULL: (k, n, k, m),
        KernelMode.TRACE: (n, m),
        KernelMode.OUTPUT_DIAGONAL: (k, n, m),
        KernelMode.EXAMPLE_DIAGONAL: (n, k, k),
    }[mode]


def new_accumulator(
    mode: KernelMode, n: int, m: int, k: int, dtype: torch.dtype, *, example_major: bool = False, zero: bool = True
) -> torch.Tensor:
    """An accumulator of the shape above, zero or (``zero=False``) uninitialized; FULL with ``example_major`` in
    (n, k, m, k) memory (NOTE [accumulator memory])."""
    make = torch.zeros if zero else torch.empty
    if mode is KernelMode.FULL and example_major:
        return make((n, k, m, k), dtype=dtype).permute(1, 0, 3, 2)
    return make(accumulator_shape(mode, n, m, k), dtype=dtype)


def prefers_example_major(tensors: list[torch.Tensor]) -> bool:
    """Whether a FULL accumulator for these δ's (n, k, ...) and Jacobians (n, k, p) lies example-major: unless
    one of them lies output-major (NOTE [accumulator memory]); δ's shared by all examples say nothing."""
    return not any(_output_major(t) for t in tensors)


def finish(acc: torch.Tensor, mode: KernelMode) -> torch.Tensor:
    """The accumulator as a theta block: (n, m, k, k), (n, m), (n, m, k) or (n, k, k)."""
    if mode is KernelMode.FULL:
        return acc.permute(1, 3, 0, 2)
    if mode is KernelMode.OUTPUT_DIAGONAL:
        return acc.permute(1, 2, 0)
    return acc


def _output_major(t: torch.Tensor) -> bool:
    """Whether t (n, k, ...) lies in (k, n, ...) memory (the autograd capture's layout); a tensor shared by all
    examples (stride 0) lies either way."""
    return t.shape[0] > 1 and t.shape[1] > 1 and t.stride(1) > t.stride(0) != 0


def add_jacobian(acc: torch.Tensor, j1: torch.Tensor, j2: torch.Tensor, mode: KernelMode) -> None:
    """acc += J1 J2ᵀ for j1 (n, k, p), j2 (m, k, p) in ``mode`` (not EXAMPLE_DIAGONAL)."""
    n, k, _ = j1.shape
    m = j2.shape[0]
    if mode is KernelMode.FULL:
        if _output_major(j1) and _output_major(j2) and acc.is_contiguous():
            acc.view(k * n, k * m).addmm_(
                j1.transpose(0, 1).reshape(k * n, -1), j2.transpose(0, 1).reshape(k * m, -1).T
            )
        elif acc.permute(1, 0, 3, 2).is_contiguous():  # example-major J and accumulator: added in place
            acc.permute(1, 0, 3, 2).view(n * k, m * k).addmm_(j1.reshape(n * k, -1), j2.reshape(m * k, -1).T)
        else:  # example-major J (rule Jacobians, jacrev): one Gram in that order, added permuted
            gram = j1.reshape(n * k, -1) @ j2.reshape(m * k, -1).T
            acc.add_(gram.view(n, k, m, k).permute(1, 0, 3, 2))
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
        return gram + 1 if plus_one else gram
    one = _one(dtype, a1.device)  # the bias: + 1 fused into the product (beta = 1 or 0)
    if g == 1:  # the common case in as few tensor calls as it takes: (n·T, da) by (m·S, da)
        left, right = a1.reshape(-1, a1.shape[-1]), a2.reshape(-1, a2.shape[-1])
        return torch.addmm(one, left, right.T, beta=int(plus_one))[None]
    left = a1.transpose(0, 1).reshape(g, -1, a1.shape[-1])
    right = a2.transpose(0, 1).reshape(g, -1, a2.shape[-1])
    return torch.baddbmm(one, left, right.transpose(1, 2), beta=int(plus_one))


_ONES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor 1 of ``dtype`` on ``device``, made once per pair (only ever read; NOTE [device context] in
    api.py)."""
    key = (dtype, device)
    one = _ONES.get(key)
    if one is None:
        one = _ONES[key] = torch.ones((), dtype=dtype, device=device)
    return one


def _example_independent(d1: torch.Tensor, d2: torch.Tensor) -> torch.Tensor | None:
    """Δ (k, k) = δ1 δ2ᵀ when both δ (n, k, 1, 1, dd) are the same for every example (NOTE [example-independent
    δ]), else None."""
    if d1.stride(0) != 0 or d2.stride(0) != 0 or d1.shape[2] != 1 or d1.shape[3] != 1 or d2.shape[3] != 1:
        return None
    return d1[0, :, 0, 0] @ d2[0, :, 0, 0].T


def _plain_gram_d(d1: torch.Tensor, d2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """G^D of δ's with G = T = S = 1, d1 (n, k, 1, 1, dd): indexed (k, n, k, m), its rows in the order the δ's
    lie in memory ((i, c) when both lie example-major, else (c, i): NOTE [accumulator memory]); written into
    ``out`` (a FULL accumulator) when given, in place where its memory has that order."""
    (n, k), m, dd = d1.shape[:2], d2.shape[0], d1.shape[-1]
    if _output_major(d1) or _output_major(d2):  # rows (c, i): (k, n, k, m) memory
        left, right = d1.permute(1, 0, 2, 3, 4).reshape(k * n, dd), d2.permute(1, 0, 2, 3, 4).reshape(k * m, dd)
        memory_shape, to_memory = (k, n, k, m), (0, 1, 2, 3)
    else:  # rows (i, c): (n, k, m, k) memory
        left, right = d1.reshape(n * k, dd), d2.reshape(m * k, dd)
        memory_shape, to_memory = (n, k, m, k), (1, 0, 3, 2)  # its own inverse
    if out is not None and out.permute(to_memory).is_contiguous():
        torch.mm(left, right.T, out=out.permute(to_memory).view(n * k, m * k))
        return out
    gram = torch.mm(left, right.T).view(memory_shape).permute(to_memory)
    return gram if out is None else out.copy_(gram)


def _add_example_major(
    memory: torch.Tensor,
    d1: torch.Tensor,
    d2: torch.Tensor,
    shared: torch.Tensor | None,
    gram_a: torch.Tensor,
    *,
    fresh: bool,
) -> None:
    """memory (n, k, m, k) [+]= G^D ⊙ G^A of a plain or example-independent term, in an example-major FULL
    accumulator. G^A (n, m) is repeated over d first, so every elementwise pass runs over m·k contiguous elements
    (broadcasting it over (c, d) directly gives loops of k); an identity-like Δ touches only the diagonal c = d."""
    n, k, m, _ = memory.shape
    if shared is not None and torch.equal(shared, torch.diag_embed(shared.diagonal())):
        if fresh:
            memory.zero_()
        memory.diagonal(dim1=1, dim2=3).addcmul_(gram_a.unsqueeze(-1), shared.diagonal())  # (n, m, k)
        return
    repeated = gram_a.unsqueeze(-1).expand(n, m, k).reshape(n, 1, m * k)
    flat = memory.view(n, k, m * k)
    if shared is not None:
        if fresh:
            torch.mul(repeated.view(n, 1, m, k), shared.view(1, k, 1, k), out=memory)
        else:
            memory.addcmul_(repeated.view(n, 1, m, k), shared.view(1, k, 1, k))
        return
    if fresh:  # the Gram written into the accumulator, scaled in place while it is in cache
        _plain_gram_d(d1, d2, out=memory.permute(1, 0, 3, 2))
        flat.mul_(repeated)
        return
    gram = _plain_gram_d(d1, d2).permute(1, 0, 3, 2)
    if gram.is_contiguous():
        flat.addcmul_(gram.reshape(n, k, m * k), repeated)
    else:
        memory.addcmul_(gram, gram_a.view(n, 1, m, 1))


def add_factored(
    acc: torch.Tensor,
    left: tuple[torch.Tensor, torch.Tensor],
    right: tuple[torch.Tensor, torch.Tensor],
    mode: KernelMode,
    *,
    index: bool,
    plus_one: bool,
    fresh: bool = False,
) -> None:
    """acc += the factored term of (a1, d1) with (a2, d2) in ``mode`` (not EXAMPLE_DIAGONAL).

    a1 (n, G, T, da) or ids (n, 1, T); d1 (n, k, G, T, dd); likewise a2, d2 with m examples and S positions.
    ``fresh``: acc is uninitialized (``torch.empty``) and this is its first term: written, not added, which
    spares zeroing and re-reading the block's largest buffer.
    """
    a1, d1 = left
    a2, d2 = right
    n, k, g, t, dd = d1.shape
    m, s = d2.shape[0], d2.shape[3]
    gram_a = _gram_a(a1, a2, index, plus_one, d1.dtype)  # (G, n·T, m·S)
    shared = _example_independent(d1, d2)
    if mode is KernelMode.FULL and (shared is not None or g == t == s == 1):  # one (k, n, k, m) product
        memory = acc.permute(1, 0, 3, 2)
        if memory.is_contiguous():  # example-major (NOTE [accumulator memory])
            _add_example_major(memory, d1, d2, shared, gram_a.view(n, m), fresh=fresh)
            return
        if fresh and shared is None:  # the Gram written into acc, scaled in place while it is in cache
            _plain_gram_d(d1, d2, out=acc)
            acc.mul_(gram_a.view(1, n, 1, m))
            return
        gram_d = shared.view(k, 1, k, 1) if shared is not None else _plain_gram_d(d1, d2)
        if fresh:
            torch.mul(gram_d, gram_a.view(1, n, 1, m), out=acc)
        else:
            acc.addcmul_(gram_d, gram_a.view(1, n, 1, m))
        return
    if fresh:
        acc.zero_()
    if shared is not None:  # G^A (n, m) times one k×k Δ
        if mode is KernelMode.TRACE:
            acc.add_(gram_a.view(n, m) * shared.trace())
        else:
            acc.addcmul_(shared.diagonal().view(k, 1, 1), gram_a.view(1, n, m))
        return
    if mode is KernelMode.FULL:
        dl = d1.permute(2, 1, 0, 3, 4).reshape(g, k * n * t, dd)  # rows (c, example, position): δ's memory order
        dr = d2.permute(2, 1, 0, 3, 4).reshape(g, k * m * s, dd)
        gram_d = torch.bmm(dl, dr.transpose(1, 2)).view(g, k, n, t, k, m, s)
        gram_d.mul_(gram_a.view(g, 1, n, t, 1, m, s))
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
    if g == t == s == 1:  # δ read in place in either memory order: (k, n, dd) matrices with a row stride
        gram_d = torch.bmm(d1[:, :, 0, 0].transpose(0, 1), d2[:, :, 0, 0].permute(1, 2, 0))
        acc.addcmul_(gram_d, gram_a.view(1, n, m))
        return
    dl = d1.permute(1, 2, 0, 3, 4).reshape(k * g, n * t, dd)
    dr = d2.permute(1, 2, 0, 3, 4).reshape(k * g, m * s, dd)
    gram_d = torch.bmm(dl, dr.transpose(1, 2)).view(k, g, n, t, m, s)
    gram_d.mul_(gram_a.view(1, g, n, t, m, s))
    acc.add_(gram_d.sum((1, 3, 5)))


def fusable(left: tuple[torch.Tensor, torch.Tensor], right: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether ``finish_with_factored`` takes this term: float A, G = T = S = 1."""
    (a1, d1), (_, d2) = left, right
    return a1.is_floating_point() and d1.shape[2:4] == (1, 1) and d2.shape[2:4] == (1, 1)


def finish_with_factored(
    acc: torch.Tensor,
    left: tuple[torch.Tensor, torch.Tensor],
    right: tuple[torch.Tensor, torch.Tensor],
    *,
    plus_one: bool,
) -> torch.Tensor:
    """theta (n, m, k, k), contiguous = FULL acc (k, n, k, m) + one more ``fusable`` factored term, in one pass
    that writes theta's layout (the permuting copy of the accumulator, with k-long inner runs, is the slow part of
    a small block; the term rides along)."""
    (a1, d1), (a2, d2) = left, right
    k, n, _, m = acc.shape
    gram_a = _gram_a(a1, a2, False, plus_one, acc.dtype)[0]  # (n, m)
    shared = _example_independent(d1, d2)
    if shared is not None:
        gram_d = shared.view(1, 1, k, k)
    else:
        gram_d = _plain_gram_d(d1, d2).permute(1, 3, 0, 2)
    theta = torch.empty(n, m, k, k, dtype=acc.dtype)
    return torch.addcmul(acc.permute(1, 3, 0, 2), gram_d, gram_a.view(n, m, 1, 1), out=theta)


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
