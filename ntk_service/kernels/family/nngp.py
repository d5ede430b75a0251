"""``compute_nngp``: the empirical NNGP kernel f(x1) f(x2)ᵀ, or the conjugate kernel Φ(x1) Φ(x2)ᵀ of the
features at a named module, in the same modes and layouts as the NTK.

With features F1 = f(x1) (N, d) and F2 = f(x2) (M, d) (d = k for the outputs, the flattened size of the
module's output for a layer):

=================== ============== ============================== ==============================================
mode                shape          entry                          neural-tangents ``empirical_nngp_fn``
=================== ============== ============================== ==============================================
FULL                (N, M, d, d)   F1[n, a] F2[m, b]              ``trace_axes=()``
TRACE               (N, M)         Σ_a F1[n, a] F2[m, a]          ``trace_axes=(-1,)`` (its default) times d
EXAMPLE_DIAGONAL    (N, d, d)      F1[n, a] F1[n, b]              ``diagonal_axes=(0,), trace_axes=()``
OUTPUT_DIAGONAL     (N, M, d)      F1[n, a] F2[m, a]              ``diagonal_axes=(-1,), trace_axes=()``
PSEUDO              (N, M)         (1/d) Σ_ab F1[n, a] F2[m, b]   (none)
=================== ============== ============================== ==============================================

NOTE [NNGP normalization]: neural-tangents divides the contraction over its traced axes by their size (a mean,
so its default NNGP of a k-output model is F1 F2ᵀ / k), exactly as it does for its NTK; our TRACE is the plain
sum, as our NTK TRACE is. A layer's features are flattened per example first, so for a layer with several
feature axes (a convolution's (C, H, W)) TRACE sums over all of them: neural-tangents' ``trace_axes`` over every
output axis times d, not its default (the last axis alone, which keeps the other axes in the kernel). Both are
one draw at the given parameters: the NNGP of the infinite-width theory is the expectation over initializations
(``monte_carlo.py``). The conjugate kernel at a readout's input Φ is the
TRACE kernel of that layer's features, ΦΦᵀ; the NTK block of a Linear readout's weight is ΦΦᵀ ⊗ I_k.

Cost: one forward pass per example (N + M, or N when x2 is omitted), no gradients; memory the features
(N + M)·d plus one chunk of activations, and the result.

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
    >>> compute_nngp(model, x1, x2).theta.shape                         # (N, M, k, k)
    torch.Size([5, 4, 2, 2])
    >>> compute_nngp(model, x1, layer="1", mode="trace").theta.shape    # (N, N): Φ Φᵀ of the Tanh's output
    torch.Size([5, 5])
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ntk_service.errors import MemoryEstimateExceeded, UnknownLayer, UnsupportedModel, format_bytes
from ntk_service.kernels.core import Call, run
from ntk_service.kernels.derived import map_of, outputs_of
from ntk_service.kernels.modes import DerivedMode, KernelMode, Outputs, contraction, result_shape
from ntk_service.kernels.options import NtkOptions, Shorthands, resolve_options
from ntk_service.kernels.problem.batch import Batch, Inputs, batch_size, take
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime.problem_pool import prepared_problem
from ntk_service.kernels.spec import KernelSpec, SpecKeywords, refuse_fields, resolve_spec

__all__ = ["NngpResult", "compute_nngp", "example_counts", "feature_kernel", "features", "find_layer", "run_nngp"]


@dataclass(frozen=True)
class NngpResult:
    """What ``compute_nngp`` returns.

    Attributes:
        theta: (N, M, d, d) FULL, (N, M) TRACE, (N, d, d) EXAMPLE_DIAGONAL, (N, M, d) OUTPUT_DIAGONAL, (N, M)
            PSEUDO: the kernel block, named as ``NtkResult.theta``.
        mode: the mode computed.
        layer: the module whose output gave the features, or None for the model's outputs.
        features: d, the features per example (k for the outputs).
        estimate_bytes: the planned peak memory, result included.
    """

    theta: torch.Tensor
    mode: KernelMode | DerivedMode
    layer: str | None
    features: int
    estimate_bytes: int

    @property
    def kernel(self) -> torch.Tensor:
        """Deprecated: ``theta``, this attribute's old name (kept for one release; warns DeprecationWarning)."""
        warnings.warn(
            "NngpResult.kernel is deprecated and will be removed in the next release; use NngpResult.theta "
            "(the name NtkResult uses)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.theta


def find_layer(module: nn.Module, layer: str, *, operation: str) -> nn.Module:
    """The submodule named ``layer`` (a ``named_modules()`` name).

    Raises:
        UnknownLayer: no module of that name; the message lists the names.
    """
    modules: dict[str, nn.Module] = dict(module.named_modules())
    if not isinstance(layer, str) or layer == "" or layer not in modules:
        names = [name for name in modules if name]
        shown = ", ".join(names[:16]) + (", ..." if len(names) > 16 else "")
        raise UnknownLayer(f"{operation}: layer {layer!r} is not a module of the model; its modules are: {shown}")
    return modules[layer]


def example_counts(x1: Batch, x2: Batch | None, mode: KernelMode | DerivedMode) -> tuple[bool, int, int]:
    """(symmetric, N, M) of prepared inputs: symmetric when x2 is x1 or the mode uses no x2 (M = N then)."""
    n = batch_size(x1)
    return x2 is None or not mode.spec.pairs, n, n if x2 is None else batch_size(x2)


def _chunk(problem: NtkProblem, budget: float) -> int:
    """Examples per forward chunk: the activations of one chunk within the budget (at least one)."""
    per_example = max(problem.saved_bytes, problem.itemsize)
    return max(1, int(budget // per_example))


def features(problem: NtkProblem, x: Batch, layer: str | None, *, chunk: int, operation: str) -> torch.Tensor:
    """F = f(x) (n, k), or the flattened output of module ``layer`` (n, d), chunked over examples, no gradients.

    Raises:
        UnknownLayer: ``layer`` is not a module of the model.
        UnsupportedModel: the layer is not called exactly once per forward, or its output is not one tensor with
            a row per example.
    """
    n = batch_size(x)
    if layer is None:
        with torch.no_grad():
            return torch.cat([problem.f_batch(problem.params, take(x, i, i + chunk)) for i in range(0, n, chunk)])
    target = find_layer(problem.module, layer, operation=operation)
    captured: list[object] = []
    handle = target.register_forward_hook(lambda _module, _args, out: captured.append(out))
    try:
        rows = []
        for i in range(0, n, chunk):
            captured.clear()
            block = take(x, i, i + chunk)
            with torch.no_grad():
                problem.f_batch(problem.params, block)
            rows.append(_layer_output(captured, batch_size(block), layer, operation))
    finally:
        handle.remove()
    return torch.cat(rows)


def _layer_output(captured: list[object], n: int, layer: str, operation: str) -> torch.Tensor:
    if len(captured) != 1:
        raise UnsupportedModel(
            f"{operation}: layer {layer!r} ran {len(captured)} times in one forward pass; its features are defined "
            "only for a module called exactly once (name a module the forward calls once)"
        )
    out = captured[0]
    if not isinstance(out, torch.Tensor) or out.ndim < 1 or out.shape[0] != n or not out.is_floating_point():
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UnsupportedModel(
            f"{operation}: layer {layer!r} returned {got} for a batch of {n} examples; expected a float tensor "
            "(n, *features) with one row per example"
        )
    return out.reshape(n, -1)


def feature_kernel(f1: torch.Tensor, f2: torch.Tensor | None, mode: KernelMode | DerivedMode) -> torch.Tensor:
    """The kernel of features f1 (N, d) and f2 (M, d) (None: f2 = f1, the result exactly symmetric) for ``mode``:
    a contracted mode by its axes (``vocabulary.MODES``), a derived mode as its base mode of the mapped features
    (``derived.OUTPUT_MAPS``).

    Returns:
        (N, M, d, d) FULL, (N, M) TRACE, (N, d, d) EXAMPLE_DIAGONAL, (N, M, d) OUTPUT_DIAGONAL, (N, M) PSEUDO.
    """
    if isinstance(mode, DerivedMode):
        output_map = map_of(mode)
        mapped = None if f2 is None else output_map.apply(f2)
        return feature_kernel(output_map.apply(f1), mapped, contraction(mode))
    outputs = mode.spec.outputs
    if not mode.spec.pairs:  # each example with itself, only the entries the mode keeps (a layer's d may be large)
        if outputs is Outputs.ALL:
            return f1[:, :, None] * f1[:, None, :]
        return f1 * f1 if outputs is Outputs.DIAGONAL else (f1 * f1).sum(1)
    other = f1 if f2 is None else f2
    if outputs is Outputs.ALL:  # products of two scalars: exactly symmetric when f2 is f1
        return f1[:, None, :, None] * other[None, :, None, :]
    if outputs is Outputs.DIAGONAL:
        return f1[:, None, :] * other[None, :, :]
    gram = f1 @ other.T
    return gram if f2 is not None else (gram + gram.T) / 2  # a matmul's round-off is not symmetric


def kernel_shape(mode: KernelMode | DerivedMode, n: int, m: int, d: int) -> tuple[int, ...]:
    """Shape of a feature kernel for ``mode`` (a derived mode's over its mapped features)."""
    return result_shape(mode, n, m, outputs_of(mode, d))


def compute_nngp(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None = None,
    *,
    spec: KernelSpec | None = None,
    options: NtkOptions | None = None,
    layer: str | None = None,
    output: str | None = None,
    mode: KernelMode | DerivedMode | str | None = None,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
) -> NngpResult:
    """The empirical NNGP f(x1) f(x2)ᵀ of the outputs, or the conjugate kernel of the features at ``layer``.

    Args:
        model (nn.Module): maps a batch (N, *input) to (N, *out), run in eval semantics, never mutated.
        x1 (Tensor, tuple or mapping): (N, *input), or forward's positional / keyword inputs, as ``compute_ntk``.
        x2 (same kind as x1, optional): (M, *input). Default: None, meaning x2 = x1 (exactly symmetric result).
        spec (KernelSpec, optional): what to compute: ``mode``, ``layer`` and ``output`` (``params`` and
            ``groups`` are the NTK's). Default: None, the one the shorthands below give.
        options (NtkOptions, optional): how: the dtype, the memory budget and the device are used (a forward pass
            has no implementation to choose). Default: None, the one the shorthands below give.
        layer (str, optional): shorthand for ``spec.layer``: a ``named_modules()`` name, e.g. ``"features.3"``:
            the features are that module's output, flattened per example to d values. Default: None (the model's
            k outputs).
        output (str, optional): shorthand for ``spec.output``: which tensor of forward's return value is f, as
            ``compute_ntk``. Default: None.
        mode (KernelMode, DerivedMode or str): shorthand for ``spec.mode``: as ``compute_ntk``, with d in place of
            k (see the module table and NOTE [NNGP normalization]). Default: "full".
        dtype (torch.dtype or str, optional): shorthand for ``options.dtype``: float32 or float64. Default: the
            model's dtype.
        memory_budget_bytes (int, optional): shorthand for ``options.memory_budget_bytes``: peak memory allowed.
            Default: ``default_memory_budget()``.

    Returns:
        NngpResult: ``kernel`` (N, M, d, d) FULL, (N, M) TRACE, (N, d, d) EXAMPLE_DIAGONAL, (N, M, d)
        OUTPUT_DIAGONAL, (N, M) PSEUDO.

    Raises:
        UnknownLayer: ``layer`` is not a module of the model.
        UnknownMode, ShapeMismatch, EmptyBatch, NonFiniteInput, UnsupportedModel: bad input (all InvalidInput);
            InvalidInput also for shorthands given with their value, or a spec with params or groups.
        MemoryEstimateExceeded: the result and features would not fit the budget (before allocating them).
    """
    operation = "compute_nngp"
    what = resolve_spec(spec, SpecKeywords(mode=mode, output=output, layer=layer), operation=operation)
    loose = Shorthands(None, dtype, memory_budget_bytes, None, None, None)
    how = resolve_options(options, loose, operation=operation)
    refuse_fields(what, ("params", "groups", "rest"), operation=operation)
    return run(lambda call: run_nngp(model, x1, x2, call), what, how, device_of=model)


def run_nngp(model: nn.Module, x1: Inputs, x2: Inputs | None, call: Call) -> NngpResult:
    """``compute_nngp`` of a checked call (``kernels/core.py``): the implementation, never re-checking the call."""
    operation = "compute_nngp"
    kernel_mode, layer, budget = call.spec.mode, call.spec.layer, call.budget
    with prepared_problem(
        model, x1, x2, params=None, dtype=call.options.dtype, device=call.device, output=call.spec.output_path
    ) as prepared:
        problem, x1t, x2t = prepared.problem, prepared.x1, prepared.x2
        if layer is not None:
            find_layer(problem.module, layer, operation=operation)
        symmetric, n, m = example_counts(x1t, x2t, kernel_mode)
        # d is known only after a forward for a layer: one example first, then the estimate, then the rest
        first = take(x1t, 0, 1)
        d = problem.k if layer is None else features(problem, first, layer, chunk=1, operation=operation).shape[1]
        fixed = (math.prod(kernel_shape(kernel_mode, n, m, d)) + (n + (0 if symmetric else m)) * d) * problem.itemsize
        activations = max(problem.saved_bytes, problem.itemsize)
        if fixed + activations > budget:
            raise MemoryEstimateExceeded(
                f"{operation}: mode {kernel_mode.value} with N={n}, M={m} and d={d} features needs "
                f"{format_bytes(fixed + activations)}, over the memory budget of {format_bytes(budget)}; use mode "
                "trace or output_diagonal, fewer examples, or an earlier (narrower) layer",
                estimate_bytes=int(fixed + activations),
                budget_bytes=budget,
            )
        chunk = _chunk(problem, budget - fixed)
        f1 = features(problem, x1t, layer, chunk=chunk, operation=operation)
        f2 = None if symmetric or x2t is None else features(problem, x2t, layer, chunk=chunk, operation=operation)
        kernel = feature_kernel(f1, f2, kernel_mode)
    estimate = fixed + min(chunk, max(n, m)) * activations
    return NngpResult(theta=kernel, mode=kernel_mode, layer=layer, features=d, estimate_bytes=int(estimate))
