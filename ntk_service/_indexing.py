"""Indexing a kernel result block by block, where it lies on disk (``jobs/view.py``) or on a server
(``client/_results.py``): a key's parts with ``...`` expanded, and the row groups a stepped read takes.

Torch-free (numpy is not needed either), so the client imports it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["expand_key", "row_groups"]


def expand_key(key: Any, ndim: int, *, owner: str) -> tuple[Any, ...]:
    """The parts of an index key over ``ndim`` axes, ``...`` expanded to whole slices (missing trailing axes are
    left to the caller).

    Raises:
        IndexError: more parts than axes (``owner`` starts the message).
    """
    parts = key if isinstance(key, tuple) else (key,)
    if any(p is Ellipsis for p in parts):
        at = parts.index(Ellipsis)
        parts = parts[:at] + (slice(None),) * (ndim - len(parts) + 1) + parts[at + 1 :]
    if len(parts) > ndim:
        raise IndexError(f"{owner}: {len(parts)} indices for a result of {ndim} dimensions")
    return parts


def row_groups(wanted: range, row_bytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """The row spans ``[lo, hi)`` that read the rows ``wanted`` (a range with a step ≥ 1), each span at most about
    ``block_bytes`` (and never fewer than one wanted row), so ``result[::100]`` never holds the whole bounding
    block; ``span[::wanted.step]`` of each is its wanted rows.

    Args:
        wanted: the rows asked for. row_bytes: the bytes of one row (≥ 1). block_bytes: the read's size cap.

    Returns:
        The spans in order; empty when ``wanted`` is.
    """
    per_read = (max(1, block_bytes // row_bytes) - 1) // wanted.step + 1  # wanted rows per read, ≥ 1
    return [(start, min(start + (per_read - 1) * wanted.step + 1, wanted.stop)) for start in wanted[::per_read]]
