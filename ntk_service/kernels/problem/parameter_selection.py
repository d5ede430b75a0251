"""Which parameters a kernel differentiates: glob patterns over ``named_parameters()`` names, tied weights once."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from ntk_service.errors import NoMatchingParameters

__all__ = ["select_parameters"]


def select_parameters(module: nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """Names of the parameters matched by glob ``patterns`` (all when None), in ``named_parameters()`` order.

    Tied weights appear once, under their first name.

    Raises:
        NoMatchingParameters: a pattern matches nothing (the message lists the names), or the model has none.
    """
    names = [name for name, _ in module.named_parameters()]
    if not names:
        raise NoMatchingParameters("compute_ntk: the model has no parameters, so its NTK is zero-dimensional")
    if patterns is None:
        return names
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise NoMatchingParameters(f"compute_ntk: params must be a list of glob strings, got {patterns!r}")
    if len(patterns) == 0:
        raise NoMatchingParameters("compute_ntk: params=[] selects nothing; pass None for all parameters")
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise NoMatchingParameters(
                f"compute_ntk: parameter glob {pattern!r} matches no parameter; the model has: {shown}"
            )
    return [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
