"""Checkpoints onto the model, and the model's weighted output function Σ_a w_a f_a as a module.

A checkpoint is a state dict (name -> tensor) of the model's architecture: each is checked against the model's own
``state_dict()`` (names, shapes, finite floats) and loaded into a private copy, so the caller's module is never
touched. ``OutputFunction`` wraps a model so that the weights w (N, k) travel as one more input: the NTK engine then
sketches or contracts one row per example (k = 1) instead of k, which for cross-entropy's single margin row makes
the features k times cheaper than contracting all outputs afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ntk_service.errors import IncompatibleCheckpoint, NonFiniteInput, UnsupportedModel
from ntk_service.kernels.problem.private_module import check_model

__all__ = ["WEIGHTS_KEY", "AllOutputs", "OutputFunction", "load_checkpoint", "weighted_inputs"]

WEIGHTS_KEY = "attribution_output_weights"
"""The keyword that carries w for a model called with keyword inputs (a mapping x)."""


def load_checkpoint(model: nn.Module, checkpoint: Mapping[str, Any] | None, *, index: int, operation: str) -> nn.Module:
    """An eval-mode copy of ``model`` holding ``checkpoint``'s weights (the model's own for None).

    Raises:
        UnsupportedModel: not an nn.Module, or BatchNorm in train mode (``check_model``).
        IncompatibleCheckpoint: a checkpoint that is not a mapping of tensors, or whose names or shapes differ from
            the model's (the message lists the first few differences).
        NonFiniteInput: NaN or inf in a checkpoint's floating-point tensors.
    """
    check_model(model)
    if checkpoint is None:
        state = None
    else:
        state = _check_state(model, checkpoint, index=index, operation=operation)
    try:
        private = copy.deepcopy(model)
    except Exception as exc:  # a module holding something uncopyable
        raise UnsupportedModel(f"{operation}: the model cannot be copied ({type(exc).__name__}: {exc})") from exc
    if state is not None:
        private.load_state_dict(state, strict=True)
    for p in private.parameters():
        p.requires_grad_(False)
    return private.eval()


def _check_state(model: nn.Module, checkpoint: Mapping[str, Any], *, index: int, operation: str) -> dict[str, Any]:
    where = f"{operation}: checkpoint {index}"
    if not isinstance(checkpoint, Mapping):
        raise IncompatibleCheckpoint(
            f"{where} is a {type(checkpoint).__name__}; expected a state dict (name -> tensor), e.g. model.state_dict()"
        )
    expected = model.state_dict()
    missing = [name for name in expected if name not in checkpoint]
    unexpected = [name for name in checkpoint if name not in expected]
    shapes = []
    for name, ref in expected.items():
        value = checkpoint.get(name)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise IncompatibleCheckpoint(f"{where}: '{name}' is a {type(value).__name__}, expected a tensor")
        if tuple(value.shape) != tuple(ref.shape):
            shapes.append(f"'{name}' has shape {tuple(value.shape)}, the model's {tuple(ref.shape)}")
        elif value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise NonFiniteInput(f"{where}: '{name}' contains NaN or inf")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {_first(missing)}")
        if unexpected:
            parts.append(f"unexpected {_first(unexpected)}")
        if shapes:
            parts.append("; ".join(shapes[:3]) + (f" (and {len(shapes) - 3} more)" if len(shapes) > 3 else ""))
        raise IncompatibleCheckpoint(
            f"{where} does not fit the model ({type(model).__name__}): {'; '.join(parts)}. Pass state dicts of "
            "this architecture (model.state_dict() of the trained copies)"
        )
    return dict(checkpoint)


def _first(names: Sequence[str], count: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:count])
    return f"[{shown}{', ...' if len(names) > count else ''}] ({len(names)})"


class OutputFunction(nn.Module):
    """Σ_a w_a f_a(x) per example, shape (N, 1), with the weights w (N, k) as the last input (or ``WEIGHTS_KEY``).

    The model's parameters appear under the prefix ``model.``; the weights are data, never differentiated.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        w: torch.Tensor
        if WEIGHTS_KEY in kwargs:
            w = kwargs.pop(WEIGHTS_KEY)
        else:
            *rest, w = args
            args = tuple(rest)
        out: torch.Tensor = self.model(*args, **kwargs)
        return (out.reshape(out.shape[0], -1) * w).sum(dim=1, keepdim=True)


class AllOutputs(nn.Module):
    """The model's outputs flattened per example, (N, k), with its parameters under the same ``model.`` prefix as
    ``OutputFunction``'s: a sketch draws the same matrices for both (NOTE [sketch determinism] draws by name)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = self.model(*args, **kwargs)
        return out.reshape(out.shape[0], -1)


def weighted_inputs(x: Any, w: torch.Tensor) -> Any:
    """``OutputFunction``'s inputs: (x, w) for a tensor, (*x, w) for a tuple, {**x, WEIGHTS_KEY: w} for a mapping."""
    if isinstance(x, Mapping):
        return {**x, WEIGHTS_KEY: w}
    if isinstance(x, tuple | list):
        return (*x, w)
    return (x, w)
