"""ModuleCache: built models kept in memory, least recently used first out, one build per key at a time."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future

from torch import nn

__all__ = ["ModuleCache"]


class ModuleCache:
    """A thread-safe LRU of modules; concurrent requests for a missing key share one build.

    Args:
        max_size (int): modules kept; 0 keeps none (every call builds).
        place (callable, optional): applied to every module before it is cached or returned, e.g. moving it to the
            compute device once per model version. Default: none.
    """

    def __init__(self, max_size: int, *, place: Callable[[nn.Module], nn.Module] | None = None) -> None:
        self.max_size = max_size
        self._place = place
        self._modules: OrderedDict[Hashable, nn.Module] = OrderedDict()
        self._building: dict[Hashable, Future[nn.Module]] = {}
        self._lock = threading.Lock()

    def get_or_build(self, key: Hashable, build: Callable[[], nn.Module]) -> nn.Module:
        """The cached module of ``key``, or ``build()``'s (cached). Other threads asking for ``key`` meanwhile wait
        for this build instead of starting their own; if it raises, they raise the same error."""
        with self._lock:
            module = self._modules.get(key)
            if module is not None:
                self._modules.move_to_end(key)
                return module
            future = self._building.get(key)
            is_owner = future is None
            if future is None:
                future = self._building[key] = Future()
        if not is_owner:
            return future.result()
        try:
            module = build()
            if self._place is not None:
                module = self._place(module)
        except BaseException as exc:
            with self._lock:
                del self._building[key]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._building[key]
        self._store(key, module)
        future.set_result(module)
        return module

    def put(self, key: Hashable, module: nn.Module) -> None:
        """Cache ``module`` under ``key`` as the most recently used, evicting the least recently used over max_size."""
        if self.max_size <= 0:
            return
        self._store(key, module if self._place is None else self._place(module))

    def _store(self, key: Hashable, module: nn.Module) -> None:
        if self.max_size <= 0:
            return
        with self._lock:
            self._modules[key] = module
            self._modules.move_to_end(key)
            while len(self._modules) > self.max_size:
                self._modules.popitem(last=False)

    def drop(self, predicate: Callable[[Hashable], bool]) -> None:
        """Forget every module whose key satisfies ``predicate``."""
        with self._lock:
            for key in [k for k in self._modules if predicate(k)]:
                del self._modules[key]

    def clear(self) -> None:
        """Forget every module."""
        with self._lock:
            self._modules.clear()
