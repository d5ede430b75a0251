"""Examples as attribution reads them: inputs by rows, in the compute dtype, and the model's outputs on them.

Inputs are a tensor, a tuple or mapping of tensors (forward's positional or keyword arguments, as for
``compute_ntk``), or a single sliceable array (a numpy memmap, a zarr array) read ``start:stop`` at a time. The
model must return a tensor (N, *out); anything else, or a model that fails on the inputs, is bad input.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ntk_service.attribution.options import AttributionOptions
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch, format_bytes
from ntk_service.kernels.problem.batch import batch_size, is_batch, take
from ntk_service.kernels.runtime.device import default_memory_budget

__all__ = [
    "OPERATION",
    "budget",
    "cast",
    "compute_dtype",
    "engine_params",
    "example_shape",
    "in_dtype",
    "model_outputs",
    "output_shape",
    "refuse",
    "rows",
    "size",
]

OPERATION = "attribution"
"""The operation every message of the package starts with."""


def size(x: Any) -> int:
    """N, the examples of x.

    Raises:
        InvalidInput: x is none of the input kinds (module docstring).
    """
    if is_batch(x):
        return batch_size(x)
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 1:
        raise InvalidInput(
            f"{OPERATION}: inputs must be a tensor, a tuple or mapping of tensors, or a sliceable array (N, *input); "
            f"got {type(x).__name__}"
        )
    return int(shape[0])


def rows(x: Any, start: int, stop: int) -> Any:
    """Examples start:stop of x (views of tensors; a sliceable array reads those rows)."""
    if is_batch(x):
        return take(x, start, stop)
    block = x[start:stop]
    return block if isinstance(block, torch.Tensor) else torch.as_tensor(np.asarray(block))


def compute_dtype(model: nn.Module, options: AttributionOptions) -> torch.dtype:
    """options.dtype, else the model's floating dtype."""
    if options.dtype is not None:
        return torch.float64 if options.dtype == "float64" else torch.float32
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model with floating parameters and buffers in ``dtype`` (a copy when they are not already)."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
        return model
    return copy.deepcopy(model).to(dtype)


def cast(x: Any, dtype: torch.dtype) -> Any:
    """Floating leaves in ``dtype``; integer leaves (ids, masks) unchanged."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    if isinstance(x, Mapping):
        return {name: leaf(t) for name, t in x.items()}
    if isinstance(x, tuple | list):
        return tuple(leaf(t) for t in x)
    return leaf(torch.as_tensor(x))


def _call(model: nn.Module, xb: Any) -> Any:
    with torch.no_grad():
        if isinstance(xb, Mapping):
            return model(**xb)
        if isinstance(xb, tuple):
            return model(*xb)
        return model(xb)


def _tensor(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise InvalidInput(
            f"{OPERATION}: the model returns a {type(out).__name__}; attribution needs a tensor (N, *out) of outputs "
            "(wrap the model so that forward returns e.g. the logits)"
        )
    return out


def model_outputs(model: nn.Module, x: Any, dtype: torch.dtype) -> torch.Tensor:
    """The model's outputs on x, flattened per example: (n, k).

    Raises:
        InvalidInput: the model does not return a tensor.
    """
    out = _tensor(_call(model, cast(x, dtype)))
    return out.reshape(out.shape[0], -1)


def example_shape(x: Any) -> tuple[int, ...] | None:
    """The per-example input shape of a single input (None for a tuple or mapping of inputs)."""
    return None if is_batch(x) else tuple(int(s) for s in x.shape[1:])


def output_shape(model: nn.Module, x: Any, dtype: torch.dtype, name: str) -> tuple[int, ...]:
    """The model's per-example output shape, from one example of x (``name`` for messages).

    Raises:
        ShapeMismatch: the model fails on the example (inputs of another shape or kind).
        InvalidInput: the model does not return a tensor.
    """
    try:
        out = _call(model, cast(rows(x, 0, 1), dtype))
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ShapeMismatch(
            f"{OPERATION}: the model fails on the first example of {name} ({type(exc).__name__}: {first}); pass "
            "inputs of the shape and kind the model takes"
        ) from exc
    return tuple(_tensor(out).shape[1:])


def engine_params(options: AttributionOptions) -> list[str] | None:
    """options.params as globs over the wrappers' names (``checkpoints.OutputFunction``: prefix ``model.``)."""
    return None if options.params is None else [f"model.{g}" for g in options.params]


def budget(options: AttributionOptions) -> int:
    """options.memory_budget_bytes, else ``default_memory_budget()``."""
    return default_memory_budget() if options.memory_budget_bytes is None else options.memory_budget_bytes


def refuse(what: str, needed: int, limit: int, fix: str) -> MemoryEstimateExceeded:
    """The refusal of work estimated at ``needed`` bytes over the budget ``limit``."""
    return MemoryEstimateExceeded(
        f"{OPERATION}: {what} need about {format_bytes(needed)}, over the memory budget of {format_bytes(limit)}; "
        f"{fix}",
        estimate_bytes=needed,
        budget_bytes=limit,
    )
