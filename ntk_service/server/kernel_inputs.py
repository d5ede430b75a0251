"""The old home of reading and computing a request, split into ``reading.py`` (the body: sides, the kernel
request's two values), ``computing.py`` (the record, the sides loaded, the engine run under the limiter) and
``registry/input_contract.py`` (what a model takes: ``check_input``, ``check_output``).

Nothing in the package imports it any more. Its names stay importable for one release, each with a
DeprecationWarning naming its new home: the four helpers keep their old signatures (they take ``operation=`` and
name their errors with it, where the new homes leave that to the caller's boundary, NOTE [operation names] in
errors.py); every other old name resolves to the new object itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from fastapi import Request

from ntk_service.errors import operation_name
from ntk_service.registry import ModelRecord, input_contract
from ntk_service.registry.input_contract import NamedArrays
from ntk_service.server import computing, media, reading

__all__ = ["check_budget", "check_input", "read_object", "run_model"]

T = TypeVar("T")


def _deprecated(name: str, where: str) -> None:
    warnings.warn(
        f"ntk_service.server.kernel_inputs.{name} is deprecated; import it from {where}",
        DeprecationWarning,
        stacklevel=3,
    )


def check_input(array: np.ndarray | NamedArrays, record: ModelRecord, *, side: str, operation: str) -> None:
    """``registry.input_contract.check_input``, its errors named ``operation``. Deprecated."""
    _deprecated("check_input", "ntk_service.registry.input_contract (its caller names the operation)")
    with operation_name(operation):
        input_contract.check_input(array, record, side=side)


def check_budget(estimate: int, budget: int | None, *, what: str, operation: str) -> None:
    """``computing.check_budget``, its refusal named ``operation``. Deprecated."""
    _deprecated("check_budget", "ntk_service.server.computing (its caller names the operation)")
    with operation_name(operation):
        computing.check_budget(estimate, budget, what=what)


def run_model(fn: Callable[[], T], *, record: ModelRecord, operation: str, device: str = "cpu") -> tuple[T, float]:
    """``computing.run_model``, its errors named ``operation``. Deprecated."""
    _deprecated("run_model", "ntk_service.server.computing (its caller names the operation)")
    with operation_name(operation):
        return computing.run_model(fn, record=record, device=device)


async def read_object(request: Request, *, operation: str, expected: str = "") -> dict[str, Any]:
    """``reading.read_object``, its errors named ``operation``. Deprecated."""
    _deprecated("read_object", "ntk_service.server.reading (its caller names the operation)")
    with operation_name(operation):
        return await reading.read_object(request, expected=expected)


_MOVED = {
    **{name: ("ntk_service.server.reading", reading) for name in ("INPUT_NAME", "SideSource", "parse_side")},
    **{name: ("ntk_service.server.reading", reading) for name in ("parse_sides", "split_sides")},
    **{
        name: ("ntk_service.server.computing", computing)
        for name in ("ComputeContext", "ComputeContextDep", "KernelInput", "answer_json", "from_dataset", "inline")
    },
    **{name: ("ntk_service.server.computing", computing) for name in ("load_side", "load_sides")},
    "MIN_JSON_BYTES_PER_VALUE": ("ntk_service.server.media", media),
}
"""Old names whose meaning did not change -> their new module."""


def __getattr__(name: str) -> Any:
    """A moved name, with a DeprecationWarning naming its new home (kept for one release)."""
    if name in _MOVED:
        where, module = _MOVED[name]
        warnings.warn(
            f"ntk_service.server.kernel_inputs.{name} is deprecated; import it from {where}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(module, name)
    if name == "Side":
        warnings.warn(
            "ntk_service.server.kernel_inputs.Side is deprecated; use ntk_service.server.reading.SideSource "
            "(kernels.algorithm.Side is the engine's per-block intermediates, an unrelated type)",
            DeprecationWarning,
            stacklevel=2,
        )
        return reading.SideSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
