"""``ntk_features``: sketched NTK features Φ (N, k, D) with E[Φ(x1) Φ(x2)ᵀ] = Θ(x1, x2), never building the whole J.

The Gaussian sketch: Φ(x) = J(x) R / √D for a Gaussian R (P, D), R_pd ~ N(0, 1) i.i.d.: E[R Rᵀ] = D·I, so
E[Φ1 Φ2ᵀ] = J1 Jᵀ2 = Θ for every pair of inputs, FULL per output pair, and TRACE by summing Φ1[:, a] · Φ2[:, a]
over the outputs a (``feature_kernel``). Each column J r_d is one forward-mode product (``jvp`` with tangent r_d),
vmapped over a block of columns: time D·N·[FP] (forward mode), memory one block of tangents (``BLOCK``·P floats)
plus one chunk of forward-mode activations; J is never formed.

Two sketches (``SketchKind``, the ``sketch`` option): "gaussian" as above; "structured" sketches the weights the
structured engine factors (Linear, Conv, Embedding: J_c = Σ_t δ_c[t] ⊗ a[t]) by a Kronecker product of two small
Gaussian sketches of δ and a, never forming J, and every other parameter by J R with the same R as "gaussian"
(``product_sketch.py``: its cost, and NOTE [product sketch error] for its larger variance per column).
``DEFAULT_SKETCH`` says which is the default and why. Both are unbiased and deterministic: the same (seed, D,
params, sketch) gives the same Φ in every process and on every chunking of the examples (NOTE [sketch
determinism] in ``sketch_draws.py``: bit for bit in one process and across processes with the same torch build and
threads; across chunkings to rounding, as BLAS may sum a batch's products in another order).

NOTE [sketch error]
    For a Gaussian sketch each entry of Φ1 Φ2ᵀ is unbiased with variance (Θ_ij² + Θ_ii Θ_jj) / D (Wick's
    theorem), so E‖Φ Φᵀ − Θ‖²_F = (‖Θ‖²_F + (tr Θ)²) / D: the relative error falls like 1/√D with a constant of
    about √(1 + (tr Θ)² / ‖Θ‖²_F); tests/kernels/test_features.py checks both the rate and that constant.

    >>> phi = ntk_features(model, x, dim=1024, seed=0)          # (N, k, 1024)  # doctest: +SKIP
    >>> ntk_features(model, x, dim=1024, sketch="gaussian")     # the same E[Φ Φᵀ], other draws  # doctest: +SKIP
    >>> feature_kernel(phi).shape, feature_kernel(phi, mode="trace").shape      # (N, N, k, k), (N, N)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import torch
from torch import nn
from torch.func import jvp, vmap

from ntk_service.errors import (
    InvalidInput,
    MemoryEstimateExceeded,
    ShapeMismatch,
    UnknownMode,
    UnsupportedModel,
    format_bytes,
)
from ntk_service.kernels.core import Call, on_model_device, run
from ntk_service.kernels.modes import KernelMode, parse_any_mode
from ntk_service.kernels.options import NtkOptions, Shorthands, resolve_options
from ntk_service.kernels.problem.batch import Batch, batch_size, take
from ntk_service.kernels.problem.embedding_padding import padding_as_constant
from ntk_service.kernels.problem.forward_mode import forward_mode
from ntk_service.kernels.problem.inputs import validate_inputs
from ntk_service.kernels.problem.math_attention import math_attention
from ntk_service.kernels.problem.preparation import build_problem
from ntk_service.kernels.problem.private_module import check_model, private_copy
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.sketch.product_sketch import structured_features
from ntk_service.kernels.sketch.sketch_draws import BLOCK, gaussian_block
from ntk_service.kernels.spec import KernelSpec, SpecKeywords, refuse_fields, resolve_spec
from ntk_service.kernels.types import NamedTensors

__all__ = ["DEFAULT_SKETCH", "MAX_FEATURE_DIM", "SketchKind", "feature_kernel", "ntk_features", "run_features"]


class SketchKind(StrEnum):
    """How ``ntk_features`` draws Φ (module docstring)."""

    GAUSSIAN = "gaussian"
    """Φ = J R / √D by D forward-mode products; the smallest variance per column, the cost of D forward passes."""

    STRUCTURED = "structured"
    """A Kronecker sketch of δ ⊗ a for the weights the structured engine factors, the Gaussian R for the rest."""


MAX_FEATURE_DIM = 65_536
"""The largest D accepted: past it a sketch costs more forward-mode passes than most exact kernels of the same
inputs (D passes against N·k for the Jacobian), so a larger D is a mistake more often than a need."""

DEFAULT_SKETCH = SketchKind.STRUCTURED
"""Structured: on the benchmark MLP 784-512-512-10 (N = 200, float32) it is 18× to ~100× faster than the Gaussian
sketch at D = 256 ... 4096, for an error only ~5 % larger at equal D (its variance per column is larger, NOTE
[product sketch error], but there the trace term both share dominates), so at equal time its error is several times
smaller (docs/benchmarks.md, ``bench_solvers.py --section sketch``). Models without factored weights get the same
numbers either way, up to how J R is summed."""

_OPERATION = "ntk_features"


def _tangents(problem: NtkProblem, seed: int, block: int) -> NamedTensors:
    """R's columns block·BLOCK ... (block+1)·BLOCK − 1 as tangents: name -> (BLOCK, *param_shape)."""
    return {
        name: gaussian_block(seed, name, block, tuple(p.shape), problem.dtype) for name, p in problem.params.items()
    }


def _check_sketch(sketch: object) -> SketchKind:
    if isinstance(sketch, str):  # a SketchKind is a str too
        try:
            return SketchKind(sketch)
        except ValueError:
            pass
    raise InvalidInput(f"{_OPERATION}: sketch must be one of {[s.value for s in SketchKind]}, got {sketch!r}")


def _check_dim(dim: object) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_FEATURE_DIM:
        raise InvalidInput(
            f"{_OPERATION}: dim must be an integer in [1, {MAX_FEATURE_DIM}], got {dim!r}; the error falls like "
            "1/√dim (NOTE [sketch error]), so a few thousand columns usually suffice"
        )
    return dim


def ntk_features(
    model: nn.Module,
    x: torch.Tensor,
    *,
    dim: int,
    seed: int = 0,
    sketch: SketchKind | str = DEFAULT_SKETCH,
    spec: KernelSpec | None = None,
    options: NtkOptions | None = None,
    params: Sequence[str] | None = None,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
) -> torch.Tensor:
    """Sketched NTK features Φ (N, k, D) of the examples x with E[Φ1 Φ2ᵀ] = Θ (module docstring).

    Args:
        model (nn.Module): maps (N, *input) to (N, *out); run in eval semantics on a private copy.
        x (Tensor): (N, *input).
        dim (int): D, the sketch size, in [1, ``MAX_FEATURE_DIM``].
        seed (int): picks the sketch (NOTE [sketch determinism]). Default: 0.
        sketch (SketchKind or str): "gaussian" or "structured" (``SketchKind``). Default: ``DEFAULT_SKETCH``.
        spec (KernelSpec, optional): what: ``params`` (features give every mode through ``feature_kernel``).
            Default: None, the one the shorthands give.
        options (NtkOptions, optional): how: the dtype and the memory budget; the features are computed where the
            model is. Default: None, the one the shorthands give.
        params (list of str, optional): shorthand for ``spec.params``: a parameter subset (globs): features of
            that subset's kernel. Default: all.
        dtype (torch.dtype or str, optional): shorthand for ``options.dtype``: float32 or float64. Default: the
            model's dtype.
        memory_budget_bytes (int, optional): shorthand for ``options.memory_budget_bytes``: peak memory. Default:
            ``default_memory_budget()``.

    Returns:
        Tensor (N, k, D): E[Φ(x1)[n] Φ(x2)[m]ᵀ] = Θ(x1, x2)[n, m] (FULL, (k, k)) for features of x1 and x2
        computed with the same seed, dim, params and sketch; ``feature_kernel`` forms the kernel.

    Raises:
        InvalidInput: dim outside [1, MAX_FEATURE_DIM] or not an integer; an unknown sketch; shorthands given with
            their value; a spec with a mode, output, groups or a layer; ``options.device`` other than the model's.
        MemoryEstimateExceeded: Φ, the draws and one example's passes exceed the budget (the message gives the
            estimate).
        ShapeMismatch, EmptyBatch, NonFiniteInput, NoMatchingParameters, UnsupportedModel: as ``compute_ntk``;
            UnsupportedModel also for an operation without forward-mode AD (the Gaussian sketch) and for a model
            that refuses vmap over examples (the structured sketch: use "gaussian").
    """
    d = _check_dim(dim)
    kind = _check_sketch(sketch)
    what = resolve_spec(spec, SpecKeywords(params=params), operation=_OPERATION)
    how = resolve_options(options, Shorthands(None, dtype, memory_budget_bytes, None, None, None), operation=_OPERATION)
    refuse_fields(what, ("mode", "output", "groups", "rest", "layer"), operation=_OPERATION)
    check_model(model)
    on_model_device(how, model, operation=_OPERATION)
    return run(lambda call: run_features(model, x, d, seed, kind, call), what, how, device_of=model)


def run_features(model: nn.Module, x: torch.Tensor, d: int, seed: int, kind: SketchKind, call: Call) -> torch.Tensor:
    """``ntk_features`` of a checked call (``kernels/core.py``): the implementation, never re-checking it."""
    budget = call.budget
    compute_dtype, xt, _ = validate_inputs(model, x, None, call.options.dtype)
    private = private_copy(model)
    if private is None:
        raise UnsupportedModel(f"{_OPERATION}: the model cannot be copied (copy.deepcopy failed); use compute_ntk")
    problem = build_problem(private, xt, None, params=call.spec.params, dtype=compute_dtype)
    if kind is SketchKind.STRUCTURED and problem.per_example_loop:
        raise UnsupportedModel(
            f"{_OPERATION}: sketch='structured' captures the layers' δ and inputs under torch.func.vmap over the "
            "examples, which this model refuses (data-dependent control flow, e.g. a branch on an attention mask's "
            "values); pass sketch='gaussian', whose forward-mode products take the batch as it is"
        )
    if kind is SketchKind.STRUCTURED:
        phi = structured_features(problem, xt, dim=d, seed=seed, memory_budget_bytes=budget, operation=_OPERATION)
    else:
        phi = _gaussian_features(problem, xt, d, seed, budget)
    return phi.detach().div_(math.sqrt(d))  # in place: Φ is the largest tensor of the call


def _gaussian_features(problem: NtkProblem, xt: Batch, d: int, seed: int, budget: int) -> torch.Tensor:
    """J R (N, k, D), unscaled, by D forward-mode products in blocks of ``BLOCK`` columns."""
    n, k, item = batch_size(xt), problem.k, problem.itemsize
    # Φ itself; one block of tangents (and its float64 draw); per example: primal and tangent activations and
    # outputs for every column of the block at once
    fixed = n * k * d * item + BLOCK * problem.num_params * (item + 8)
    per_example = BLOCK * (2 * problem.saved_bytes + 2 * k * item)
    chunk = int((budget - fixed) // per_example) if budget > fixed else 0
    if chunk < 1:
        needed = int(fixed + per_example)
        raise MemoryEstimateExceeded(
            f"{_OPERATION}: features of N={n} examples with k={k}, D={d} (P={problem.num_params}) need at least "
            f"{format_bytes(needed)}, over the memory budget of {format_bytes(budget)}; use a smaller dim, fewer "
            "examples per call (Φ of a data set can be computed in row chunks: rows do not interact), or a larger "
            "budget",
            estimate_bytes=needed,
            budget_bytes=budget,
        )
    phi = torch.empty(n, k, d, dtype=problem.dtype)

    def columns(tangent: NamedTensors, xb: Batch) -> torch.Tensor:
        out: torch.Tensor = jvp(lambda p: problem.f_batch(p, xb), (problem.params,), (tangent,))[1]
        return out  # (n_chunk, k)

    advice = (
        "sketched features need jvp. Compute the exact kernel with compute_ntk(implementation='jacobian_contraction') "
        "instead"
    )
    # padding lookups constant as in reverse mode
    with forward_mode(_OPERATION, advice), math_attention(), padding_as_constant():
        for block in range((d + BLOCK - 1) // BLOCK):
            start, stop = block * BLOCK, min(d, (block + 1) * BLOCK)
            tangents = {name: t[: stop - start] for name, t in _tangents(problem, seed, block).items()}
            for i in range(0, n, chunk):
                xb = take(xt, i, i + chunk)
                # (cols, n_chunk, k) -> (n_chunk, k, cols)
                phi[i : i + chunk, :, start:stop] = vmap(columns, in_dims=(0, None))(tangents, xb).permute(1, 2, 0)
    return phi


def feature_kernel(
    phi1: torch.Tensor, phi2: torch.Tensor | None = None, *, mode: KernelMode | str = KernelMode.FULL
) -> torch.Tensor:
    """The kernel of sketched features: Φ1 Φ2ᵀ per output pair.

    Args:
        phi1 (Tensor): (N, k, D) from ``ntk_features``. phi2 (Tensor, optional): (M, k, D) with the same seed, dim
            and params. Default: None (phi2 = phi1).
        mode (str): "full" (N, M, k, k) or "trace" (N, M), the plain sum over outputs. Default: "full".

    Returns:
        Tensor (N, M, k, k) or (N, M), an unbiased estimate of Θ(x1, x2) in that mode.

    Raises:
        ShapeMismatch: features that are not (N, k, D) or do not match. UnknownMode: another mode.
    """
    other = phi1 if phi2 is None else phi2
    kernel_mode = parse_any_mode(mode, operation="feature_kernel")
    if phi1.ndim != 3 or other.ndim != 3 or phi1.shape[1:] != other.shape[1:]:
        raise ShapeMismatch(
            f"feature_kernel: features have shapes {tuple(phi1.shape)} and {tuple(other.shape)}; expected (N, k, D) "
            "and (M, k, D) from ntk_features with the same dim and model"
        )
    if kernel_mode is KernelMode.FULL:
        return torch.einsum("nad,mbd->nmab", phi1, other)
    if kernel_mode is KernelMode.TRACE:
        return torch.einsum("nad,mad->nm", phi1, other)
    raise UnknownMode(f"feature_kernel: mode {kernel_mode.value!r} is not supported; expected 'full' or 'trace'")
