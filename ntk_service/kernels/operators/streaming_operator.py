"""``dataset_operator``: Θ(x1, x2) v over a data set read in row chunks, for data sets that do not fit in memory.

The same products as ``ntk_operator`` (one VJP pass over the x2 side for u = J(x2)ᵀ v, summed over chunks, then
one JVP pass over the x1 side for J(x1) u; TRACE one output at a time), but x1 and x2 are *row sources*: a numpy
memmap, a zarr array, an h5py dataset, a tensor; anything with ``shape`` and ``source[i:j]``. Only one chunk of
examples is read (and converted) at a time, so memory is O(P) for the parameter-space vectors plus one chunk of
inputs and activations, plus v and Θ v themselves (N·k numbers each), whatever N is; the inputs themselves are
never held. Each product reads every row of both sides once (the x1 side once more for TRACE per output).

    >>> x = numpy.lib.format.open_memmap("x.npy", mode="r")        # (100_000, 784) on disk  # doctest: +SKIP
    >>> op = dataset_operator(model, x, examples_per_chunk=1024)                            # doctest: +SKIP
    >>> op.matvec(v)                                                  # (N, k) for v (N, k)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch, format_bytes
from ntk_service.kernels.core import Call, on_model_device, run
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.operators.linear_operator import NtkOperator, _Sides, parse_operator_mode
from ntk_service.kernels.options import NtkOptions, Shorthands, resolve_options
from ntk_service.kernels.problem.inputs import validate_inputs
from ntk_service.kernels.problem.preparation import build_problem
from ntk_service.kernels.problem.private_module import check_model, private_copy
from ntk_service.kernels.spec import KernelSpec, SpecKeywords, refuse_fields, resolve_spec

__all__ = ["DEFAULT_EXAMPLES_PER_CHUNK", "RowSource", "dataset_operator", "run_dataset_operator"]

DEFAULT_EXAMPLES_PER_CHUNK = 1024
"""Rows read per chunk unless the memory budget allows fewer: large enough that a chunk's VJP / JVP runs as one
batched pass (per-call overhead amortized), small enough that its activations stay in the tens of MB for an MLP."""

_OPERATION = "dataset_operator"


class RowSource:
    """Rows of a sliceable array as tensors of the compute dtype, validated chunk by chunk.

    Attributes:
        shape: (N, *input) of the source. dtype: the compute dtype.
    """

    def __init__(self, source: Any, name: str, dtype: torch.dtype, model: nn.Module) -> None:
        shape = getattr(source, "shape", None)
        if shape is None or not hasattr(source, "__getitem__") or len(shape) < 1:
            raise InvalidInput(
                f"{_OPERATION}: {name} must be a sliceable array with a shape (numpy memmap, zarr array, h5py dataset, "
                f"tensor), got {type(source).__name__}"
            )
        self.source, self.name, self.dtype, self._model = source, name, dtype, model
        self.shape = tuple(int(s) for s in shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        _, tensor, _ = validate_inputs(self._model, _read(self.source, rows), None, self.dtype)
        assert isinstance(tensor, torch.Tensor)  # one array in, one tensor out
        return tensor


def _read(source: Any, rows: slice) -> torch.Tensor:
    """One chunk as a tensor of its own memory (a read-only memmap's rows are copied, never aliased)."""
    chunk = source[rows]
    if isinstance(chunk, torch.Tensor):
        return chunk.detach()
    return torch.from_numpy(np.array(chunk))


def dataset_operator(
    model: nn.Module,
    x1: Any,
    x2: Any = None,
    *,
    spec: KernelSpec | None = None,
    options: NtkOptions | None = None,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
    mode: KernelMode | DerivedMode | str | None = None,
    params: Sequence[str] | None = None,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
) -> NtkOperator:
    """Θ(x1, x2) as a matrix-free operator over row sources, read in chunks (module docstring).

    Args:
        model (nn.Module): maps (n, *input) to (n, *out); run in eval semantics on a private copy.
        x1: (N, *input) rows, any sliceable array with ``shape``. x2: (M, *input), or None for x2 = x1.
        spec (KernelSpec, optional): what: ``mode`` and ``params``. Default: None, the one the shorthands give.
        options (NtkOptions, optional): how: the dtype and the memory budget of one product; the operator runs
            where the model is. Default: None, the one the shorthands give.
        examples_per_chunk (int): rows per read at most. Default: ``DEFAULT_EXAMPLES_PER_CHUNK``.
        mode (str): shorthand for ``spec.mode``: "full", "trace" or "pseudo" (as ``ntk_operator``). Default:
            "full".
        params, dtype: shorthands for ``spec.params`` and ``options.dtype``, as ``ntk_operator``.
        memory_budget_bytes (int, optional): shorthand for ``options.memory_budget_bytes``: peak memory of one
            product. Default: ``default_memory_budget()``.

    Returns:
        NtkOperator: ``matvec`` (M, k) -> (N, k) (FULL) or (M,) -> (N,), ``rmatvec``, ``op.T``,
        ``as_linear_operator()``; accepted by every solver in ``ntk_service.analysis``.

    Raises:
        InvalidInput: a source without shape or slicing, examples_per_chunk < 1; shorthands given with their
            value; a spec with output, groups or a layer; ``options.device`` other than the model's.
        UnknownMode: a diagonal mode.
        ShapeMismatch: sides with different per-example shapes. MemoryEstimateExceeded: one product does not
            fit the budget even one example at a time. NonFiniteInput: NaN in a chunk (found when it is read).
    """
    what = resolve_spec(spec, SpecKeywords(mode=mode, params=params), operation=_OPERATION)
    how = resolve_options(options, Shorthands(None, dtype, memory_budget_bytes, None, None, None), operation=_OPERATION)
    parse_operator_mode(what.mode, operation=_OPERATION)
    refuse_fields(what, ("output", "groups", "rest", "layer"), operation=_OPERATION)
    if isinstance(examples_per_chunk, bool) or not isinstance(examples_per_chunk, int) or examples_per_chunk < 1:
        raise InvalidInput(f"{_OPERATION}: examples_per_chunk must be an integer ≥ 1, got {examples_per_chunk!r}")
    check_model(model)
    on_model_device(how, model, operation=_OPERATION)
    return run(lambda call: run_dataset_operator(model, x1, x2, call, examples_per_chunk), what, how, device_of=model)


def run_dataset_operator(model: nn.Module, x1: Any, x2: Any, call: Call, examples_per_chunk: int) -> NtkOperator:
    """``dataset_operator`` of a checked call (``kernels/core.py``): the implementation, never re-checking it."""
    budget = call.budget
    if getattr(x1, "shape", None) is None or not hasattr(x1, "__getitem__"):
        RowSource(x1, "x1", torch.float64, model)  # raises, with the message
    first = _read(x1, slice(0, examples_per_chunk))
    compute_dtype, first_t, _ = validate_inputs(model, first, None, call.options.dtype)
    rows = RowSource(x1, "x1", compute_dtype, model)
    cols = rows if x2 is None else RowSource(x2, "x2", compute_dtype, model)
    if cols.shape[1:] != rows.shape[1:]:
        raise ShapeMismatch(
            f"{_OPERATION}: x2 has per-example shape {cols.shape[1:]}, x1 has {rows.shape[1:]}; both sides must match"
        )
    private = private_copy(model)
    if private is None:
        raise InvalidInput(f"{_OPERATION}: the model cannot be copied (copy.deepcopy failed); an operator keeps a copy")
    problem = build_problem(private, first_t, None, params=call.spec.params, dtype=compute_dtype)
    item = problem.itemsize
    n, m = rows.shape[0], cols.shape[0]
    # as ntk_operator: the parameter-space vectors, v and the outputs; per example its input and activations
    fixed = 3 * problem.num_params * item + (n + m) * problem.k * item * 3
    input_bytes = item * max(1, int(torch.tensor(rows.shape[1:]).prod()) if rows.shape[1:] else 1)
    per_example = 2 * problem.saved_bytes + 4 * problem.k * item + input_bytes
    fits = int((budget - fixed) // per_example) if budget > fixed else 0
    if fits < 1:
        needed = int(fixed + per_example)
        raise MemoryEstimateExceeded(
            f"{_OPERATION}: one product needs at least {format_bytes(needed)} (P={problem.num_params}, N={n}, M={m}, "
            f"k={problem.k}), over the memory budget of {format_bytes(budget)}; use a parameter subset or a larger "
            "budget",
            estimate_bytes=needed,
            budget_bytes=budget,
        )
    chunk = min(fits, examples_per_chunk, max(n, m))
    sides = _Sides(problem, rows, cols, chunk, int(fixed + chunk * per_example))  # type: ignore[arg-type]
    return NtkOperator(sides, call.spec.mode, transposed=False, symmetric=x2 is None)
