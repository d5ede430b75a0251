"""The inputs of a kernel call as tensors: the compute dtype resolved, x1 and x2 checked (a batch, not empty,
finite, one per-example shape, both float or both integer); a tuple or mapping of inputs checked leaf by leaf as a
``Batch`` (``batch.py``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ntk_service.errors import EmptyBatch, InvalidInput, NonFiniteInput, ShapeMismatch
from ntk_service.kernels.problem.batch import Batch, as_batch, check_sides, is_batch

__all__ = ["validate_inputs"]


def validate_inputs(
    module: nn.Module, x1: object, x2: object | None, dtype: torch.dtype | str | None
) -> tuple[torch.dtype, Batch, Batch | None]:
    """The compute dtype and the inputs as tensors: x1 (N, *input), x2 (M, *input) or None (see
    ``prepare_problem``); a tuple or mapping of inputs as a ``Batch`` of such leaves (``batch.as_batch``)."""
    compute_dtype = _resolve_dtype(module, dtype)
    if is_batch(x1) or is_batch(x2):
        b1 = as_batch(x1, "x1", compute_dtype) if is_batch(x1) else _as_input(x1, "x1", compute_dtype)
        if x2 is None:
            return compute_dtype, b1, None
        b2 = as_batch(x2, "x2", compute_dtype) if is_batch(x2) else _as_input(x2, "x2", compute_dtype)
        return compute_dtype, b1, check_sides(b1, b2)
    x1t = _as_input(x1, "x1", compute_dtype)
    x2t = None if x2 is None else _as_input(x2, "x2", compute_dtype)
    if x2t is not None:
        if x2t.shape[1:] != x1t.shape[1:]:
            raise ShapeMismatch(
                f"compute_ntk: x2 has per-example shape {tuple(x2t.shape[1:])}, x1 has {tuple(x1t.shape[1:])}; "
                "both sides must have the same per-example shape"
            )
        if x2t.is_floating_point() != x1t.is_floating_point():
            raise ShapeMismatch(
                f"compute_ntk: x1 is {x1t.dtype} but x2 is {x2t.dtype}; pass both as float or both as int"
            )
    return compute_dtype, x1t, x2t


def _resolve_dtype(module: nn.Module, dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        resolved = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
    elif isinstance(dtype, str):
        resolved = {"float32": torch.float32, "float64": torch.float64}.get(dtype, None)  # type: ignore[assignment]
        if resolved is None:
            raise InvalidInput(f"compute_ntk: dtype {dtype!r} is not supported; expected 'float32' or 'float64'")
    else:
        resolved = dtype
    if resolved not in (torch.float32, torch.float64):
        raise InvalidInput(f"compute_ntk: dtype {resolved} is not supported; expected torch.float32 or torch.float64")
    return resolved


def _as_input(x: object, name: str, dtype: torch.dtype) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.ndim == 0:
        raise ShapeMismatch(f"compute_ntk: {name} must have a batch dimension (N, *input), got a scalar")
    if t.shape[0] == 0:
        raise EmptyBatch(f"compute_ntk: {name} is an empty batch (shape {tuple(t.shape)}); pass at least one example")
    if t.is_floating_point():
        # one reduction in the input's own dtype instead of an elementwise test: a NaN or inf element always makes
        # the sum non-finite; a finite sum that overflows is a false alarm the exact test below clears
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0])
            raise NonFiniteInput(f"compute_ntk: {name} contains NaN or inf (first in example {bad}); clean the inputs")
        return t.to(dtype)
    if t.is_complex() or t.dtype == torch.bool:
        raise ShapeMismatch(f"compute_ntk: {name} has dtype {t.dtype}; expected a float or integer tensor")
    return t.to(torch.int64)
