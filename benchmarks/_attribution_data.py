"""Data, models, training and the LDS ground truth of ``bench_attribution.py``, shared with its peer script.

Torch, numpy and scikit-learn only (no ntk_service), so the peers' venvs import it too. scikit-learn's digits:
1797 8×8 images, pixel values / 16, a seeded split into ``n_train`` training and ``n_test`` test examples. Two
architectures taking the flat (N, 64) pixels: the MLP 64-128-128-10 of issue 39 and a small CNN (two 3×3
convolutions, 16 and 32 channels, 2×2 average pooling, a linear head). Every model trains the same way
(``train_model``): Adam, minibatches in a seeded order, a fixed number of epochs, so a seed fixes the weights.

Ground truth (``ground_truth``): ``subsets`` random halves of the training set (seeded masks), one model trained on
each from its own seed, and the test margins f_y − logsumexp_{a≠y} f_a of every model: (S, M). Computed once and
cached as an .npz (masks, margins, and the settings they were made with), so reruns are cheap.

Checkpoints (``checkpoints``): ``count`` models trained on the whole training set from seeds 1000 + c, cached the
same way; weights are numpy arrays by parameter name (no pickle anywhere).
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

ARCHITECTURES = ("mlp", "cnn")
EPOCHS = {"mlp": 40, "cnn": 40}
"""Passes over the training data: both reach ~97 % test accuracy on the full training set and fit it."""
BATCH = 64
LEARNING_RATE = 2e-3


def digits(n_train: int, n_test: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x_train (n_train, 64) float32, y_train (n_train,) int64, x_test, y_test: a seeded split of load_digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    if n_train + n_test > len(y):
        raise ValueError(f"digits has {len(y)} examples, asked for {n_train} + {n_test}")
    tr, te = order[:n_train], order[n_train : n_train + n_test]
    return x[tr], y[tr], x[te], y[te]


def make_model(arch: str) -> nn.Module:
    """The benchmark's architectures on flat (N, 64) inputs (module docstring)."""
    if arch == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    if arch == "cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 10),
        )
    raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHITECTURES}")


def train_model(arch: str, x: np.ndarray, y: np.ndarray, seed: int) -> nn.Module:
    """A model of ``arch`` trained on (x, y) from ``seed`` (module docstring): deterministic for a given seed."""
    torch.manual_seed(seed)
    model = make_model(arch)
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(EPOCHS[arch]):
        order = torch.randperm(len(yt), generator=gen)
        for i in range(0, len(yt), BATCH):
            idx = order[i : i + BATCH]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
    return model.eval()


def margins(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """f_y − logsumexp_{a≠y} f_a per example (TRAK's measurement): (n,) float64."""
    with torch.no_grad():
        f = model(torch.from_numpy(x)).double()
    yt = torch.from_numpy(y)
    correct = f.gather(1, yt[:, None])[:, 0]
    others = f.scatter(1, yt[:, None], float("-inf"))
    return (correct - torch.logsumexp(others, dim=1)).numpy()


def state_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}


def state_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}


def _cached(
    path: Path, settings: dict[str, object], build: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The arrays in ``path`` if it was made with ``settings``, else ``build()`` saved there."""
    if path.exists():
        with np.load(path) as stored:
            if json.loads(str(stored["settings"])) == settings:
                return {k: stored[k] for k in stored.files if k != "settings"}
    arrays = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part.npz")
    np.savez(tmp, settings=np.array(json.dumps(settings)), **arrays)
    tmp.rename(path)
    return arrays


def _subset_margins(job: tuple[str, int, int, np.ndarray, int]) -> np.ndarray:
    """Test margins of the model trained on one subset (a worker process's task: one thread each)."""
    arch, n_train, n_test, mask, seed = job
    torch.set_num_threads(1)
    x, y, xq, yq = digits(n_train, n_test)
    return margins(train_model(arch, x[mask], y[mask], seed=seed), xq, yq)


def ground_truth(
    arch: str, n_train: int, n_test: int, subsets: int, cache: Path, workers: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """masks (S, N) bool and test margins (S, M) of models retrained on random halves (module docstring);
    ``workers`` processes of one thread each train them (the same models for any number, up to the rounding of
    another thread count)."""
    settings = {
        "arch": arch,
        "n_train": n_train,
        "n_test": n_test,
        "subsets": subsets,
        "epochs": EPOCHS[arch],
        "lr": LEARNING_RATE,
        "batch": BATCH,
    }

    def build() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(12345)
        masks = np.zeros((subsets, n_train), dtype=bool)
        for j in range(subsets):
            masks[j, rng.choice(n_train, n_train // 2, replace=False)] = True
        jobs = [(arch, n_train, n_test, masks[j], j) for j in range(subsets)]
        out = np.zeros((subsets, n_test))
        start = time.perf_counter()
        context = multiprocessing.get_context("spawn")  # no fork of a process whose OpenMP pool is running
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            for j, row in enumerate(pool.map(_subset_margins, jobs)):
                out[j] = row
                if (j + 1) % 20 == 0:
                    elapsed = time.perf_counter() - start
                    print(f"  ground truth {arch}: {j + 1}/{subsets} models, {elapsed:.0f} s", flush=True)
        return {"masks": masks, "margins": out}

    arrays = _cached(cache / f"ground_truth_{arch}_{n_train}_{n_test}_{subsets}.npz", settings, build)
    return arrays["masks"], arrays["margins"]


def checkpoints(arch: str, n_train: int, n_test: int, count: int, cache: Path) -> list[dict[str, np.ndarray]]:
    """``count`` models trained on the whole training set (seeds 1000 + c), as numpy state dicts."""
    settings = {
        "arch": arch,
        "n_train": n_train,
        "count": count,
        "epochs": EPOCHS[arch],
        "lr": LEARNING_RATE,
        "batch": BATCH,
    }
    x, y, _, _ = digits(n_train, n_test)

    def build() -> dict[str, np.ndarray]:
        out = {}
        for c in range(count):
            for name, a in state_arrays(train_model(arch, x, y, seed=1000 + c)).items():
                out[f"{c}/{name}"] = a
        return out

    arrays = _cached(cache / f"checkpoints_{arch}_{n_train}_{count}.npz", settings, build)
    states: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
    for key, a in arrays.items():
        c, name = key.split("/", 1)
        states[int(c)][name] = a
    return states
