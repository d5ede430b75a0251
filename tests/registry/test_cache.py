"""ModuleCache: LRU order, one build per key under concurrency, failures shared and not cached."""

from __future__ import annotations

import threading
import time

import pytest
from torch import nn

from ntk_service.registry.cache import ModuleCache


def test_lru_eviction_and_drop() -> None:
    cache = ModuleCache(2)
    a, b, c = nn.ReLU(), nn.Tanh(), nn.GELU()
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get_or_build("a", nn.Identity) is a  # a is now the most recent
    cache.put("c", c)  # evicts b
    assert cache.get_or_build("b", nn.Identity) is not b
    cache.drop(lambda key: key == "a")
    assert cache.get_or_build("a", nn.Identity) is not a
    assert ModuleCache(0).get_or_build("x", nn.Identity) is not ModuleCache(0).get_or_build("x", nn.Identity)


def test_concurrent_requests_share_one_build_and_its_failure() -> None:
    cache = ModuleCache(4)
    started, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_failing_build() -> nn.Module:
        calls.append(1)
        started.set()
        release.wait(10)
        raise RuntimeError("weights unreadable")

    errors: list[str] = []

    def ask() -> None:
        try:
            cache.get_or_build("k", slow_failing_build)
        except RuntimeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    threads[0].start()
    started.wait(10)
    for t in threads[1:]:
        t.start()
    time.sleep(0.5)  # the two late threads find the build in progress and wait on it (microseconds of work)
    release.set()
    for t in threads:
        t.join()
    assert calls == [1] and errors == ["weights unreadable"] * 3
    module = nn.ReLU()
    assert cache.get_or_build("k", lambda: module) is module  # the failure was not cached
    with pytest.raises(ValueError):
        cache.get_or_build("other", lambda: (_ for _ in ()).throw(ValueError("x")))
