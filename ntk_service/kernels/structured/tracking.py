"""Which tensors of one forward follow from the selected parameters, and how: the ``ParamMap`` of every tensor a
parameter reaches through *derivations* (a scale by a number, a transpose, a view, a slice, a split), so a rule can
read ``F.linear(x, w.t() * 0.5)`` or ``self.position[:T]`` as a use of the parameter itself.

    >>> tracker = ParameterTracker({"w": w}, exact=True)
    >>> out = torch.t(w); tracker.derive(OPS[torch.t], OPS[torch.t].bind((w,), {}), torch.t, (w,), {}, out)
    >>> tracker(out).index.shape       # (in, out): the element of w each element of w.t() is

A derivation is a linear, element-moving map of one tracked tensor (plus constants); the map it makes records
the scale and, when ``exact``, where each element comes from (``ParamMap.index``: an int64 tensor made by the
same op applied to the parameter's element indices). The capture only needs to know *that* a tensor is tracked
(``exact=False``: no index tensors are made there). Anything else a tracked tensor enters is a use of the
parameter, which a rule covers or the Jacobian path takes (NOTE [covered parameters] in coverage.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ntk_service.kernels.structured.ops import Op
from ntk_service.kernels.structured.rules import ParamMap

__all__ = ["DERIVATIONS", "ParameterTracker"]

_VIEWS = frozenset(
    {"t", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze", "flatten", "identity", "getitem"}
    | {"slice", "select", "narrow", "split", "chunk"}
)
"""Families that move a tensor's elements (views and copies): the index map follows them."""

_ARITHMETIC = frozenset({"mul", "div", "neg", "add", "sub", "rsub"})
"""Families that are derivations when their other operand is a number (a scale, or a constant added)."""

DERIVATIONS = _VIEWS | _ARITHMETIC
"""Every op family a derivation may take (arithmetic only with a number as the other operand)."""


def _number(value: object) -> float | None:
    """A Python number operand as a float (None for a tensor, a bool or anything else)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class ParameterTracker:
    """The tensors of one forward that follow from the selected parameters.

    Args:
        params: name -> tensor, the selected parameters as the forward sees them (one object may be listed under
            its canonical name only; every object the model may read them as, e.g. a module's own parameters
            next to the problem's tensors, under the same name).
        exact: make the index maps of views (the structure probe); False: track only (the capture).
    """

    def __init__(self, params: Mapping[str, torch.Tensor] | Mapping[str, list[torch.Tensor]], *, exact: bool) -> None:
        self.exact = exact
        self._maps: dict[int, tuple[object, ParamMap]] = {}  # id -> (the tensor, kept alive; its map)
        for name, tensors in params.items():
            for t in tensors if isinstance(tensors, list) else [tensors]:
                self._maps[id(t)] = (t, ParamMap(name, t.numel()))

    def __call__(self, value: object) -> ParamMap | None:
        """The map of a tracked tensor, else None."""
        entry = self._maps.get(id(value))
        return None if entry is None else entry[1]

    def tracked_leaves(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[ParamMap]:
        """The maps of every tracked tensor among a call's arguments and in the lists among them (a plain scan:
        it runs for every op the capture sees)."""
        maps = self._maps
        found = []
        for value in (*args, *kwargs.values()):
            for leaf in value if type(value) in (list, tuple) else (value,):
                entry = maps.get(id(leaf))
                if entry is not None:
                    found.append(entry[1])
        return found

    def derive(
        self,
        op: Op,
        bound: Mapping[str, Any],
        func: Any,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        out: object,
    ) -> bool:
        """Track ``out`` when the call derives it from one tracked tensor; whether it did.

        Args:
            op: the call's op; bound: its arguments by name; func, args, kwargs: the call; out: what it returned.
        """
        family = op.family
        if family not in DERIVATIONS:
            return False
        if family in _ARITHMETIC:
            return self._arithmetic(family, bound, out)
        source = bound.get("input")
        mp = self(source)
        if mp is None or not isinstance(source, torch.Tensor):
            return False
        rest = [v for k, v in bound.items() if k != "input"]
        if any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(rest)[0]):
            return False  # indexed by a tensor (a gather) or sized by one: not a plain view
        outs = [o for o in (out if isinstance(out, tuple | list) else [out]) if isinstance(o, torch.Tensor)]
        if len(outs) != (len(out) if isinstance(out, tuple | list) else 1):
            return False
        if not self.exact:
            for o in outs:
                self._maps[id(o)] = (o, mp)
            return True
        base = mp.index if mp.index is not None else torch.arange(mp.numel).view(source.shape)
        position = op.names.index("input")
        try:
            moved = func(*args[:position], base, *args[position + 1 :], **kwargs) if position < len(args) else None
            if moved is None:
                moved = func(*args, **{**kwargs, "input": base})
        except Exception:  # the op does not apply to the index tensor (e.g. a view of incompatible strides)
            return False
        moved_list = list(moved) if isinstance(moved, tuple | list) else [moved]
        if len(moved_list) != len(outs):
            return False
        for o, index in zip(outs, moved_list, strict=True):
            if not isinstance(index, torch.Tensor) or tuple(index.shape) != tuple(o.shape):
                return False
            plain = index.numel() == mp.numel and torch.equal(index.reshape(-1), torch.arange(mp.numel))
            self._maps[id(o)] = (o, ParamMap(mp.name, mp.numel, mp.scale, None if plain else index))
        return True

    def _arithmetic(self, family: str, bound: Mapping[str, Any], out: object) -> bool:
        """mul/div by a number (a scale), neg, add/sub/rsub of a number (the same map, or its negative)."""
        if not isinstance(out, torch.Tensor):
            return False
        left, right, alpha = bound.get("input"), bound.get("other"), _number(bound.get("alpha", 1))
        mp_left, mp_right = self(left), self(right)
        number_left, number_right = _number(left), _number(right)
        factor: float | None = None
        if family == "neg":
            mp, factor = mp_left, -1.0
        elif mp_left is not None and number_right is not None and alpha is not None:
            mp = mp_left
            if family == "mul":
                factor = number_right
            elif family == "div" and number_right != 0.0 and bound.get("rounding_mode") is None:
                factor = 1.0 / number_right
            elif family in ("add", "sub"):
                factor = 1.0
            elif family == "rsub":  # other − α·input
                factor = -alpha
        elif mp_right is not None and number_left is not None and alpha is not None:
            mp = mp_right
            factor = {"mul": number_left, "add": alpha, "sub": -alpha, "rsub": 1.0}.get(family)  # not div: 1/p
        else:
            return False
        if mp is None or not factor:
            return False
        self._maps[id(out)] = (out, mp.scaled(factor))
        return True
