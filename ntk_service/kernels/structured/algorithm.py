"""Structured derivatives: the NTK from per-op structure, without building the Jacobian of covered weights.

For a linear op y = a Wᵀ + b, ∂f_c/∂W = δ_c aᵀ with δ_c = ∂f_c/∂y, so the op adds
Θ_cd(x1, x2) += (δ1_c · δ2_d)(a1 · a2 + 1) (the +1 is the bias); with positions t, s sharing the weight
(sequences, convolutions, repeated calls) Σ_{t,s} (δ1_c[t] · δ2_d[s])(a1[t] · a2[s]). The rules
(``rules.py``) are keyed to operators, read alike in a module's forward and an exported program's graph:
linear/matmul/addmm (any leading dims), conv1d/conv2d, embedding, the affine parameters of layer_norm, rms_norm,
group_norm and eval batch_norm, elementwise scales and biases; a parameter taken by any other op takes the
Jacobian path (per-example ``jacrev`` w.r.t. those parameters only, in the same reverse pass), and the parts add up.
See NOTE [covered parameters] in ``coverage.py`` and NOTE [probes] in ``capture.py``; a pure pipeline of linear
ops and activations is captured in closed form instead (NOTE [sequential chains] in ``chain.py``).

A side of n examples holds, per factored weight, the factors A (n, G, T, da) and D (n, k, G, T, dd), and per
other parameter its Jacobian (n, k, p), built directly from a and δ by the rule (J_W = Σ_t δ[t] ⊗ a[t] in one
matmul) or by ``jacrev`` for the fallback. NOTE [factored or Jacobian]: per weight the cheaper of the two
contractions is taken from its shapes: factored costs 2·G·T·S·(k²·dd + da + k²) per example pair, Jacobian
2·k²·p per pair plus building J (2·k·G·T·dd·da per example, counted over ``NOMINAL_PARTNERS`` partners). An MLP
layer (T = 1) is factored; a convolution over many positions usually takes the Jacobian form.

NOTE [joint pass]: when one pass builds both sides (``joint_sides``), x1 and x2 are concatenated and each side is
a slice of that pass's side: a contiguous block of examples.

Time (N+M)·[FP]·(1 + k) for the sides (one forward, one vmapped reverse pass w.r.t. op outputs), plus
N·M·k²·Σ_l(dd_l·T_l·S_l + ...) for factored layers and N·M·k²·p for the others (÷k for TRACE and
OUTPUT_DIAGONAL); for an MLP N·M·k²·Σ_l(out_l) + N·M·Σ_l(in_l) instead of N·M·k²·P. Memory per side
n·k·Σ_l(T_l·out_l) + n·Σ_l(T_l·in_l) for factored layers, n·k·p for the rest; per block pair the δ Gram
(n·k·T)·(m·k·S). Fastest where rules cover the parameters (MLPs, CNNs, transformers' Linear layers).
"""

from __future__ import annotations

import math

import torch

from ntk_service.kernels.algorithm import GroupKernels, JointPass
from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.modes import KernelMode, Outputs
from ntk_service.kernels.problem.batch import Batch, batch_size, concat, take
from ntk_service.kernels.problem.math_attention import attention_scope
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.structured.capture import capture
from ntk_service.kernels.structured.contraction import (
    Accumulator,
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
from ntk_service.kernels.structured.coverage import analyze
from ntk_service.kernels.structured.descriptors import (
    Capture,
    Delta,
    FactorSide,
    JacobianSide,
    Layout,
    StructuredSide,
)
from ntk_service.kernels.structured.options import StructuredOptions
from ntk_service.kernels.structured.plan import StructuredTerms
from ntk_service.kernels.structured.recorder import batch_axes, distinct_pair
from ntk_service.kernels.structured.rules import ParamMap
from ntk_service.kernels.types import NtkImplementation

__all__ = ["BATCHED_CAPTURE_WEIGHT", "PER_EXAMPLE_CAPTURE_WEIGHT", "Structured", "structured_terms"]

BATCHED_CAPTURE_WEIGHT = 1.05
"""AUTO's relative cost of a structured FLOP with the batched (or closed-form) capture; NOTE [auto choice]."""

PER_EXAMPLE_CAPTURE_WEIGHT = 1.0
"""AUTO's relative cost of a structured FLOP when fallback parameters make the capture per example (vmap)."""


def structured_terms(
    problem: NtkProblem, example: Batch | None = None, options: StructuredOptions | None = None
) -> StructuredTerms:
    """The plan of ``problem`` under ``options`` (made once by ``analysis.analyze``, then kept on the problem).

    Args:
        problem: the prepared model.
        example: (1, *input) one example for the analysis; default: zeros of the input shape.
        options: the engine's options. Default: ``StructuredOptions()``.
    """
    return Structured(options).terms(problem, example)


class Structured:
    """The NtkAlgorithm of structured derivatives (see the module docstring); it has both optional capabilities.

    Args:
        options: the engine's fast paths and testing knobs, as data (``StructuredOptions``). Default: all on.
    """

    implementation = NtkImplementation.STRUCTURED
    right_is_left = True

    def __init__(self, options: StructuredOptions | None = None) -> None:
        self.options = StructuredOptions() if options is None else options

    @property
    def joint_pass(self) -> JointPass:
        return self

    @property
    def group_kernels(self) -> GroupKernels:
        return self

    def terms(self, problem: NtkProblem, example: Batch | None = None) -> StructuredTerms:
        """The plan kept on ``problem`` for these options; analysed on first use (``analysis.analyze``)."""
        kept = problem.analyses.get(self._key)
        if not isinstance(kept, StructuredTerms):
            kept = problem.analyses[self._key] = analyze(problem, self.options, example)
        return kept

    @property
    def _key(self) -> tuple[str, StructuredOptions]:
        return ("structured", self.options)

    def learn(self, problem: NtkProblem, x: Batch) -> StructuredTerms:
        """The plan kept on ``problem``, with what a block x (n, *input) shows about it (whether, and where, a batched
        forward keeps the examples apart: ``recorder.batch_axes`` on two different examples of x), kept in turn."""
        terms = self.terms(problem, take(x, 0, 1))
        if terms.batch_safe is None and batch_size(x) >= 2 and self.options.batched_capture:
            pair = distinct_pair(x)
            if pair is not None:
                axes = batch_axes(problem, terms.plan, pair)
                terms = problem.analyses[self._key] = terms.learned(batch_safe=axes is not None, axes=axes)
        return terms

    def left(self, problem: NtkProblem, x: Batch) -> StructuredSide:
        terms = self.learn(problem, x)
        with attention_scope(
            problem.module, problem.calls_attention
        ):  # fallback jacrev under vmap: see problem/math_attention.py
            cap, terms = capture(problem, terms, self.options, x)
        problem.analyses[self._key] = terms  # the same plan, or the new one the block taught
        return _side(problem, terms, cap, self.options, batch_size(x))

    right = left

    def joint_sides(self, problem: NtkProblem, x1: Batch, x2: Batch) -> tuple[StructuredSide, StructuredSide]:
        """The sides of x1 and of x2 from one pass over both (views; NOTE [joint pass])."""
        n = batch_size(x1)
        side = self.left(problem, concat(x1, x2))
        return side.sliced(0, n), side.sliced(n, None)

    def joint_pays(self, problem: NtkProblem, n: int, m: int) -> bool:
        """Always, where it fits the budget (NOTE [joint pass])."""
        return True

    def pair(self, problem: NtkProblem, left: StructuredSide, right: StructuredSide, mode: KernelMode) -> torch.Tensor:
        if mode.spec.outputs is Outputs.ALL:  # the outputs pick the contraction (NOTE [mode contractions])
            return self._full_block(problem, left, right, mode)
        return finish(self._accumulate(problem, left, right, mode))

    def _new_accumulator(
        self, problem: NtkProblem, mode: KernelMode, left: StructuredSide, right: StructuredSide
    ) -> Accumulator:
        """The one place a block's accumulator is made, zero: its memory follows the sides' layouts (NOTE
        [accumulator memory] in contraction.py)."""
        layouts = left.layouts() + right.layouts()
        example_major = self.options.example_major_accumulator and prefers_example_major(layouts)
        n, m = left.examples, right.examples
        return new_accumulator(mode, n, m, problem.k, problem.dtype, example_major=example_major)

    def _accumulate(
        self,
        problem: NtkProblem,
        left: StructuredSide,
        right: StructuredSide,
        mode: KernelMode,
        *,
        held: int | None = None,
    ) -> Accumulator:
        """The accumulator of a block: every term of the sides added into it, in one loop over the terms (the
        factored term number ``held`` left out, for ``finish_with_factored``)."""
        terms = self.terms(problem)
        factored = [
            (term, lf, rf)
            for i, (term, lf, rf) in enumerate(zip(terms.factored, left.factored, right.factored, strict=True))
            if i != held
        ]
        acc = self._new_accumulator(problem, mode, left, right)
        for term, lf, rf in factored:
            add_factored(acc, lf, rf, index=term.index, plus=term.plus, shared_delta=self.options.shared_delta)
        for name, j1 in left.jacobians.items():
            add_jacobian(acc, j1, right.jacobians[name])
        return acc

    def _full_block(
        self, problem: NtkProblem, left: StructuredSide, right: StructuredSide, mode: KernelMode
    ) -> torch.Tensor:
        """The block of all outputs (n, m, k, k) of ``mode``, contiguous; its last plain factored term added in the
        pass that writes that layout (``fused_finish``)."""
        terms = self.terms(problem)
        held = None
        if self.options.fused_finish:
            pairs = zip(left.factored, right.factored, strict=True)
            held = next((i for i, (lf, rf) in enumerate(pairs) if fusable(lf, rf)), None)
        acc = self._accumulate(problem, left, right, mode, held=held)
        if held is None:
            return finish(acc).contiguous()
        return finish_with_factored(
            acc,
            left.factored[held],
            right.factored[held],
            plus=terms.factored[held].plus,
            shared_delta=self.options.shared_delta,
        )

    def diagonal(self, problem: NtkProblem, left: StructuredSide) -> torch.Tensor:
        terms = self.terms(problem)
        acc = self._new_accumulator(problem, KernelMode.EXAMPLE_DIAGONAL, left, left)
        for term, side in zip(terms.factored, left.factored, strict=True):
            add_factored_diagonal(acc, side, index=term.index, plus=term.plus)
        for j in left.jacobians.values():
            add_jacobian_diagonal(acc, j)
        return acc.tensor

    def pair_groups(
        self,
        problem: NtkProblem,
        left: StructuredSide,
        right: StructuredSide,
        mode: KernelMode,
        groups: ParameterGroups,
    ) -> torch.Tensor:
        """One block per parameter group, (G, *block): each term into its group's accumulator (NOTE [group
        kernels] in groups.py); in FULL each group's last plain factored term rides along in the pass that writes
        its block (``fused_finish``, as ``pair`` does), so G groups cost G result-sized writes, not 2·G."""
        terms, of, shared = self.terms(problem), groups.index, self.options.shared_delta
        factored: list[list[tuple[FactorSide, FactorSide, bool, float]]] = [[] for _ in groups.names]
        for term, lf, rf in zip(terms.factored, left.factored, right.factored, strict=True):
            bias = None if term.bias is None else of[term.bias]  # the folded bias's group
            bias_apart = bias is not None and bias != of[term.name]
            factored[of[term.name]].append((lf, rf, term.index, 0.0 if bias_apart else term.plus))
            if bias is not None and bias_apart:  # the weight's part is G^D ⊙ G^A, the bias's G^D ⊙ c²: a zero A
                factored[bias].append((_no_inputs(lf), _no_inputs(rf), False, term.plus))
        jacobians: list[list[tuple[JacobianSide, JacobianSide]]] = [[] for _ in groups.names]
        for name, j1 in left.jacobians.items():
            jacobians[of[name]].append((j1, right.jacobians[name]))
        every_output = mode.spec.outputs is Outputs.ALL  # the outputs pick the contraction (NOTE [mode contractions])
        fuse = every_output and self.options.fused_finish
        out = None  # all outputs: the (G, n, m, k, k) result, each group's block written into it once
        if every_output:
            out = torch.empty(
                len(groups.names), left.examples, right.examples, problem.k, problem.k, dtype=problem.dtype
            )
        blocks = []
        for g, (parts, js) in enumerate(zip(factored, jacobians, strict=True)):
            held = next((p for p in reversed(parts) if fusable(p[0], p[1])), None) if fuse else None
            rest = [p for p in parts if p is not held]
            acc = None
            if rest or js or held is None:
                acc = self._new_accumulator(problem, mode, left, right)
                for lf, rf, index, plus in rest:
                    add_factored(acc, lf, rf, index=index, plus=plus, shared_delta=shared)
                for j1, j2 in js:
                    add_jacobian(acc, j1, j2)
            if held is not None and out is not None:
                finish_with_factored(acc, held[0], held[1], plus=held[3], shared_delta=shared, out=out[g])
            elif acc is not None and out is not None:
                out[g] = finish(acc)
            elif acc is not None:
                blocks.append(finish(acc))
        return torch.stack(blocks) if out is None else out

    def diagonal_groups(self, problem: NtkProblem, left: StructuredSide, groups: ParameterGroups) -> torch.Tensor:
        """EXAMPLE_DIAGONAL per parameter group, (G, n, k, k)."""
        terms, of = self.terms(problem), groups.index
        accs = [self._new_accumulator(problem, KernelMode.EXAMPLE_DIAGONAL, left, left) for _ in groups.names]
        for term, side in zip(terms.factored, left.factored, strict=True):
            bias = None if term.bias is None else of[term.bias]
            bias_apart = bias is not None and bias != of[term.name]
            add_factored_diagonal(accs[of[term.name]], side, index=term.index, plus=0.0 if bias_apart else term.plus)
            if bias is not None and bias_apart:
                add_factored_diagonal(accs[bias], _no_inputs(side), index=False, plus=term.plus)
        for name, j in left.jacobians.items():
            add_jacobian_diagonal(accs[of[name]], j)
        return torch.stack([acc.tensor for acc in accs])

    def side_bytes(self, problem: NtkProblem, n: int, *, left: bool) -> tuple[float, float]:
        terms = self.terms(problem)
        plan, k, item = terms.plan, problem.k, problem.itemsize
        kept = 0.0
        for term in terms.factored:
            g, t, da, dd = term.dims
            kept += n * g * t * ((1 if term.index else da) + k * dd)
        kept += sum(n * k * jt.numel for jt in terms.jacobian)
        fallback = sum(n * k * problem.params[name].numel() for name in plan.fallback)
        activations = sum(n * (math.prod(u.in_shape) + k * math.prod(u.out_shape)) for u in plan.sites)
        # the forward's saved tensors and k cotangents of them at once, every layer's input and δ, the fallback
        # Jacobian; then the factors (patches) and rule Jacobians are built from them. With fallback parameters
        # the per-example jacrev also differentiates w.r.t. them: the engine's whole-model count applies.
        saved = problem.saved_bytes if plan.fallback else plan.saved_bytes
        transient = n * saved * (1 + k) + (activations + fallback) * item
        return transient + 2 * kept * item, (kept + fallback) * item

    def pair_bytes(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        terms = self.terms(problem)
        k, item, spec = problem.k, problem.itemsize, mode.spec
        if not spec.pairs:  # the per-example blocks of all outputs
            m, result = 1, n * k * k
        else:
            result = n * m * spec.outputs.entries(k)
        # the δ Gram's entries per example pair: as the result's for example pairs; k² for the per-example blocks
        # (``add_factored_diagonal``'s (n·g, k·t, k·t) Gram)
        per_output = spec.outputs.entries(k) if spec.pairs else k * k
        largest = 0.0
        for term in terms.factored:
            g, t, _, _ = term.dims
            grams = g * n * t * m * t
            largest = max(largest, grams * (1 + per_output))
        return (2 * result + largest) * item

    def cost_weight(self, problem: NtkProblem) -> float:
        """AUTO's cost of one estimated FLOP (NOTE [auto choice] in api.py): ``PER_EXAMPLE_CAPTURE_WEIGHT`` when
        fallback parameters make the capture per example under vmap, else ``BATCHED_CAPTURE_WEIGHT``."""
        return PER_EXAMPLE_CAPTURE_WEIGHT if self.terms(problem).fallback else BATCHED_CAPTURE_WEIGHT

    def flops(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        terms = self.terms(problem)
        k = problem.k
        p_fallback = sum(problem.params[name].numel() for name in terms.fallback)
        spec = mode.spec
        sides_n = n + m if spec.pairs else n
        fallback_share = p_fallback / max(problem.num_params, 1)
        sides = sides_n * problem.forward_flops * (1 + k + 2 * k * fallback_share)
        sides += sides_n * sum(jt.build_flops for jt in terms.jacobian)
        pairs = n * m if spec.pairs else n  # the per-example blocks take all outputs
        outputs = spec.outputs.products(k) if spec.pairs else Outputs.ALL.products(k)
        contraction = 0.0
        for term in terms.factored:
            g, t, da, dd = term.dims
            contraction += 2.0 * g * t * t * (outputs * dd + (1 if term.index else da) + outputs)
        p_jacobian = sum(jt.numel for jt in terms.jacobian) + p_fallback
        contraction += 2.0 * outputs * p_jacobian
        return sides + pairs * contraction


def _side(
    problem: NtkProblem, terms: StructuredTerms, cap: Capture, options: StructuredOptions, n: int
) -> StructuredSide:
    """The side of a block from its capture: per factored term its factors, per other parameter its Jacobian."""
    plan = terms.plan
    factored = []
    for term in terms.factored:
        parts = []
        for u, scale in zip(term.uses, term.scales, strict=True):
            site, delta = plan.sites[u], cap.deltas[u]
            f = site.rule.factors(site.config, cap.inputs[u], delta.tensor)
            kept = site.rule.keeps_delta(site.config)  # D a view of δ: its declared facts hold for D
            d = Delta(f.d, delta.layout, delta.shared) if kept else Delta(f.d, Layout.of(f.d))
            a = f.a
            if scale != 1.0:  # J of c·W is c·J: on A (the smaller factor), on D for ids
                if f.index:
                    d = Delta(f.d * scale, Layout.of(f.d), d.shared)
                else:
                    a = f.a * scale
            parts.append((a, d))
        if len(parts) == 1:
            factored.append(FactorSide(*parts[0]))
            continue
        dd = torch.cat([p[1].tensor for p in parts], dim=3)
        factored.append(FactorSide(torch.cat([p[0] for p in parts], dim=2), Delta(dd, Layout.of(dd))))
    roles: dict[int, list[str]] = {}  # site -> the roles whose J it contributes to
    for jterm in terms.jacobian:
        for u, role in jterm.uses:
            roles.setdefault(u, []).append(role)
    jacobians: dict[str, torch.Tensor] = {}
    for u, site_roles in roles.items():  # one rule call per site: a weight and its bias may share a pass
        site = plan.sites[u]
        a, delta = cap.inputs[u], cap.deltas[u]
        js = site.rule.jacobians(
            site.config,
            tuple(site_roles),
            a,
            delta.tensor,
            site.state,
            layout=delta.layout,
            thin=options.thin_conv_jacobian,
        )
        for role, j in js.items():
            mp = site.param(role)
            j = _onto_parameter(j, mp)
            jacobians[mp.name] = j if mp.name not in jacobians else jacobians[mp.name] + j
    for jterm in terms.jacobian:
        if jterm.name not in jacobians:  # a parameter no op of the batch read: its Jacobian is zero
            jacobians[jterm.name] = torch.zeros(n, problem.k, jterm.numel, dtype=problem.dtype)
    jacobians.update(cap.fallback_jacobians)
    # the layout of a Jacobian made by a rule's matmul or by jacrev: read once, here, where its descriptor is made
    return StructuredSide(tuple(factored), {name: JacobianSide(j, Layout.of(j)) for name, j in jacobians.items()})


def _onto_parameter(j: torch.Tensor, mp: ParamMap) -> torch.Tensor:
    """J (n, k, numel of the op's tensor) of the tensor an op took as J (n, k, numel) of the parameter it follows
    from: times the map's scale, its elements added where the view took them from (``ParamMap.index``)."""
    if mp.index is not None:
        n, k = j.shape[:2]
        onto = torch.zeros(n, k, mp.numel, dtype=j.dtype)
        onto.index_add_(2, mp.index.reshape(-1), j.reshape(n, k, -1))
        j = onto
    return j * mp.scale if mp.scale != 1.0 else j


def _no_inputs(side: FactorSide) -> FactorSide:
    """A factored term's factors with A one zero input column, (n, G, T, 1): its G^A is 0, + 1 the bias's."""
    return FactorSide(torch.zeros_like(side.a[..., :1]), side.d)
