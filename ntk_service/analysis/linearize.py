"""The linearized network as a trainable module: f_lin(x) = f(x; θ0) + J(x; θ0)(θ − θ0), and its Taylor series.

``linearize(model)`` and ``taylor_expand(model, order)`` return an ``nn.Module`` whose parameters are exactly θ:
the model's trainable parameters (those matched by ``params=``), under the model's dotted names and in its
``named_parameters()`` order, initialized at θ0. Train it with any optimizer, loss and data loader; the model
itself is never touched.

NOTE [parameter mirror]
    ``nn.Module`` names cannot contain '.', so a flat ``ParameterDict`` cannot carry names like ``0.weight``. The
    expansion instead grows a tree of empty holder modules that mirrors the model's module tree (built by walking
    ``named_modules()`` in order, registering each module's own parameters in its ``_parameters`` order), so
    ``named_parameters()``, ``state_dict()`` and ``load_state_dict()`` see the model's names and order for free.
    A tied weight is held once, under its first name (as ``named_parameters()`` lists it); ``functional_call``
    ties the other names to it. θ0, the frozen parameters and the buffers are plain tensors held outside the
    module tree (copies taken at construction, so training the model in place later does not move them), and the
    base network is a private eval-mode structural copy: none of them is a parameter or buffer of the expansion.
    ``.to()`` / ``.double()`` move them along with θ (``_apply``).

NOTE [nested jvp]
    With Δ = θ − θ0, f(θ0 + Δ) = Σ_j D^j f(θ0)[Δ, …, Δ] / j!. One ``torch.func.jvp`` of f at θ0 along Δ returns
    (f(θ0), Df[Δ]); a jvp of that pair returns (f, Df[Δ]) and (Df[Δ], D²f[Δ, Δ]); after ``order`` nestings
    every term up to D^order f[Δ^order] is at hand. Autograd differentiates through the tangents, so
    ``loss.backward()`` reaches θ. Cost of order 1 (``linearize``): one primal and one tangent pass, about two
    forward passes in time and in activation memory; order n costs about 2^n forward passes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, jvp

from ntk_service.errors import InvalidInput, NoMatchingParameters, UnsupportedModel, operation_name
from ntk_service.kernels.problem.math_attention import attention_scope
from ntk_service.kernels.problem.outputs import OutputPath, select_output
from ntk_service.kernels.problem.parameter_selection import select_parameters
from ntk_service.kernels.problem.private_module import eval_semantics, private_copy

__all__ = ["TaylorExpansion", "linearize", "outputs_float64", "taylor_expand"]

MAX_ORDER = 4
"""Highest Taylor order accepted: the nested jvp costs ~2^order forward passes, and beyond 4 terms the series of a
network is rarely what anyone wants to train."""

_Fn = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]


class _ParameterHolder(nn.Module):
    """An empty module in the mirror tree of NOTE [parameter mirror]; it only holds parameters and children."""


class TaylorExpansion(nn.Module):
    """f(x; θ0) + Σ_{j=1}^{order} D^j f(x; θ0)[θ − θ0]^j / j!, trainable in θ (``linearize``: order 1).

    Build it with ``linearize`` or ``taylor_expand``. Attributes: ``order``; ``expanded_names`` (the parameters
    that move, in order); ``frozen_names`` (parameters held at θ0). ``forward(x)`` takes a batch like the model
    and returns the model's output shape. ``theta0()`` returns a copy of the expansion point.
    """

    def __init__(
        self, model: nn.Module, *, order: int, params: Sequence[str] | None, operation: str = "TaylorExpansion"
    ) -> None:
        super().__init__()
        with operation_name(operation):  # the checks below raise their details; this names them
            self._build(model, order, params)

    def _build(self, model: nn.Module, order: int, params: Sequence[str] | None) -> None:
        if not isinstance(model, nn.Module):
            raise UnsupportedModel(detail=f"model must be a torch.nn.Module, got {type(model).__name__}")
        base = private_copy(model)
        named = dict(model.named_parameters())
        try:
            selected = select_parameters(model, params)
        except NoMatchingParameters as exc:  # the engine's message names compute_ntk: name this call instead
            raise NoMatchingParameters(detail=exc.message.removeprefix("compute_ntk: ")) from exc
        trainable = [name for name in selected if named[name].requires_grad]
        if not trainable:
            raise InvalidInput(
                detail="no trainable parameter to expand in; every selected parameter has requires_grad=False "
                "(set requires_grad=True on the ones to train, or widen params=)"
            )
        self.order = order
        self.expanded_names: tuple[str, ...] = tuple(trainable)
        self.frozen_names: tuple[str, ...] = tuple(name for name in named if name not in set(trainable))
        # Outside the module tree on purpose (NOTE [parameter mirror]): plain dicts of detached copies.
        self._lin_base: list[nn.Module] = [base if base is not None else model]
        self._lin_copyable = base is not None
        self._lin_theta0 = {name: named[name].detach().clone() for name in trainable}
        self._lin_frozen = {name: named[name].detach().clone() for name in self.frozen_names}
        self._lin_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        self._mirror(model, trainable)

    def _mirror(self, model: nn.Module, trainable: list[str]) -> None:
        wanted = set(trainable)
        holders: dict[str, nn.Module] = {"": self}
        for path, module in model.named_modules():
            for local in module._parameters:
                full = f"{path}.{local}" if path else local
                if full not in wanted:
                    continue
                holder = self._holder(holders, path)
                try:
                    holder.register_parameter(local, nn.Parameter(self._lin_theta0[full].clone()))
                except KeyError as exc:
                    raise UnsupportedModel(
                        detail=f"the model's parameter {full!r} clashes with an attribute of the expansion "
                        "module; rename it in the model"
                    ) from exc
                wanted.discard(full)

    @staticmethod
    def _holder(holders: dict[str, nn.Module], path: str) -> nn.Module:
        if path in holders:
            return holders[path]
        parent_path, _, local = path.rpartition(".")
        parent = TaylorExpansion._holder(holders, parent_path)
        holder = _ParameterHolder()
        try:
            parent.add_module(local, holder)
        except KeyError as exc:
            raise UnsupportedModel(
                detail=f"the model's submodule {path!r} clashes with an attribute of the expansion module; "
                "rename it in the model"
            ) from exc
        holders[path] = holder
        return holder

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TaylorExpansion:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for store in (self._lin_theta0, self._lin_frozen, self._lin_buffers):
            for name, tensor in store.items():
                store[name] = fn(tensor)
        return self

    def extra_repr(self) -> str:
        return f"order={self.order}, expanded={len(self.expanded_names)}, frozen={len(self.frozen_names)}"

    def theta0(self) -> dict[str, torch.Tensor]:
        """The expansion point θ0, {name: tensor} in ``expanded_names`` order (copies)."""
        return {name: t.clone() for name, t in self._lin_theta0.items()}

    def _series(self, x: Any) -> _Fn:
        """θ0 ↦ (f, Df[Δ], …, D^order f[Δ^order]) at this x, Δ = θ − θ0 (NOTE [nested jvp])."""
        theta = dict(self.named_parameters())
        delta = {name: theta[name] - self._lin_theta0[name] for name in self._lin_theta0}
        base = self._lin_base[0]
        constants = {**self._lin_frozen, **self._lin_buffers}

        def f(primals: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return (functional_call(base, {**constants, **primals}, (x,)),)

        series: _Fn = f
        for _ in range(self.order):
            series = _one_more_term(series, delta)
        return series

    def forward(self, x: Any) -> torch.Tensor:
        """The expansion's output at the batch ``x`` (the model's output shape)."""
        base = self._lin_base[0]
        # fused attention kernels have no forward-mode AD: attention runs on its math path (problem/math_attention.py)
        with attention_scope(base), contextlib.nullcontext() if self._lin_copyable else eval_semantics(base):
            terms = self._series(x)(self._lin_theta0)
        out = terms[0]
        for j, term in enumerate(terms[1:], start=1):
            out = out + term / math.factorial(j)
        return out


def _one_more_term(series: _Fn, delta: dict[str, torch.Tensor]) -> _Fn:
    def deeper(primals: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        values, tangents = jvp(series, (primals,), (delta,))[:2]
        return (*values, tangents[-1])

    return deeper


def linearize(model: nn.Module, params: Sequence[str] | None = None) -> TaylorExpansion:
    """The linearized network f_lin(x) = f(x; θ0) + J(x; θ0)(θ − θ0) as a trainable ``nn.Module``, by one jvp.

    Args:
        model (nn.Module): the network; θ0 = its current parameters, copied (later changes to the model do not
            move the expansion). It runs in eval semantics: dropout off, BatchNorm on its running statistics
            (the buffers, copied too), even where the model is in train mode. Attention modules run on their math
            path (fused attention kernels have no forward-mode AD; ``kernels/problem/math_attention.py``).
        params (list of str | None): glob patterns of the parameters that move (e.g. ``["2.*"]``); the others,
            and every parameter with ``requires_grad=False``, stay at θ0 and are not parameters of the result.
            Default: None (all trainable parameters).

    Returns:
        TaylorExpansion of order 1: ``parameters()`` / ``named_parameters()`` are θ, the model's names and order,
        initialized at θ0; ``forward(x)`` returns the model's output shape, e.g. (N, k).

    Raises:
        NoMatchingParameters: a glob that matches nothing. InvalidInput: nothing trainable selected.
        UnsupportedModel: see ``compute_ntk`` (e.g. BatchNorm that cannot run in eval semantics).

    Cost: time and activation memory of about two forward passes per call (NOTE [nested jvp]); θ0 is stored
    once more (P floats).

        >>> flin = linearize(model)                                   # doctest: +SKIP
        >>> opt = torch.optim.SGD(flin.parameters(), lr=0.1)          # trains θ alone   # doctest: +SKIP
        >>> flin(x).shape                                             # (N, k)           # doctest: +SKIP
    """
    return TaylorExpansion(model, order=1, params=params, operation="linearize")


def taylor_expand(model: nn.Module, order: int = 2, params: Sequence[str] | None = None) -> TaylorExpansion:
    """f(x; θ0) + J Δ + ½ Δᵀ∇²f Δ + … up to ``order``, Δ = θ − θ0, by nested jvp; the contract of ``linearize``.

    Args:
        model (nn.Module): as ``linearize``.
        order (int): 1 ≤ order ≤ MAX_ORDER (4); 1 is ``linearize``. Default: 2.
        params (list of str | None): as ``linearize``. Default: None.

    Returns:
        TaylorExpansion of that order (its ``forward(x)`` has the model's output shape).

    Raises:
        InvalidInput: an order outside 1…4; otherwise as ``linearize``.

    Cost: about 2^order forward passes per call.

        >>> quad = taylor_expand(model, order=2)                      # doctest: +SKIP
        >>> quad(x).shape                                             # (N, k)           # doctest: +SKIP
    """
    if isinstance(order, bool) or not isinstance(order, int) or not 1 <= order <= MAX_ORDER:
        raise InvalidInput(f"taylor_expand: order must be an integer from 1 to {MAX_ORDER}, got {order!r}")
    return TaylorExpansion(model, order=order, params=params, operation="taylor_expand")


def outputs_float64(
    model: nn.Module,
    x: torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor],
    *,
    output: OutputPath | None = None,
) -> np.ndarray:
    """f(x; θ0) in float64, (N, k): the linearized network's f0 at the model's parameters, computed on float64
    copies of its tensors (the model itself, which may be shared, is never touched or converted).

    Args:
        model (nn.Module): the network, in the mode it is in (the registry's modules are in eval mode).
        x (Tensor, tuple or mapping): (N, *input), or forward's positional / keyword inputs; float leaves are
            converted to float64, integer leaves (token ids) are passed as they are.
        output (OutputPath, optional): which tensor of forward's return value is f (``problem/outputs.py``).
            Default: None (forward returns a tensor).

    Returns:
        ndarray (N, k) float64, k = the selected output's size per example.

    Raises:
        InvalidInput: ``output`` does not select a tensor from what forward returned.
    """
    tensors = {
        name: t.detach().to(torch.float64) if t.is_floating_point() else t.detach()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }

    def f64(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float64) if t.is_floating_point() else t

    if isinstance(x, dict):
        args: tuple[Any, ...] = ()
        kwargs = {key: f64(t) for key, t in x.items()}
    else:
        args, kwargs = tuple(f64(t) for t in (x if isinstance(x, tuple) else (x,))), {}
    n = int(next(iter(kwargs.values())).shape[0]) if kwargs else int(args[0].shape[0])
    with torch.no_grad():
        out = select_output(functional_call(model, tensors, args, kwargs), output, "outputs_float64")
    return np.asarray(out.reshape(n, -1).cpu().numpy(), dtype=np.float64)
