"""Deprecated home of the parameter groups, now ``ntk_service.kernels.groups`` (an engine primitive, below
``api.py``); each name read here warns ``DeprecationWarning`` (kept for one release)."""

from __future__ import annotations

from ntk_service.kernels import groups as _home
from ntk_service.kernels._moved import moved

__getattr__ = moved(__name__, _home.__name__, _home.__all__)
