"""Deprecated aliases for names that moved to another module (kept one release after a move).

A module that lost names sets ``__getattr__ = moved(__name__, "new.home", names)`` (PEP 562): reading one of them
there warns ``DeprecationWarning`` naming the new home and returns the new home's object; the new home is imported
on first use, so the old module imports nothing from it (the layers stay as they are).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["moved"]


def moved(old: str, new: str, names: Iterable[str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of module ``old`` for ``names``, which now live in module ``new``."""
    known = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name not in known:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} is deprecated and will be removed in the next release; use {new}.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    return __getattr__
