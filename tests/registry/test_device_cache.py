"""The module cache places each model version once (on the compute device) before caching or returning it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ntk_service.registry import ModelRegistry
from ntk_service.registry.cache import ModuleCache

MLP = {"family": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 2}


def test_place_runs_once_per_version_on_build_and_on_put() -> None:
    placed: list[nn.Module] = []

    def place(module: nn.Module) -> nn.Module:
        placed.append(module)
        return module.double()  # a visible change, standing in for .to(device)

    cache = ModuleCache(4, place=place)
    built = cache.get_or_build("a", lambda: nn.Linear(2, 2))
    assert built.weight.dtype == torch.float64 and placed == [built]
    assert cache.get_or_build("a", lambda: nn.Linear(2, 2)) is built  # cached: not placed again
    cache.put("b", nn.Linear(3, 3))
    assert cache.get_or_build("b", lambda: nn.Linear(9, 9)).weight.dtype == torch.float64
    assert len(placed) == 2


def test_the_registry_keeps_modules_on_its_device(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path, device="cpu")
    try:
        registry.register("m", MLP, seed=0)
        _, module = registry.load_module("m")
        assert registry.device == torch.device("cpu")
        assert {p.device for p in module.parameters()} == {torch.device("cpu")}
    finally:
        registry.close()
