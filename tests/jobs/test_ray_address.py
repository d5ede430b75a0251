"""Which Ray ``ray.init`` is told to use: the configured address, else an explicit RAY_ADDRESS, else a new local
instance (never the cluster a ``ray start`` address file points at, which a bare ``ray.init()`` would join)."""

from __future__ import annotations

import pytest

from ntk_service.jobs.executors.ray import ray_init_address


def test_the_configured_address_wins_then_ray_address_then_a_local_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init_address(None) == "local"
    assert ray_init_address("ray://head:10001") == "ray://head:10001"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert ray_init_address(None) == "10.0.0.5:6379"
    assert ray_init_address("auto") == "auto"
