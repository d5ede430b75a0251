"""The independent float64 reference every implementation is checked against.

A plain loop: for every example and every output, one ``torch.autograd.grad`` of that scalar w.r.t. the selected
parameters builds the row J_a(x) explicitly; then Θ(x1_n, x2_m)[a, b] = J_a(x1_n) · J_b(x2_m). No vmap, no
torch.func, nothing shared with ntk_service.kernels.

Inputs may be a tensor, a tuple of tensors (forward's positional arguments) or a mapping of them (keyword
arguments), each batched on dim 0; the example is sliced out of every leaf by hand. ``output`` is a plain Python
callable from what forward returns to the tensor (1, *out), e.g. ``lambda out: out["logits"][:, 0]``: written by
the test, not parsed by the engine's ``output=`` grammar.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

Inputs = torch.Tensor | tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]


def _example(x: Inputs, i: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) of example i: float leaves in float64, integer leaves unchanged."""

    def one(t: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(t)[i : i + 1]
        return t.double() if t.is_floating_point() else t

    if isinstance(x, Mapping):
        return (), {name: one(t) for name, t in x.items()}
    if isinstance(x, tuple | list):
        return tuple(one(t) for t in x), {}
    return (one(x),), {}


def _size(x: Inputs) -> int:
    if isinstance(x, Mapping):
        return len(next(iter(x.values())))
    if isinstance(x, tuple | list):
        return len(x[0])
    return x.shape[0]


def reference_jacobian(
    model: nn.Module,
    x: Inputs,
    params: Sequence[str] | None = None,
    output: Callable[[Any], torch.Tensor] | None = None,
) -> torch.Tensor:
    """J of each example, float64: (n, k, P), parameters in ``named_parameters()`` order (tied once); ``output``
    picks the tensor from what forward returns (see the module docstring)."""
    model = copy.deepcopy(model).double().eval()
    named = [
        (name, p)
        for name, p in model.named_parameters()
        if params is None or any(fnmatch.fnmatchcase(name, g) for g in params)
    ]
    rows = []
    for i in range(_size(x)):
        args, kwargs = _example(x, i)
        raw = model(*args, **kwargs)
        out = (raw if output is None else output(raw)).reshape(-1)
        per_output = []
        for a in range(out.shape[0]):
            grads = torch.autograd.grad(out[a], [p for _, p in named], retain_graph=True, allow_unused=True)
            per_output.append(
                torch.cat(
                    [
                        (torch.zeros_like(p) if g is None else g).reshape(-1)
                        for (_, p), g in zip(named, grads, strict=True)
                    ]
                )
            )
        rows.append(torch.stack(per_output))
    return torch.stack(rows)


def reference_ntk(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None = None,
    mode: str = "full",
    params: Sequence[str] | None = None,
    output: Callable[[Any], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Θ(x1, x2) in float64 for ``mode`` (a mode's wire value, its entry written out in ``reference_kernel``;
    "pseudo": the FULL kernel summed over both output axes, divided by k); inputs and ``output`` as
    ``reference_jacobian``."""
    j1 = reference_jacobian(model, x1, params, output)
    j2 = j1 if x2 is None else reference_jacobian(model, x2, params, output)
    return reference_kernel(j1, j2, mode)


def reference_kernel(j1: torch.Tensor, j2: torch.Tensor, mode: str = "full") -> torch.Tensor:
    """Θ for ``mode`` (as ``reference_ntk``) from Jacobians j1 (n, k, P) and j2 (m, k, P)."""
    full = torch.einsum("naf,mbf->nmab", j1, j2)
    if mode == "full":
        return full
    if mode == "trace":
        return full.diagonal(dim1=2, dim2=3).sum(-1)
    if mode == "output_diagonal":
        return full.diagonal(dim1=2, dim2=3)
    if mode == "pseudo":
        return full.sum(dim=(2, 3)) / full.shape[2]
    if mode == "example_diagonal":
        return torch.einsum("naf,nbf->nab", j1, j1)
    if mode == "example_output_diagonal":  # ‖J_a(x1_n)‖² per output, written out
        return (j1 * j1).sum(dim=2)
    if mode == "example_trace":  # ‖J(x1_n)‖²_F, written out
        return (j1 * j1).sum(dim=(1, 2))
    raise ValueError(mode)


def reference_columns(model: nn.Module, names: Sequence[str]) -> torch.Tensor:
    """Indices into the P axis of ``reference_jacobian(model, x)`` (all parameters) of the parameters ``names``
    (exact ``named_parameters()`` names; a tied weight under its first name): J restricted to them is
    ``j[..., reference_columns(model, names)]``."""
    cols: list[int] = []
    start = 0
    for name, p in model.named_parameters():
        if name in names:
            cols.extend(range(start, start + p.numel()))
        start += p.numel()
    return torch.tensor(cols, dtype=torch.int64)


def assert_matches(theta: torch.Tensor, expected: torch.Tensor, rel: float = 1e-10) -> None:
    """theta agrees with the reference kernel ``expected``: same shape, max abs error <= rel x max|expected|."""
    assert theta.shape == expected.shape
    scale = expected.abs().max().item()
    assert scale > 0, "a zero reference kernel would make the comparison vacuous"
    err = (theta.double() - expected).abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3e} > {rel:.0e} x max|theta| {scale:.3e}"
