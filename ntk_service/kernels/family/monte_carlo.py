"""``monte_carlo_ntk``: the NTK (or NNGP) averaged over random initializations, with its per-entry standard error.

``build(seed) -> nn.Module`` makes one network per seed; the mean over seeds estimates the kernel in expectation
over initializations (neural-tangents' ``monte_carlo_kernel_fn``, which reports no spread), the bridge to the
infinite-width kernels (see docs/kernel_family.md for a one-hidden-layer ReLU net against its arc-cosine kernel).

NOTE [batched ensemble]: a chunk of c models is evaluated as one computation, as in the torch.func ensembling
notes: ``stack_module_state`` stacks their parameters (c, *shape), a copy of the first model is the skeleton
``functional_call`` runs, and ``vmap`` over the stacked parameters gives every model's per-example
Jacobians (``vmap(jacrev)`` inside) or features at once. Each model's kernel is then contracted on its own (one
matmul per parameter tensor, ``jacobian_contraction.contract``), and the kernels are accumulated one by one in
seed order, so the result does not depend on the chunk size beyond the last bits (NOTE [chunking and bits]). The
skeleton stays on the models' device, not on ``meta`` as in the notes: ``.to("meta")`` unties tied parameters
(each module gets its own meta tensor, which ``stack_module_state``, listing a tied tensor once, never replaces),
and a CPU op on a meta tensor returns uninitialized memory instead of failing, so a tied model (or a tensor
attribute that is not a parameter or buffer) gave garbage or NaN; a real copy keeps the ties, which
``functional_call`` (``tie_weights``) then feeds from the one stacked tensor. ``functional_call`` swaps only
parameters and buffers, so a model with plain tensor attributes (a fixed random projection kept as
``self.proj = torch.randn(...)``) would get the skeleton's for every seed: such models take the per-model path.
The chunk size c is the most models whose Jacobians fit the memory budget; when not even one model does (or
the model has plain tensor attributes), each model's kernel is computed by ``compute_ntk`` / ``compute_nngp``
(which block over examples): ``MonteCarloResult.models_per_chunk`` is 0 then.

NOTE [chunking and bits]: the accumulation is in seed order whatever the chunk size, but a model's kernel is not
always bitwise the same in a chunk of 1 and of 5: vmap batches an elementwise op or a convolution over the models,
and torch's CPU kernels take another vectorized path (SIMD body or scalar tail, another convolution algorithm) for
another size. Measured on the test zoo (7 seeds, chunks 1/2/3/7): bitwise for Linear, Tanh/ReLU, LayerNorm,
Embedding and tied models in both dtypes; GELU in float64 within 3e-17 relative (its erf), convolutions in
float32 within 2e-7 relative (a few ulps); the tests bound every case at 8 ulps of the largest entry. A fixed
chunk size (``models_per_chunk``) and thread count reproduce a run bitwise.

Mean and spread: mean = Σ_s K_s / S (the plain average); the standard error of the mean is
sqrt(Σ_s (D_s − D̄)² / (S (S − 1))) with D_s = K_s − K_1 (shifted sums: no cancellation when the spread is small
against the mean). None for a single seed.

Cost: S times one kernel ((N+M)·k·[FP] for the Jacobians, N·M·k²·P for a FULL contraction); memory per chunk
c·(N+M)·k·P floats of Jacobians plus c copies of the parameters, and three accumulators of the result's size.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import nn
from torch.func import functional_call, jacrev, stack_module_state, vmap

from ntk_service.errors import InvalidInput, UnsupportedModel
from ntk_service.kernels.blocks import reduce_outputs
from ntk_service.kernels.core import Call, on_model_device, run, run_kernel
from ntk_service.kernels.derived import map_of, outputs_of
from ntk_service.kernels.family.nngp import (
    example_counts,
    feature_kernel,
    features,
    find_layer,
    kernel_shape,
    run_nngp,
)
from ntk_service.kernels.jacobian_contraction import contract, contract_diagonal
from ntk_service.kernels.modes import DerivedMode, KernelMode, contraction, result_shape
from ntk_service.kernels.options import NtkOptions, Shorthands, resolve_options
from ntk_service.kernels.problem.batch import Batch, Inputs, batch_size, call_module, take, unsqueeze
from ntk_service.kernels.problem.outputs import select_output
from ntk_service.kernels.problem.private_module import check_model
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime.problem_pool import prepared_problem
from ntk_service.kernels.spec import KernelSpec, SpecKeywords, refuse_fields, resolve_spec
from ntk_service.kernels.types import NamedTensors, NtkResult

__all__ = ["MAX_MONTE_CARLO_SEEDS", "KernelKind", "MonteCarloResult", "monte_carlo_ntk", "run_monte_carlo"]

MAX_MONTE_CARLO_SEEDS = 1024
"""Most seeds one call takes: the standard error falls as 1/√S, so past ~1000 samples a wider net or a batch of
calls is the better use of the time, and a typo (``range(10**6)``) is refused instead of running for hours."""


class KernelKind(StrEnum):
    """Which kernel ``monte_carlo_ntk`` averages."""

    NTK = "ntk"
    """Θ = J Jᵀ (``compute_ntk``)."""
    NNGP = "nngp"
    """f fᵀ of the outputs, or of a layer's features (``compute_nngp``)."""


@dataclass(frozen=True)
class MonteCarloResult:
    """What ``monte_carlo_ntk`` returns.

    Attributes:
        mean: the average kernel over the seeds, shaped as the mode's kernel (e.g. (N, M, k, k) for FULL).
        stderr: the per-entry standard error of ``mean``, same shape; None for one seed.
        n_samples: S, the number of seeds.
        kernel: NTK or NNGP.
        mode: the mode computed.
        models_per_chunk: models evaluated per batched call (NOTE [batched ensemble]); 0 when each model's
            kernel was computed on its own by ``compute_ntk`` / ``compute_nngp`` (one model did not fit).
        estimate_bytes: the planned peak memory of one chunk plus the accumulators.
    """

    mean: torch.Tensor
    stderr: torch.Tensor | None
    n_samples: int
    kernel: KernelKind
    mode: KernelMode | DerivedMode
    models_per_chunk: int
    estimate_bytes: int


_OPERATION = "monte_carlo_ntk"


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    if isinstance(seeds, str | bytes | Mapping) or not isinstance(seeds, Iterable):
        raise InvalidInput(f"{_OPERATION}: seeds must be a list of integers, got {type(seeds).__name__}")
    out = list(seeds)
    if not out:
        raise InvalidInput(f"{_OPERATION}: seeds is empty; pass at least one seed (two or more for a standard error)")
    if len(out) > MAX_MONTE_CARLO_SEEDS:
        raise InvalidInput(
            f"{_OPERATION}: {len(out)} seeds is over the limit of {MAX_MONTE_CARLO_SEEDS}; split them over several "
            "calls and average the means"
        )
    for i, s in enumerate(out):
        try:
            if isinstance(s, bool):
                raise TypeError
            out[i] = operator.index(s)  # numpy integers too
        except TypeError:
            raise InvalidInput(f"{_OPERATION}: seeds must be integers, got {s!r}") from None
    if len(set(out)) != len(out):
        repeated = next(s for s in out if out.count(s) > 1)
        raise InvalidInput(
            f"{_OPERATION}: seed {repeated} is repeated; repeated seeds give the same network twice and understate "
            "the standard error"
        )
    return out


def _positive_int(value: object) -> bool:
    """An integer >= 1 (numpy integers too), not a bool, float or string (``operator.index`` raised TypeError)."""
    if isinstance(value, bool):
        return False
    try:
        return operator.index(value) >= 1  # type: ignore[arg-type]
    except TypeError:
        return False


def _plain_tensors(model: nn.Module) -> list[str]:
    """Tensor attributes that are neither parameters nor buffers (``self.proj = torch.randn(...)``): a batched
    ensemble only swaps parameters and buffers, so the skeleton's own would stand in for every seed's."""
    return [
        f"{name}.{attr}" if name else attr
        for name, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, torch.Tensor)
    ]


def _signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(n, tuple(t.shape), t.dtype) for n, t in (*model.named_parameters(), *model.named_buffers())]


def _built(
    build: Callable[[int], nn.Module], seed: int, expected: list[tuple[str, tuple[int, ...], torch.dtype]] | None
) -> nn.Module:
    model = build(seed)
    check_model(model)
    if expected is not None and _signature(model) != expected:
        raise UnsupportedModel(
            f"{_OPERATION}: build({seed}) returned a model whose parameters or buffers differ in names, shapes or "
            "dtypes from build of the first seed; every seed must build the same architecture"
        )
    return model


class _Ensemble:
    """A chunk of models as one batched function (NOTE [batched ensemble])."""

    def __init__(self, skeleton: nn.Module, models: list[nn.Module], problem: NtkProblem) -> None:
        self.output = problem.output
        params, buffers = stack_module_state(models)
        cast = {n: t.detach().to(problem.dtype) if t.is_floating_point() else t.detach() for n, t in params.items()}
        self.selected = {n: cast[n] for n in problem.params}
        self.rest = {n: t for n, t in cast.items() if n not in problem.params}
        self.buffers = {n: t.to(problem.dtype) if t.is_floating_point() else t for n, t in buffers.items()}
        self.skeleton = skeleton
        self.size = len(models)

    def _call(self, selected: NamedTensors, rest: NamedTensors, buffers: NamedTensors, x: Batch) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and self.output is None:
            out: torch.Tensor = functional_call(self.skeleton, ({**selected, **rest}, buffers), (x,))
            return out
        return select_output(call_module(self.skeleton, ({**selected, **rest}, buffers), x), self.output, _OPERATION)

    def jacobians(self, x: Batch, k: int) -> NamedTensors:
        """name -> (c, n, k, p): every model's per-example Jacobians."""

        def single(selected: NamedTensors, rest: NamedTensors, buffers: NamedTensors, xi: Batch) -> torch.Tensor:
            return self._call(selected, rest, buffers, unsqueeze(xi)).reshape(-1)

        per_model = vmap(jacrev(single), (None, None, None, 0))
        jac = vmap(per_model, (0, 0, 0, None))(self.selected, self.rest, self.buffers, x)
        return {n: j.reshape(self.size, batch_size(x), k, -1) for n, j in jac.items()}

    def features(self, x: Batch, layer: str | None) -> torch.Tensor:
        """(c, n, d): every model's outputs, or its features at ``layer``."""
        captured: list[torch.Tensor] = []

        def one(selected: NamedTensors, rest: NamedTensors, buffers: NamedTensors) -> torch.Tensor:
            captured.clear()
            out = self._call(selected, rest, buffers, x)
            return (out if layer is None else captured[0]).reshape(batch_size(x), -1)

        handle = None
        if layer is not None:
            target = find_layer(self.skeleton, layer, operation=_OPERATION)
            handle = target.register_forward_hook(lambda _m, _a, out: captured.append(out))
        try:
            with torch.no_grad():
                return vmap(one)(self.selected, self.rest, self.buffers)
        finally:
            if handle is not None:
                handle.remove()


def _ntk_of(j1: NamedTensors, j2: NamedTensors | None, mode: KernelMode | DerivedMode, k: int) -> torch.Tensor:
    """One model's kernel from its Jacobians name -> (n, k, p) (j2 None: x2 = x1): a contracted mode by its
    contraction (NOTE [mode contractions] in modes.py), a derived mode as its base mode of the mapped Jacobians
    (J_g = W J, ``derived.OUTPUT_MAPS``)."""
    if isinstance(mode, DerivedMode):
        output_map = map_of(mode)
        g1 = {name: output_map.apply(j) for name, j in j1.items()}
        g2 = None if j2 is None else {name: output_map.apply(j) for name, j in j2.items()}
        return _ntk_of(g1, g2, contraction(mode), output_map.size(k))
    if not mode.spec.pairs:
        return reduce_outputs(contract_diagonal(j1), mode.spec.outputs)
    return _symmetrized(contract(j1, j1 if j2 is None else j2, mode), mode, j2 is None)


def _symmetrized(theta: torch.Tensor, mode: KernelMode, symmetric: bool) -> torch.Tensor:
    """(Θ + Θ(x2, x1))/2 when x2 = x1: exactly symmetric (IEEE addition commutes), as ``compute_ntk``'s."""
    return (theta + theta.permute(*mode.spec.example_swap)) / 2 if symmetric else theta


class _Accumulator:
    """Σ K_s, and the shifted sums Σ D_s, Σ D_s² with D_s = K_s − K_1, added in seed order."""

    def __init__(self) -> None:
        self.count = 0
        self.total: torch.Tensor | None = None
        self.shift = self.shifted = self.squares = torch.empty(0)

    def add(self, kernel: torch.Tensor) -> None:
        if self.total is None:
            self.total = kernel.clone()
            self.shift = kernel.clone()
            self.shifted = torch.zeros_like(kernel)
            self.squares = torch.zeros_like(kernel)
        else:
            self.total += kernel
            d = kernel - self.shift
            self.shifted += d
            self.squares.addcmul_(d, d)
        self.count += 1

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.total is not None
        s = self.count
        mean = self.total / s
        if s < 2:
            return mean, None
        variance = ((self.squares - self.shifted * self.shifted / s) / (s - 1)).clamp_min_(0)
        return mean, (variance / s).sqrt_()


def monte_carlo_ntk(
    build: Callable[[int], nn.Module],
    x1: Inputs,
    x2: Inputs | None = None,
    *,
    seeds: Sequence[int],
    kernel: KernelKind | str = KernelKind.NTK,
    models_per_chunk: int | None = None,
    spec: KernelSpec | None = None,
    options: NtkOptions | None = None,
    output: str | None = None,
    mode: KernelMode | DerivedMode | str | None = None,
    params: Sequence[str] | None = None,
    layer: str | None = None,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
) -> MonteCarloResult:
    """The kernel averaged over the networks ``build(seed)`` for every seed, with its per-entry standard error.

    Args:
        build (callable): ``build(seed) -> nn.Module``; every seed must give the same architecture (parameter and
            buffer names, shapes, dtypes). Called once per seed, a chunk at a time (never all models at once).
        x1 (Tensor, tuple or mapping): (N, *input), or forward's positional / keyword inputs, as ``compute_ntk``.
        x2 (same kind as x1, optional): (M, *input). Default: None, meaning x2 = x1 (exactly symmetric result).
        seeds (list of int): distinct seeds, 1 to ``MAX_MONTE_CARLO_SEEDS``.
        kernel (str): "ntk" or "nngp" (``compute_nngp``'s kernel). Default: "ntk".
        models_per_chunk (int, optional): at most this many models per batched call (the result is the same
            for every value to a few ulps: NOTE [chunking and bits]). Default: None (as many as fit the budget).
        spec (KernelSpec, optional): what each model's kernel is: ``mode``, ``output``, ``params`` (kernel="ntk")
            or ``layer`` (kernel="nngp"). Default: None, the one the shorthands below give.
        options (NtkOptions, optional): how: the dtype and the memory budget; the implementation for a model
            computed on its own (NOTE [batched ensemble]). The models are computed where ``build`` puts them.
            Default: None, the one the shorthands below give.
        output (str, optional): shorthand for ``spec.output``, as ``compute_ntk``. Default: None.
        mode (str): shorthand for ``spec.mode``: any ``compute_ntk`` mode, "pseudo" included. Default: "full".
        params (list of str, optional): shorthand for ``spec.params``: NTK of a parameter subset (globs).
            Default: None (all).
        layer (str, optional): shorthand for ``spec.layer``: for kernel="nngp", the module whose output gives the
            features. Default: None.
        dtype (torch.dtype or str, optional): shorthand for ``options.dtype``: float32 or float64. Default: the
            first model's dtype.
        memory_budget_bytes (int, optional): shorthand for ``options.memory_budget_bytes``: peak memory allowed.
            Default: ``default_memory_budget()``.

    Returns:
        MonteCarloResult: ``mean`` and ``stderr`` shaped as the mode's kernel ((N, M, k, k) for FULL, ...).

    Raises:
        InvalidInput: seeds empty, over the limit, repeated or not integers; ``layer`` given for kernel="ntk";
            shorthands given with their value; a spec with groups; ``options.device`` other than the models'.
        UnknownLayer, UnknownMode, ShapeMismatch, NoMatchingParameters, UnsupportedModel: as ``compute_ntk``
            and ``compute_nngp``; UnsupportedModel also when seeds build different architectures.
        MemoryEstimateExceeded: not even one model's kernel fits the budget.

    Example::

        >>> build = lambda seed: torch.manual_seed(seed) and torch.nn.Sequential(torch.nn.Linear(3, 64),
        ...     torch.nn.ReLU(), torch.nn.Linear(64, 1))
        >>> mc = monte_carlo_ntk(build, torch.randn(5, 3), seeds=range(8), mode="trace")
        >>> mc.mean.shape, mc.stderr.shape                               # (N, N) each
        (torch.Size([5, 5]), torch.Size([5, 5]))
    """
    seed_list = _check_seeds(seeds)
    kind = _parse_kind(kernel)
    loose = SpecKeywords(mode=mode, output=output, params=params, layer=layer)
    what = resolve_spec(spec, loose, operation=_OPERATION)
    how = resolve_options(options, Shorthands(None, dtype, memory_budget_bytes, None, None, None), operation=_OPERATION)
    refuse_fields(what, ("groups", "rest"), operation=_OPERATION)
    if what.layer is not None and kind is KernelKind.NTK:
        raise InvalidInput(f"{_OPERATION}: layer={what.layer!r} names features, which only kernel='nngp' uses")
    if what.params is not None and kind is KernelKind.NNGP:
        raise InvalidInput(
            f"{_OPERATION}: params={list(what.params)!r} selects NTK parameters; kernel='nngp' uses none"
        )
    if models_per_chunk is not None and not _positive_int(models_per_chunk):
        raise InvalidInput(f"{_OPERATION}: models_per_chunk must be a positive integer, got {models_per_chunk!r}")
    first = _built(build, seed_list[0], None)
    on_model_device(how, first, operation=_OPERATION)
    ensemble = _Seeds(build, seed_list, first, kind, models_per_chunk)
    return run(lambda call: run_monte_carlo(ensemble, x1, x2, call), what, how, device_of=first)


@dataclass(frozen=True)
class _Seeds:
    """What ``monte_carlo_ntk`` averages over, checked: the builder, the seeds, the first model (built), the kernel
    and the chunk limit."""

    build: Callable[[int], nn.Module]
    seeds: list[int]
    first: nn.Module
    kind: KernelKind
    models_per_chunk: int | None


def run_monte_carlo(seeds: _Seeds, x1: Inputs, x2: Inputs | None, call: Call) -> MonteCarloResult:
    """``monte_carlo_ntk`` of a checked call (``kernels/core.py``): the implementation, never re-checking it."""
    seed_list, first, kind, spec = seeds.seeds, seeds.first, seeds.kind, call.spec
    kernel_mode, layer, budget = spec.mode, spec.layer, call.budget
    expected = _signature(first)
    with prepared_problem(
        first, x1, x2, params=spec.params, dtype=call.options.dtype, output=spec.output_path
    ) as prepared:
        problem, x1t, x2t = prepared.problem, prepared.x1, prepared.x2
        if layer is not None:
            find_layer(problem.module, layer, operation=_OPERATION)
    symmetric, n, m = example_counts(x1t, x2t, kernel_mode)
    per_model, fixed = _bytes(problem, kind, kernel_mode, n, 0 if symmetric else m, layer, first, x1t)
    fits = int((budget - fixed) // per_model) if budget > fixed else 0
    chunk = min(len(seed_list), fits, seeds.models_per_chunk or len(seed_list))
    if _plain_tensors(first):  # the skeleton would lend every seed the first model's (NOTE [batched ensemble])
        chunk = 0
    if problem.per_example_loop:  # the ensemble vmaps over examples, which the model refuses: each on its own
        chunk = 0
    acc = _Accumulator()
    if chunk < 1:  # one model's Jacobians do not fit, or plain tensors: each kernel on its own
        left = max(int(budget - fixed), 1)
        options = call.options.replace(dtype=problem.dtype, memory_budget_bytes=left)
        alone = _Alone(kind, dataclasses.replace(call, options=options, budget=left))
        largest = 0
        for i, seed in enumerate(seed_list):
            kernel_s, planned = alone.kernel(first if i == 0 else _built(seeds.build, seed, expected), x1t, x2t)
            acc.add(kernel_s)
            largest = max(largest, planned)
        estimate = fixed + largest  # the accumulators and the costliest single kernel's own plan
    else:
        skeleton = copy.deepcopy(first).eval()  # not on meta: NOTE [batched ensemble]
        for start in range(0, len(seed_list), chunk):
            seeds_c = seed_list[start : start + chunk]
            models = [first if start + i == 0 else _built(seeds.build, s, expected) for i, s in enumerate(seeds_c)]
            ensemble = _Ensemble(skeleton, models, problem)
            del models
            for kernel_s in _chunk_kernels(
                ensemble, problem, kind, kernel_mode, x1t, None if symmetric else x2t, layer
            ):
                acc.add(kernel_s)
        estimate = fixed + chunk * per_model
    mean, stderr = acc.result()
    return MonteCarloResult(
        mean=mean,
        stderr=stderr,
        n_samples=len(seed_list),
        kernel=kind,
        mode=kernel_mode,
        models_per_chunk=max(chunk, 0),
        estimate_bytes=int(estimate),
    )


@dataclass(frozen=True)
class _Alone:
    """One model's kernel by the core of ``compute_ntk`` / ``compute_nngp`` (the fallback of NOTE [batched
    ensemble]), with the call's spec and the dtype and budget left for it."""

    kind: KernelKind
    call: Call

    def kernel(self, model: nn.Module, x1: Batch, x2: Batch | None) -> tuple[torch.Tensor, int]:
        """The model's kernel and its planned peak bytes."""
        if self.kind is KernelKind.NTK:
            result = run_kernel(model, x1, x2, self.call)
            assert isinstance(result, NtkResult)  # no groups: monte_carlo_ntk refuses them
            return result.theta, result.estimate_bytes
        nngp = run_nngp(model, x1, x2, self.call)
        return nngp.theta, nngp.estimate_bytes


def _parse_kind(kernel: KernelKind | str) -> KernelKind:
    try:
        return KernelKind(kernel)
    except ValueError:
        valid = ", ".join(repr(k.value) for k in KernelKind)
        raise InvalidInput(f"{_OPERATION}: unknown kernel {kernel!r}; expected one of {valid}") from None


def _chunk_kernels(
    ensemble: _Ensemble,
    problem: NtkProblem,
    kind: KernelKind,
    mode: KernelMode | DerivedMode,
    x1: Batch,
    x2: Batch | None,
    layer: str | None,
) -> list[torch.Tensor]:
    """Each model's kernel, in the chunk's order."""
    if kind is KernelKind.NNGP:
        f1 = ensemble.features(x1, layer)
        f2 = None if x2 is None else ensemble.features(x2, layer)
        return [feature_kernel(f1[s], None if f2 is None else f2[s], mode) for s in range(ensemble.size)]
    j1 = ensemble.jacobians(x1, problem.k)
    j2 = None if x2 is None else ensemble.jacobians(x2, problem.k)
    return [
        _ntk_of(
            {n: j[s] for n, j in j1.items()}, None if j2 is None else {n: j[s] for n, j in j2.items()}, mode, problem.k
        )
        for s in range(ensemble.size)
    ]


def _bytes(
    problem: NtkProblem,
    kind: KernelKind,
    mode: KernelMode | DerivedMode,
    n: int,
    m: int,
    layer: str | None,
    first: nn.Module,
    x1: Batch,
) -> tuple[float, float]:
    """(bytes per model in a chunk, fixed bytes): NOTE [batched ensemble]'s memory model."""
    item = problem.itemsize
    all_params = sum(p.numel() for p in first.parameters()) + sum(b.numel() for b in first.buffers())
    m_all = m if m else n
    if kind is KernelKind.NTK:
        k = problem.k
        shape = result_shape(mode, n, m_all, outputs_of(mode, k))
        jac = (n + m) * k * problem.num_params * item
        transient = (n + m) * problem.saved_bytes * (1 + k)
    else:
        d = problem.k
        if layer is not None:
            with prepared_problem(
                first, take(x1, 0, 1), None, params=None, dtype=problem.dtype, output=problem.output
            ) as one:
                d = features(one.problem, one.x1, layer, chunk=1, operation=_OPERATION).shape[1]
        shape = kernel_shape(mode, n, m_all, d)
        jac = (n + m) * d * item
        transient = (n + m) * problem.saved_bytes
    result = math.prod(shape) * item
    # per model: its own and its stacked parameters, Jacobians (or features), the forward's transients, its kernel
    per_model = 2 * all_params * item + jac + transient + result
    return max(per_model, 1.0), 3 * result + all_params * item
