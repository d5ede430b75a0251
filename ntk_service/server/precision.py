"""A kernel response says when float64 inputs were computed in float32 (``note``), and what to send instead.

The compute dtype is the request's ``dtype`` (float32 unless asked), not the inputs': a float64 array sent without
``dtype="float64"`` is cast to float32 on the way into the engine, and the kernel carries float32 rounding (about
1e-7 relative, docs/concepts.md). That is a fine default for most kernels, so it is not refused; it is said.

    >>> downcast_note({"x1": np.zeros((2, 3)), "x2": None}, "float32")
    'x1 was sent as float64 and computed in float32 (the request\\'s dtype, float32 unless given); ...'
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["downcast_note"]


def _float64(array: np.ndarray | Mapping[str, np.ndarray]) -> bool:
    leaves = array.values() if isinstance(array, Mapping) else (array,)
    return any(leaf.dtype == np.float64 for leaf in leaves)


def downcast_note(sides: Mapping[str, np.ndarray | Mapping[str, np.ndarray] | None], computed: str) -> str | None:
    """The note for a response computed in ``computed`` from these inputs, or None when nothing was lost.

    Args:
        sides (Mapping): side name ("x1", "x2") -> its array or named arrays (None: absent).
        computed (str): the dtype the kernel was computed in ("float32" or "float64").

    Returns:
        str | None: which sides were float64 and how to keep float64, when ``computed`` is float32.
    """
    if computed != "float32":
        return None
    wide = [name for name, array in sides.items() if array is not None and _float64(array)]
    if not wide:
        return None
    which = " and ".join(wide)
    return (
        f"{which} {'was' if len(wide) == 1 else 'were'} sent as float64 and computed in float32 (the request's "
        'dtype, float32 unless given); send dtype="float64" to compute in float64 (client.ntk(..., '
        'dtype="float64"), ntk-service kernel --dtype float64)'
    )
