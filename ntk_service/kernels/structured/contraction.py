"""Contractions of the structured NTK, one per mode, accumulated in place into one buffer per block.

A factored term J_c = Σ_g Σ_t D_c[g,t] ⊗ A[g,t] (``rules.Factors``) contributes

    Θ_cd(x1, x2) += Σ_g Σ_{t,s} G^D_cd[g; t, s] · G^A[g; t, s],   G^D = D1 D2ᵀ (Gram of the δ's), G^A = A1 A2ᵀ

(+ c² inside G^A when a bias taken with scale c over the same uses is folded in: J_b = c Σ_t δ[t]). A Jacobian
term contributes J1 J2ᵀ. Each mode contracts the output axes inside the Grams (TRACE and OUTPUT_DIAGONAL pair c
with c only), so no mode reduces a FULL block.

Accumulator layouts: FULL (k, n, k, m), TRACE (n, m), OUTPUT_DIAGONAL (k, n, m), EXAMPLE_DIAGONAL (n, k, k).

NOTE [accumulator memory]: the FULL accumulator is indexed (c, i, d, j) in every case, but its memory follows the
δ's: the autograd capture leaves δ in (k, n, ·) memory, so the δ Grams come out with rows (c, i) and the memory is
(k, n, k, m); the sequential chain (``chain.py``) and rule Jacobians lie example-major, (n, k, ·), so the Grams
come out with rows (i, c) and the memory is (n, k, m, k) (``prefers_example_major`` decides per block). Either way
each Gram is written where it lies, and the one permuting pass that makes theta's (n, m, k, k) layout (``finish``,
``finish_with_factored``) is the costly part of a small kernel: from (n, k, m, k) memory it moves k-long runs within
one example's rows; from (k, n, k, m) every element comes from another row. The layouts are facts the sides
declare (``descriptors.Layout``), and the accumulator's is recorded in ``Accumulator.example_major``: nothing here
reads a stride to decide.

NOTE [example-independent δ]: when δ of a weight is the same for every example (declared ``Delta.shared``: the
identity δ_c = e_c of a Linear layer whose output is the model's output, or the rows of W the chain hands below
it), G^D is one k×k matrix Δ and the term is Δ ⊗ G^A: an outer product instead of an (n·k)×(m·k) Gram.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ntk_service.kernels.modes import Examples, KernelMode, Outputs
from ntk_service.kernels.structured.descriptors import Delta, FactorSide, JacobianSide, Layout

__all__ = [
    "Accumulator",
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
    "shared_gram",
]


def accumulator_shape(mode: KernelMode, n: int, m: int, k: int) -> tuple[int, ...]:
    """The accumulator's shape in the layout above, from the mode's axes (m is unused per example)."""
    if not mode.spec.pairs:  # the per-example blocks of all outputs
        return (n, k, k)
    return {Outputs.ALL: (k, n, k, m), Outputs.SUM: (n, m), Outputs.DIAGONAL: (k, n, m)}[mode.spec.outputs]


@dataclass(frozen=True)
class Accumulator:
    """A block's accumulator: ``tensor`` indexed as above; ``example_major``: a FULL one lies in (n, k, m, k)
    memory, else (k, n, k, m) (NOTE [accumulator memory]). Made once per block by ``new_accumulator``; every
    term is added into it by the ``add_*`` functions."""

    tensor: torch.Tensor
    mode: KernelMode
    example_major: bool = False

    @property
    def outputs(self) -> Outputs | None:
        """The outputs axis of a block of example pairs, which picks each term's contraction (NOTE [mode
        contractions] in modes.py); None for the per-example blocks."""
        return self.mode.spec.outputs if self.mode.spec.pairs else None


def new_accumulator(
    mode: KernelMode, n: int, m: int, k: int, dtype: torch.dtype, *, example_major: bool = False
) -> Accumulator:
    """A zero accumulator of the shape above; FULL with ``example_major`` in (n, k, m, k) memory (NOTE
    [accumulator memory])."""
    if mode.spec.axes == (Examples.PAIRS, Outputs.ALL) and example_major:
        return Accumulator(torch.zeros((n, k, m, k), dtype=dtype).permute(1, 0, 3, 2), mode, True)
    return Accumulator(torch.zeros(accumulator_shape(mode, n, m, k), dtype=dtype), mode, False)


def prefers_example_major(layouts: list[Layout]) -> bool:
    """Whether a FULL accumulator for δ's and Jacobians of these layouts lies example-major: unless one of them
    lies output-major (NOTE [accumulator memory]); δ's shared by all examples are not listed (they lie either way)."""
    return Layout.OUTPUT_MAJOR not in layouts


def finish(acc: Accumulator) -> torch.Tensor:
    """The accumulator as a theta block: (n, m, k, k), (n, m), (n, m, k) or (n, k, k)."""
    if acc.outputs is Outputs.ALL:
        return acc.tensor.permute(1, 3, 0, 2)
    if acc.outputs is Outputs.DIAGONAL:
        return acc.tensor.permute(1, 2, 0)
    return acc.tensor


def add_jacobian(acc: Accumulator, left: JacobianSide, right: JacobianSide) -> None:
    """acc += J1 J2ᵀ for J1 (n, k, p), J2 (m, k, p) in the accumulator's mode (not EXAMPLE_DIAGONAL)."""
    t, j1, j2 = acc.tensor, left.tensor, right.tensor
    n, k, _ = j1.shape
    m = j2.shape[0]
    if acc.outputs is Outputs.ALL:
        output_major = left.layout is Layout.OUTPUT_MAJOR and right.layout is Layout.OUTPUT_MAJOR
        if output_major and not acc.example_major:
            t.view(k * n, k * m).addmm_(j1.transpose(0, 1).reshape(k * n, -1), j2.transpose(0, 1).reshape(k * m, -1).T)
        elif acc.example_major:  # example-major J and accumulator: added in place
            t.permute(1, 0, 3, 2).view(n * k, m * k).addmm_(j1.reshape(n * k, -1), j2.reshape(m * k, -1).T)
        else:  # example-major J (rule Jacobians, jacrev): one Gram in that order, added permuted
            gram = j1.reshape(n * k, -1) @ j2.reshape(m * k, -1).T
            t.add_(gram.view(n, k, m, k).permute(1, 0, 3, 2))
    elif acc.outputs is Outputs.SUM:
        if left.layout is Layout.OUTPUT_MAJOR and right.layout is Layout.OUTPUT_MAJOR and k > 1:
            for c in range(k):  # each output's rows are one contiguous matrix: no copy of J
                t.addmm_(j1[:, c], j2[:, c].T)
        else:
            t.addmm_(j1.reshape(n, -1), j2.reshape(m, -1).T)
    else:
        t.baddbmm_(j1.transpose(0, 1), j2.permute(1, 2, 0))


def add_jacobian_diagonal(acc: Accumulator, side: JacobianSide) -> None:
    """acc (n, k, k) += J_n J_nᵀ for J (n, k, p)."""
    acc.tensor.baddbmm_(side.tensor, side.tensor.transpose(1, 2))


def _gram_a(a1: torch.Tensor, a2: torch.Tensor, index: bool, plus: float, dtype: torch.dtype) -> torch.Tensor:
    """G^A + plus: (G, n·T, m·S) from a1 (n, G, T, da) and a2 (m, G, S, da); ids (n, 1, T) when ``index``."""
    g = a1.shape[1]
    if index:
        gram = (a1.reshape(-1, 1) == a2.reshape(1, -1)).to(dtype).unsqueeze(0)
        return gram + plus if plus else gram
    one = _one(dtype, a1.device)  # the bias: + c² fused into the product (beta = c² or 0)
    if g == 1:  # the common case in as few tensor calls as it takes: (n·T, da) by (m·S, da)
        left, right = a1.reshape(-1, a1.shape[-1]), a2.reshape(-1, a2.shape[-1])
        return torch.addmm(one, left, right.T, beta=plus)[None]
    left = a1.transpose(0, 1).reshape(g, -1, a1.shape[-1])
    right = a2.transpose(0, 1).reshape(g, -1, a2.shape[-1])
    return torch.baddbmm(one, left, right.transpose(1, 2), beta=plus)


_ONES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
"""A read-only cache of constants (never steered, keyed on the device: NOTE [device context] in api.py)."""


def _one(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor 1 of ``dtype`` on ``device``, made once per pair (only ever read)."""
    key = (dtype, device)
    one = _ONES.get(key)
    if one is None:
        one = _ONES[key] = torch.ones((), dtype=dtype, device=device)
    return one


def shared_gram(d1: Delta, d2: Delta) -> torch.Tensor | None:
    """Δ (k, k) = δ1 δ2ᵀ when both δ (n, k, 1, 1, dd) are declared the same for every example (NOTE
    [example-independent δ]), else None."""
    t1, t2 = d1.tensor, d2.tensor
    if not (d1.shared and d2.shared) or t1.shape[2] != 1 or t1.shape[3] != 1 or t2.shape[3] != 1:
        return None
    return t1[0, :, 0, 0] @ t2[0, :, 0, 0].T


def _plain_gram_d(d1: Delta, d2: Delta) -> torch.Tensor:
    """G^D of δ's with G = T = S = 1, d1 (n, k, 1, 1, dd): indexed (k, n, k, m), its rows in the order the δ's
    lie in memory ((i, c) when both lie example-major, else (c, i): NOTE [accumulator memory])."""
    t1, t2 = d1.tensor, d2.tensor
    (n, k), m, dd = t1.shape[:2], t2.shape[0], t1.shape[-1]
    if Layout.OUTPUT_MAJOR in (d1.layout, d2.layout):  # rows (c, i): (k, n, k, m) memory
        left, right = t1.permute(1, 0, 2, 3, 4).reshape(k * n, dd), t2.permute(1, 0, 2, 3, 4).reshape(k * m, dd)
        return torch.mm(left, right.T).view(k, n, k, m)
    left, right = t1.reshape(n * k, dd), t2.reshape(m * k, dd)  # rows (i, c): (n, k, m, k) memory
    return torch.mm(left, right.T).view(n, k, m, k).permute(1, 0, 3, 2)


def _add_example_major(
    acc: Accumulator, d1: Delta, d2: Delta, shared: torch.Tensor | None, gram_a: torch.Tensor
) -> None:
    """acc += G^D ⊙ G^A of a plain or example-independent term, in an example-major FULL accumulator, whose memory
    is (n, k, m, k). G^A (n, m) is repeated over d first, so every elementwise pass runs over m·k contiguous
    elements (broadcasting it over (c, d) directly gives loops of k); an identity-like Δ touches only c = d."""
    memory = acc.tensor.permute(1, 0, 3, 2)
    n, k, m, _ = memory.shape
    if shared is not None and torch.equal(shared, torch.diag_embed(shared.diagonal())):
        memory.diagonal(dim1=1, dim2=3).addcmul_(gram_a.unsqueeze(-1), shared.diagonal())  # (n, m, k)
        return
    repeated = gram_a.unsqueeze(-1).expand(n, m, k).reshape(n, 1, m * k)
    if shared is not None:
        memory.addcmul_(repeated.view(n, 1, m, k), shared.view(1, k, 1, k))
        return
    gram = _plain_gram_d(d1, d2).permute(1, 0, 3, 2)
    if Layout.OUTPUT_MAJOR not in (d1.layout, d2.layout):  # the Gram lies (n, k, m, k): one flat pass
        memory.view(n, k, m * k).addcmul_(gram.reshape(n, k, m * k), repeated)
    else:
        memory.addcmul_(gram, gram_a.view(n, 1, m, 1))


def add_factored(
    acc: Accumulator,
    left: FactorSide,
    right: FactorSide,
    *,
    index: bool,
    plus: float,
    shared_delta: bool = True,
) -> None:
    """acc += the factored term of (a1, d1) with (a2, d2) in the accumulator's mode (not EXAMPLE_DIAGONAL).

    a1 (n, G, T, da) or ids (n, 1, T); d1 (n, k, G, T, dd); likewise a2, d2 with m examples and S positions.
    ``shared_delta``: take δ's declared shared by all examples as one Δ (NOTE [example-independent δ]).
    """
    a1, d1 = left
    a2, d2 = right
    t, outputs = acc.tensor, acc.outputs
    n, k, g, tt, dd = d1.tensor.shape
    m, s = d2.tensor.shape[0], d2.tensor.shape[3]
    gram_a = _gram_a(a1, a2, index, plus, d1.tensor.dtype)  # (G, n·T, m·S)
    shared = shared_gram(d1, d2) if shared_delta else None
    if outputs is Outputs.ALL and (shared is not None or g == tt == s == 1):  # one (k, n, k, m) product
        if acc.example_major:
            _add_example_major(acc, d1, d2, shared, gram_a.view(n, m))
            return
        gram_d = shared.view(k, 1, k, 1) if shared is not None else _plain_gram_d(d1, d2)
        t.addcmul_(gram_d, gram_a.view(1, n, 1, m))
        return
    if shared is not None:  # G^A (n, m) times one k×k Δ
        if outputs is Outputs.SUM:
            t.add_(gram_a.view(n, m) * shared.trace())
        else:
            t.addcmul_(shared.diagonal().view(k, 1, 1), gram_a.view(1, n, m))
        return
    _add_general(acc, d1.tensor, d2.tensor, gram_a)


def _add_general(acc: Accumulator, d1: torch.Tensor, d2: torch.Tensor, gram_a: torch.Tensor) -> None:
    """acc += Σ_g Σ_{t,s} G^D ⊙ G^A for δ's with groups or positions (and OUTPUT_DIAGONAL/TRACE's plain case)."""
    t, outputs = acc.tensor, acc.outputs
    n, k, g, tt, dd = d1.shape
    m, s = d2.shape[0], d2.shape[3]
    if outputs is Outputs.ALL:
        dl = d1.permute(2, 1, 0, 3, 4).reshape(g, k * n * tt, dd)  # rows (c, example, position): δ's memory order
        dr = d2.permute(2, 1, 0, 3, 4).reshape(g, k * m * s, dd)
        gram_d = torch.bmm(dl, dr.transpose(1, 2)).view(g, k, n, tt, k, m, s)
        gram_d.mul_(gram_a.view(g, 1, n, tt, 1, m, s))
        t.add_(gram_d.sum((0, 3, 6)))
        return
    if outputs is Outputs.SUM:
        dl = d1.permute(2, 0, 3, 1, 4).reshape(g, n * tt, k * dd)
        dr = d2.permute(2, 0, 3, 1, 4).reshape(g, m * s, k * dd)
        gram_d = torch.bmm(dl, dr.transpose(1, 2))  # (G, n·T, m·S), summed over c
        if g == 1 and tt == 1 and s == 1:
            t.addcmul_(gram_d.view(n, m), gram_a.view(n, m))
            return
        t.add_(gram_d.mul_(gram_a).view(g, n, tt, m, s).sum((0, 2, 4)))
        return
    # OUTPUT_DIAGONAL: one Gram per output c, acc (k, n, m)
    if g == tt == s == 1:  # δ read in place in either memory order: (k, n, dd) matrices with a row stride
        gram_d = torch.bmm(d1[:, :, 0, 0].transpose(0, 1), d2[:, :, 0, 0].permute(1, 2, 0))
        t.addcmul_(gram_d, gram_a.view(1, n, m))
        return
    dl = d1.permute(1, 2, 0, 3, 4).reshape(k * g, n * tt, dd)
    dr = d2.permute(1, 2, 0, 3, 4).reshape(k * g, m * s, dd)
    gram_d = torch.bmm(dl, dr.transpose(1, 2)).view(k, g, n, tt, m, s)
    gram_d.mul_(gram_a.view(1, g, n, tt, m, s))
    t.add_(gram_d.sum((1, 3, 5)))


def fusable(left: FactorSide, right: FactorSide) -> bool:
    """Whether ``finish_with_factored`` takes this term: float A, G = T = S = 1."""
    return left.a.is_floating_point() and left.d.tensor.shape[2:4] == (1, 1) and right.d.tensor.shape[2:4] == (1, 1)


def finish_with_factored(
    acc: Accumulator | None,
    left: FactorSide,
    right: FactorSide,
    *,
    plus: float,
    shared_delta: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """theta (n, m, k, k), contiguous = FULL acc (k, n, k, m) + one more ``fusable`` factored term, in one pass
    that writes theta's layout (the permuting copy of the accumulator, with k-long inner runs, is the slow part of
    a small block; the term rides along). ``acc`` None: the term alone; ``out``: theta's memory (else new)."""
    (a1, d1), (a2, d2) = left, right
    n, k = d1.tensor.shape[:2]
    m = d2.tensor.shape[0]
    gram_a = _gram_a(a1, a2, False, plus, d1.tensor.dtype)[0]  # (n, m)
    shared = shared_gram(d1, d2) if shared_delta else None
    if shared is not None:
        gram_d = shared.view(1, 1, k, k)
    else:
        gram_d = _plain_gram_d(d1, d2).permute(1, 3, 0, 2)
    theta = torch.empty(n, m, k, k, dtype=d1.tensor.dtype) if out is None else out
    if acc is None:
        return torch.mul(gram_d, gram_a.view(n, m, 1, 1), out=theta)
    return torch.addcmul(acc.tensor.permute(1, 3, 0, 2), gram_d, gram_a.view(n, m, 1, 1), out=theta)


def add_factored_diagonal(acc: Accumulator, side: FactorSide, *, index: bool, plus: float) -> None:
    """acc (n, k, k) += the factored term of each example with itself."""
    a, d = side.a, side.d.tensor
    n, k, g, t, dd = d.shape
    if index:
        gram_a = (a.unsqueeze(-1) == a.unsqueeze(-2)).to(d.dtype)  # (n, 1, T, T)
    else:
        gram_a = a @ a.transpose(-1, -2)  # (n, G, T, T)
    if plus:
        gram_a += plus
    dd_ = d.permute(0, 2, 1, 3, 4).reshape(n * g, k * t, dd)
    gram_d = torch.bmm(dd_, dd_.transpose(1, 2)).view(n, g, k, t, k, t)
    gram_d.mul_(gram_a.view(n, g, 1, t, 1, t))
    acc.tensor.add_(gram_d.sum((1, 3, 5)))
