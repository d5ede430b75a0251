"""The data-attribution problem of the service's tests: a slice of scikit-learn's ``load_digits`` (8×8 images, 64
pixels in [0, 1]), an MLP of the registry's ``mlp`` family, and three checkpoints trained from different seeds, as a
user has them: registered as versions 2-4 of one model, with the data sets uploaded."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from ntk_service.client import Client
from ntk_service.registry import build_model

DIGITS_MLP = {"family": "mlp", "input_dim": 64, "hidden": [32], "output_dim": 10, "activation": "relu"}
"""64 pixels → 32 → 10 classes: P = 2410, a feature pass over 200 examples takes milliseconds."""


@dataclass(frozen=True)
class Digits:
    """Training and test slices (float32 pixels, int64 labels) and the trained checkpoints' state dicts."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    checkpoints: tuple[dict[str, torch.Tensor], ...]

    def model(self) -> nn.Module:
        """The architecture (seed-0 weights: version 1 on the server)."""
        module, _ = build_model(DIGITS_MLP, seed=0)
        return module


def _train(x: torch.Tensor, y: torch.Tensor, seed: int, epochs: int = 25) -> dict[str, torch.Tensor]:
    module, _ = build_model(DIGITS_MLP, seed=seed)
    module.train()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(50):
            optimizer.zero_grad()
            nn.functional.cross_entropy(module(x[batch]), y[batch]).backward()
            optimizer.step()
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


@functools.cache
def digits(n_train: int = 200, n_test: int = 40) -> Digits:
    """The first ``n_train`` and next ``n_test`` examples of a fixed shuffle, and three checkpoints (seeds 1-3)."""
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x = (data.data[order] / 16.0).astype(np.float32)
    y = data.target[order].astype(np.int64)
    xt, yt = torch.from_numpy(x[:n_train]), torch.from_numpy(y[:n_train])
    states = tuple(_train(xt, yt, seed) for seed in (1, 2, 3))
    return Digits(x[:n_train], y[:n_train], x[n_train : n_train + n_test], y[n_train : n_train + n_test], states)


@dataclass(frozen=True)
class RegisteredDigits:
    """What ``register_digits`` stored: the model's name, the checkpoints' versions and the data sets' ids."""

    model: str
    versions: tuple[int, ...]
    x_train: str
    y_train: str
    x_test: str
    y_test: str


def register_digits(client: Client, name: str, problem: Digits) -> RegisteredDigits:
    """Register ``name`` (version 1: seed 0), upload the checkpoints as versions 2-4 and the four data sets."""
    client.register_model(name, DIGITS_MLP, seed=0)
    versions = tuple(
        int(client.upload_weights(name, state, label=f"seed {seed}")["version"])
        for seed, state in enumerate(problem.checkpoints, start=1)
    )
    ids = [
        client.upload_dataset(array, name=f"{name} {what}")["id"]
        for what, array in (
            ("x_train", problem.x_train),
            ("y_train", problem.y_train),
            ("x_test", problem.x_test),
            ("y_test", problem.y_test),
        )
    ]
    return RegisteredDigits(name, versions, *ids)
