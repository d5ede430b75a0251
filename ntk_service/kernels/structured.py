"""Structured derivatives: the NTK from per-layer structure, without building the Jacobian of covered weights.

For a Linear layer y = a Wᵀ + b, ∂f_c/∂W = δ_c aᵀ with δ_c = ∂f_c/∂y, so the layer adds
Θ_cd(x1, x2) += (δ1_c · δ2_d)(a1 · a2 + 1) (the +1 is the bias); with positions t, s sharing the weight
(sequences, convolutions, repeated calls) Σ_{t,s} (δ1_c[t] · δ2_d[s])(a1[t] · a2[s]). The rules
(``structured_rules.py``) cover Linear (any leading dims), Conv1d/Conv2d, Embedding, and the affine parameters of
LayerNorm, RMSNorm, GroupNorm and eval-mode BatchNorm; every other parameter falls back to the Jacobian path
(per-example ``jacrev`` w.r.t. those parameters only, in the same reverse pass), and the parts add up.
See NOTE [covered parameters] and NOTE [probes] in ``structured_capture.py``; a plain ``nn.Sequential`` of Linear
layers and activations is captured in closed form instead (NOTE [sequential chains] in ``structured_chain.py``).

A side of n examples holds, per factored weight, the factors A (n, G, T, da) and D (n, k, G, T, dd), and per
other parameter its Jacobian (n, k, p), built directly from a and δ by the rule (J_W = Σ_t δ[t] ⊗ a[t] in one
matmul) or by ``jacrev`` for the fallback. NOTE [factored or Jacobian]: per weight the cheaper of the two
contractions is taken from its shapes: factored costs 2·G·T·S·(k²·dd + da + k²) per example pair, Jacobian
2·k²·p per pair plus building J (2·k·G·T·dd·da per example, counted over ``NOMINAL_PARTNERS`` partners). An MLP
layer (T = 1) is factored; a convolution over many positions usually takes the Jacobian form.

NOTE [interleaved joint pass]: when one pass builds both sides (``joint_sides``), the autograd capture leaves each
δ in (k, N + M, dd) memory. Concatenated examples make each side's δ a (k, N, dd) slice whose rows (c, i) are
not evenly spaced, so every δ Gram would first copy both operands (4 copies of k·N·dd for an MLP's two hidden
layers: 0.3-0.7 ms of a ~13 ms kernel at N = 64). With x1 and x2 interleaved (N = M) a side is every other example:
row (c, i) of either side lies at (c·N + i)·2·dd, a matrix with leading dimension 2·dd that BLAS reads in place;
inputs a likewise. Only plain factored terms (G = T = 1) are contracted that way; a side with rule Jacobians
(example-major, which a slice with a step would make copy instead) or positions uses concatenation, and so does a
sequential chain, whose δ lies example-major: each side a contiguous block of rows (i, c).

Time (N+M)·[FP]·(1 + k) for the sides (one forward, one vmapped reverse pass w.r.t. layer outputs), plus
N·M·k²·Σ_l(dd_l·T_l·S_l + ...) for factored layers and N·M·k²·p for the others (÷k for TRACE and
OUTPUT_DIAGONAL); for an MLP N·M·k²·Σ_l(out_l) + N·M·Σ_l(in_l) instead of N·M·k²·P. Memory per side
n·k·Σ_l(T_l·out_l) + n·Σ_l(T_l·in_l) for factored layers, n·k·p for the rest; per block pair the δ Gram
(n·k·T)·(m·k·S). Fastest where rules cover the parameters (MLPs, CNNs, transformers' Linear layers).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ntk_service.kernels.functional import NtkProblem
from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.math_attention import attention_scope
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.structured_capture import StructurePlan, capture, is_batch_safe, plan_structure
from ntk_service.kernels.structured_contract import (
    add_factored,
    add_factored_diagonal,
    add_jacobian,
    add_jacobian_diagonal,
    finish,
    finish_with_factored,
    fusable,
    new_accumulator,
    prefers_example_major,
)
from ntk_service.kernels.types import NamedTensors, NtkImplementation

__all__ = [
    "BATCHED_CAPTURE_WEIGHT",
    "NOMINAL_PARTNERS",
    "PER_EXAMPLE_CAPTURE_WEIGHT",
    "SYMMETRIC_SPLIT_MIN",
    "Structured",
    "StructuredTerms",
    "structured_terms",
]

NOMINAL_PARTNERS = 64
"""Examples a side is assumed to be contracted with when weighing the one-off cost of building a Jacobian
against the per-pair cost of the factored form (a side does not know M; blocks are rarely smaller)."""


@dataclass(frozen=True)
class FactoredTerm:
    """A weight contracted in factored form; ``bias`` is folded into it (+1 in G^A) when set."""

    name: str
    uses: tuple[int, ...]
    bias: str | None
    index: bool
    dims: tuple[int, int, int, int]  # (G, T summed over uses, da, dd), per example


@dataclass(frozen=True)
class JacobianTerm:
    """A rule-covered parameter whose J (n, k, p) is built from a and δ, summed over its uses."""

    name: str
    uses: tuple[tuple[int, str], ...]
    numel: int
    build_flops: float  # per example


@dataclass
class StructuredTerms:
    """How each selected parameter is contracted (see NOTE [factored or Jacobian])."""

    plan: StructurePlan
    factored: list[FactoredTerm]
    jacobian: list[JacobianTerm]
    batch_safe: bool | None = None  # decided on the first block of >= 2 real examples (``is_batch_safe``)

    @property
    def fallback(self) -> list[str]:
        return self.plan.fallback

    def covered(self) -> list[tuple[str, str]]:
        """(name, how) for every parameter a term contracts: "factored", "rule" (J from a and δ) or "fallback"
        (J by jacrev). Each selected parameter must appear exactly once."""
        out = [(t.name, "factored") for t in self.factored]
        out += [(t.bias, "factored") for t in self.factored if t.bias is not None]
        out += [(t.name, "rule") for t in self.jacobian]
        return out + [(name, "fallback") for name in self.plan.fallback]

    def coverage(self) -> dict[str, str]:
        """Selected parameter name -> how it is contracted (see ``covered``)."""
        return dict(self.covered())


def _choose_terms(problem: NtkProblem, plan: StructurePlan, form: str | None) -> StructuredTerms:
    k = problem.k
    factored: list[FactoredTerm] = []
    jacobian: list[JacobianTerm] = []
    folded: set[str] = set()
    uses_of = {name: tuple(u for u, _ in uses) for name, uses in plan.param_uses.items()}
    for name, uses in plan.param_uses.items():
        if name in folded:
            continue
        numel = problem.params[name].numel()
        layers = [plan.uses[u].layer for u, _ in uses]
        rules = {type(plan.rules[layer]) for layer in layers}
        dims = [
            plan.rules[plan.uses[u].layer].factor_dims(
                plan.layers[plan.uses[u].layer], plan.uses[u].in_shape, plan.uses[u].out_shape
            )
            for u, role in uses
            if role in plan.rules[plan.uses[u].layer].factored
        ]
        can_factor = len(rules) == 1 and dims and len(dims) == len(uses) and len({(d[0], *d[2:]) for d in dims}) == 1
        build = sum(2.0 * k * d[0] * d[1] * d[2] * d[3] for d in dims) if dims else 0.0
        if can_factor:
            g, _, da, dd = dims[0]
            t = sum(d[1] for d in dims)
            index = plan.rules[layers[0]].index_rows(plan.layers[layers[0]]) > 0
            factored_cost = 2.0 * g * t * t * (k * k * dd + (1 if index else da) + k * k)
            jacobian_cost = 2.0 * k * k * numel + 2 * build / NOMINAL_PARTNERS
            if form == "factored" or (form is None and factored_cost < jacobian_cost):
                bias = _foldable_bias(plan, name, uses_of) if not index else None
                if bias is not None:
                    folded.add(bias)
                factored.append(FactoredTerm(name, uses_of[name], bias, index, (g, t, da, dd)))
                continue
        jacobian.append(JacobianTerm(name, tuple(uses), numel, build))
    return StructuredTerms(plan, factored, [t for t in jacobian if t.name not in folded])


def _foldable_bias(plan: StructurePlan, weight: str, uses_of: dict[str, tuple[int, ...]]) -> str | None:
    """The bias used in exactly the calls that use ``weight`` (same layer), if it is rule-covered."""
    for name, uses in plan.param_uses.items():
        if name != weight and uses_of[name] == uses_of[weight] and uses and all(role == "bias" for _, role in uses):
            return name
    return None


BATCHED_CAPTURE_WEIGHT = 1.05
"""AUTO's relative cost of a structured FLOP with the batched (or closed-form) capture; NOTE [auto choice]."""

PER_EXAMPLE_CAPTURE_WEIGHT = 0.8
"""AUTO's relative cost of a structured FLOP when fallback parameters make the capture per example (vmap)."""

SYMMETRIC_SPLIT_MIN = 128
"""Smallest block for which a side paired with itself is contracted from 3 of its 4 half-blocks; below it the
smaller products lose what the skipped quarter saves (MLP 784-512-512-10: N = 64 even, N = 256 20% faster)."""

_TERMS: dict[tuple[int, str | None], tuple[weakref.ref[NtkProblem], StructuredTerms]] = {}
"""Structure plans by problem (the problem lives for one compute_ntk call; dead entries are dropped)."""

_TERMS_LOCK = threading.Lock()
"""Concurrent compute_ntk calls (the server's worker threads) share ``_TERMS``."""


def _example_input(problem: NtkProblem) -> torch.Tensor:
    """A stand-in example when no real one is at hand (AUTO's cost estimate): zeros, float or token ids."""
    return torch.zeros((1, *problem.input_shape), dtype=problem.dtype)


def structured_terms(
    problem: NtkProblem, example: torch.Tensor | None = None, form: str | None = None
) -> StructuredTerms:
    """The (cached) structure plan and term choice of ``problem``.

    Args:
        problem: the prepared model.
        example: (1, *input) one example; default: zeros of the input shape (float, else int64 token ids).
        form: None (per weight, the cheaper form), or "factored" / "jacobian" to force every weight with
            factors into that form. Internal testing knob.
    """
    with _TERMS_LOCK:
        entry = _TERMS.get((id(problem), form))
        if entry is not None and entry[0]() is problem:
            return entry[1]
        for key in [key for key, (ref, _) in _TERMS.items() if ref() is None]:
            del _TERMS[key]
    if example is None:
        example = _example_input(problem)
        try:
            plan = plan_structure(problem, example)
        except (RuntimeError, IndexError, TypeError):  # e.g. an Embedding given float zeros
            plan = plan_structure(problem, example.to(torch.int64))
    else:
        plan = plan_structure(problem, example)
    terms = _choose_terms(problem, plan, form)
    with _TERMS_LOCK:
        _TERMS[(id(problem), form)] = (weakref.ref(problem), terms)
    return terms


StructuredSide = dict[str, Any]
"""{"factored": [(a, d) per FactoredTerm], "jacobians": name -> (n, k, p)}."""


class Structured:
    """The NtkAlgorithm of structured derivatives (see the module docstring)."""

    implementation = NtkImplementation.STRUCTURED
    right_is_left = True

    def __init__(self, _form: str | None = None) -> None:
        """``_form``: internal testing knob, see ``structured_terms``."""
        self._form = _form

    def _terms(self, problem: NtkProblem, example: torch.Tensor | None = None) -> StructuredTerms:
        return structured_terms(problem, example, self._form)

    def left(self, problem: NtkProblem, x: torch.Tensor) -> StructuredSide:
        terms = self._terms(problem, x[:1])
        plan = terms.plan
        if terms.batch_safe is None and x.shape[0] >= 2:
            terms.batch_safe = is_batch_safe(problem, plan, x[:2])
        with attention_scope(problem.module):  # fallback jacrev under vmap: see math_attention.py
            cap = capture(problem, plan, x, batched=bool(terms.batch_safe))
        factored = []
        for term in terms.factored:
            parts = [
                plan.rules[plan.uses[u].layer].factors(plan.layers[plan.uses[u].layer], cap.inputs[u], cap.deltas[u])
                for u in term.uses
            ]
            a = parts[0].a if len(parts) == 1 else torch.cat([p.a for p in parts], dim=2)
            d = parts[0].d if len(parts) == 1 else torch.cat([p.d for p in parts], dim=3)
            factored.append((a, d))
        roles: dict[int, list[str]] = {}  # use -> the roles whose J it contributes to
        owner: dict[tuple[int, str], str] = {}
        for jterm in terms.jacobian:
            for u, role in jterm.uses:
                roles.setdefault(u, []).append(role)
                owner[u, role] = jterm.name
        jacobians: NamedTensors = {}
        for u, use_roles in roles.items():  # one rule call per use: a weight and its bias may share a pass
            layer = plan.uses[u].layer
            rule, module, state = plan.rules[layer], plan.layers[layer], plan.states[layer]
            for role, j in rule.jacobians(module, tuple(use_roles), cap.inputs[u], cap.deltas[u], state).items():
                name = owner[u, role]
                jacobians[name] = j if name not in jacobians else jacobians[name] + j
        for jterm in terms.jacobian:
            if jterm.name not in jacobians:  # a layer the batch never called: its parameters have zero Jacobian
                jacobians[jterm.name] = torch.zeros(x.shape[0], problem.k, jterm.numel, dtype=problem.dtype)
        jacobians.update(cap.fallback_jacobians)
        return {"factored": factored, "jacobians": jacobians}

    right = left

    def joint_sides(
        self, problem: NtkProblem, x1: torch.Tensor, x2: torch.Tensor
    ) -> tuple[StructuredSide, StructuredSide]:
        """The sides of x1 and of x2 from one pass over both (views); interleaved when that spares copies (NOTE
        [interleaved joint pass])."""
        n = x1.shape[0]
        if x2.shape[0] == n and _interleavable(self._terms(problem, x1[:1])):
            side = self.left(problem, torch.stack([x1, x2], dim=1).flatten(0, 1))  # x1[0], x2[0], x1[1], ...
            return _slice_side(side, 0, None, 2), _slice_side(side, 1, None, 2)
        side = self.left(problem, torch.cat([x1, x2]))
        return _slice_side(side, 0, n), _slice_side(side, n, None)

    def pair(self, problem: NtkProblem, left: StructuredSide, right: StructuredSide, mode: KernelMode) -> torch.Tensor:
        n = _side_examples(left)
        if left is right and mode is KernelMode.FULL and n >= SYMMETRIC_SPLIT_MIN:
            return finish(self._pair_symmetric(problem, left, n), mode)
        if mode is KernelMode.FULL:
            return self._accumulate(problem, left, right, mode, final=True)
        return finish(self._accumulate(problem, left, right, mode), mode)

    def _accumulate(
        self, problem: NtkProblem, left: StructuredSide, right: StructuredSide, mode: KernelMode, *, final: bool = False
    ) -> torch.Tensor:
        """The accumulator of a block (layouts in structured_contract.py); with ``final`` (FULL only) the block
        itself, (n, m, k, k) contiguous, its last factored term added in the pass that writes that layout."""
        terms = self._terms(problem)
        factored = list(zip(terms.factored, left["factored"], right["factored"], strict=True))
        last = None
        if final:
            last = next((i for i, (_, lf, rf) in enumerate(factored) if fusable(lf, rf)), None)
        held = None if last is None else factored.pop(last)
        n, m = _side_examples(left), _side_examples(right)
        example_major = prefers_example_major(_layout_tensors(left) + _layout_tensors(right))
        acc = new_accumulator(mode, n, m, problem.k, problem.dtype, example_major=example_major, zero=not factored)
        for i, (term, lf, rf) in enumerate(factored):
            add_factored(acc, lf, rf, mode, index=term.index, plus_one=term.bias is not None, fresh=i == 0)
        for name, j1 in left["jacobians"].items():
            add_jacobian(acc, j1, right["jacobians"][name], mode)
        if not final:
            return acc
        if held is None:
            return finish(acc, mode).contiguous()
        return finish_with_factored(acc, held[1], held[2], plus_one=held[0].bias is not None)

    def _pair_symmetric(self, problem: NtkProblem, side: StructuredSide, n: int) -> torch.Tensor:
        """FULL accumulator (k, n, k, n) of a side with itself from 3 of its 4 half-blocks: Θ(b, a) = Θ(a, b)ᵀ.

        Saves a quarter of the Gram and Jacobian products when x2 is x1 (the block runner then symmetrizes).
        """
        h = n // 2
        first, second = _slice_side(side, 0, h), _slice_side(side, h, n)
        example_major = prefers_example_major(_layout_tensors(side))
        acc = new_accumulator(KernelMode.FULL, n, n, problem.k, problem.dtype, example_major=example_major, zero=False)
        acc[:, :h, :, :h] = self._accumulate(problem, first, first, KernelMode.FULL)
        upper = self._accumulate(problem, first, second, KernelMode.FULL)  # (k, h, k, n - h)
        acc[:, :h, :, h:] = upper
        acc[:, h:, :, :h] = upper.permute(2, 3, 0, 1)
        acc[:, h:, :, h:] = self._accumulate(problem, second, second, KernelMode.FULL)
        return acc

    def diagonal(self, problem: NtkProblem, left: StructuredSide) -> torch.Tensor:
        terms = self._terms(problem)
        acc = new_accumulator(KernelMode.EXAMPLE_DIAGONAL, _side_examples(left), 0, problem.k, problem.dtype)
        for term, side in zip(terms.factored, left["factored"], strict=True):
            add_factored_diagonal(acc, side, index=term.index, plus_one=term.bias is not None)
        for j in left["jacobians"].values():
            add_jacobian_diagonal(acc, j)
        return acc

    def pair_groups(
        self,
        problem: NtkProblem,
        left: StructuredSide,
        right: StructuredSide,
        mode: KernelMode,
        groups: ParameterGroups,
    ) -> torch.Tensor:
        """One block per parameter group, (G, *block): each term into its group's accumulator (NOTE [group
        kernels] in groups.py); a group's first factored term is written, not added (``fresh``), as in ``pair``."""
        terms, of = self._terms(problem), groups.index
        n, m = _side_examples(left), _side_examples(right)
        example_major = prefers_example_major(_layout_tensors(left) + _layout_tensors(right))
        accs = [
            new_accumulator(mode, n, m, problem.k, problem.dtype, example_major=example_major, zero=False)
            for _ in groups.names
        ]
        written = [False] * len(accs)

        def add(
            g: int, lf: tuple[torch.Tensor, torch.Tensor], rf: tuple[torch.Tensor, torch.Tensor], **kw: Any
        ) -> None:
            add_factored(accs[g], lf, rf, mode, fresh=not written[g], **kw)
            written[g] = True

        for term, lf, rf in zip(terms.factored, left["factored"], right["factored"], strict=True):
            bias = None if term.bias is None else of[term.bias]  # its group
            bias_apart = bias is not None and bias != of[term.name]
            add(of[term.name], lf, rf, index=term.index, plus_one=bias is not None and not bias_apart)
            if bias is not None and bias_apart:  # the weight's part is G^D ⊙ G^A, the bias's G^D ⊙ 1: a zero A
                add(bias, _no_inputs(lf), _no_inputs(rf), index=False, plus_one=True)
        for g, acc in enumerate(accs):
            if not written[g]:
                acc.zero_()
        for name, j1 in left["jacobians"].items():
            add_jacobian(accs[of[name]], j1, right["jacobians"][name], mode)
        return torch.stack([finish(acc, mode) for acc in accs])

    def diagonal_groups(self, problem: NtkProblem, left: StructuredSide, groups: ParameterGroups) -> torch.Tensor:
        """EXAMPLE_DIAGONAL per parameter group, (G, n, k, k)."""
        terms, of = self._terms(problem), groups.index
        accs = [
            new_accumulator(KernelMode.EXAMPLE_DIAGONAL, _side_examples(left), 0, problem.k, problem.dtype)
            for _ in groups.names
        ]
        for term, side in zip(terms.factored, left["factored"], strict=True):
            bias = None if term.bias is None else of[term.bias]
            bias_apart = bias is not None and bias != of[term.name]
            plus_one = bias is not None and not bias_apart
            add_factored_diagonal(accs[of[term.name]], side, index=term.index, plus_one=plus_one)
            if bias is not None and bias_apart:
                add_factored_diagonal(accs[bias], _no_inputs(side), index=False, plus_one=True)
        for name, j in left["jacobians"].items():
            add_jacobian_diagonal(accs[of[name]], j)
        return torch.stack(accs)

    def side_bytes(self, problem: NtkProblem, n: int, *, left: bool) -> tuple[float, float]:
        terms = self._terms(problem)
        plan, k, item = terms.plan, problem.k, problem.itemsize
        kept = 0.0
        for term in terms.factored:
            g, t, da, dd = term.dims
            kept += n * g * t * ((1 if term.index else da) + k * dd)
        kept += sum(n * k * jt.numel for jt in terms.jacobian)
        fallback = sum(n * k * problem.params[name].numel() for name in plan.fallback)
        activations = sum(n * (math.prod(u.in_shape) + k * math.prod(u.out_shape)) for u in plan.uses)
        # the forward's saved tensors and k cotangents of them at once, every layer's input and δ, the fallback
        # Jacobian; then the factors (patches) and rule Jacobians are built from them. With fallback parameters
        # the per-example jacrev also differentiates w.r.t. them: the engine's whole-model count applies.
        saved = problem.saved_bytes if plan.fallback else plan.saved_bytes
        transient = n * saved * (1 + k) + (activations + fallback) * item
        return transient + 2 * kept * item, (kept + fallback) * item

    def pair_bytes(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        terms = self._terms(problem)
        k, item = problem.k, problem.itemsize
        if mode is KernelMode.EXAMPLE_DIAGONAL:
            m, result = 1, n * k * k
        else:
            result = n * m * {KernelMode.FULL: k * k, KernelMode.TRACE: 1, KernelMode.OUTPUT_DIAGONAL: k}[mode]
        largest = 0.0
        for term in terms.factored:
            g, t, _, _ = term.dims
            grams = g * n * t * m * t
            per_output = {KernelMode.FULL: k * k, KernelMode.TRACE: 1}.get(mode, k)
            largest = max(largest, grams * (1 + per_output))
        return (2 * result + largest) * item

    def cost_weight(self, problem: NtkProblem) -> float:
        """AUTO's cost of one estimated FLOP (NOTE [auto choice] in api.py): ``PER_EXAMPLE_CAPTURE_WEIGHT`` when
        fallback parameters make the capture per example under vmap, else ``BATCHED_CAPTURE_WEIGHT``."""
        return PER_EXAMPLE_CAPTURE_WEIGHT if self._terms(problem).fallback else BATCHED_CAPTURE_WEIGHT

    def flops(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        terms = self._terms(problem)
        k = problem.k
        p_fallback = sum(problem.params[name].numel() for name in terms.fallback)
        sides_n = n if mode is KernelMode.EXAMPLE_DIAGONAL else n + m
        fallback_share = p_fallback / max(problem.num_params, 1)
        sides = sides_n * problem.forward_flops * (1 + k + 2 * k * fallback_share)
        sides += sides_n * sum(jt.build_flops for jt in terms.jacobian)
        pairs, outputs = {
            KernelMode.FULL: (n * m, k * k),
            KernelMode.TRACE: (n * m, k),
            KernelMode.OUTPUT_DIAGONAL: (n * m, k),
            KernelMode.EXAMPLE_DIAGONAL: (n, k * k),
        }[mode]
        contraction = 0.0
        for term in terms.factored:
            g, t, da, dd = term.dims
            contraction += 2.0 * g * t * t * (outputs * dd + (1 if term.index else da) + outputs)
        p_jacobian = sum(jt.numel for jt in terms.jacobian) + p_fallback
        contraction += 2.0 * outputs * p_jacobian
        return sides + pairs * contraction


def _no_inputs(factors: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A factored term's (A, δ) with A one zero input column, (n, G, T, 1): its G^A is 0, + 1 the bias's."""
    a, d = factors
    return torch.zeros_like(a[..., :1]), d


def _slice_side(side: StructuredSide, start: int, stop: int | None, step: int = 1) -> StructuredSide:
    """Examples start:stop:step of a side (views)."""
    return {
        "factored": [(a[start:stop:step], d[start:stop:step]) for a, d in side["factored"]],
        "jacobians": {name: j[start:stop:step] for name, j in side["jacobians"].items()},
    }


def _interleavable(terms: StructuredTerms) -> bool:
    """Whether every term of a side is a plain factored one (G = T = 1), whose every-other-example slices the
    contraction reads in place, and δ comes from the autograd capture (NOTE [interleaved joint pass])."""
    plain = not terms.jacobian and not terms.fallback and all(t.dims[:2] == (1, 1) for t in terms.factored)
    return plain and terms.plan.chain is None


def _layout_tensors(side: StructuredSide) -> list[torch.Tensor]:
    """The δ's and Jacobians (n, k, ...) of a side, whose memory order decides the accumulator's (NOTE
    [accumulator memory] in structured_contract.py)."""
    return [d for _, d in side["factored"]] + list(side["jacobians"].values())


def _side_examples(side: StructuredSide) -> int:
    if side["factored"]:
        return int(side["factored"][0][1].shape[0])
    return int(next(iter(side["jacobians"].values())).shape[0])
