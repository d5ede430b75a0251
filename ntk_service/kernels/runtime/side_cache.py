"""An LRU cache of per-side intermediates (Jacobians, VJP rows, ...) bounded in bytes.

A service answering repeated kernels against the same data set (x2 = a stored data set, x1 = new points) keeps
the data-set side and computes only the new one. The caller names each side's content with a key that must
identify the model version and the inputs (e.g. ``("mnist-mlp", 3, "ds_ab12", 0, 512)``); the engine adds the
implementation, parameter selection, dtype and block range.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

from ntk_service.kernels.algorithm import Side, side_nbytes

__all__ = ["SideCache"]


class SideCache:
    """Thread-safe LRU of sides, evicting least recently used entries beyond ``max_bytes``.

    Args:
        max_bytes: total bytes of cached tensors; a side larger than this is never cached.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Side, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Side | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, side: Side) -> None:
        size = side_nbytes(side)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._bytes -= self._entries.pop(key)[1]
            self._entries[key] = (side, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
