"""The lazy-training diagnostic (Chizat et al. 2019): train a network and its linearization side by side.

``compare_training`` trains a copy of the model and ``linearize`` of it with the same optimizer, loss, data
order and number of steps, and records per step how far apart their outputs are, the loss of each, and, at
chosen steps, how far the network's kernel Θ_t moved from Θ_0 (``kernel_distance``, ``relative_change``). In
the lazy regime (wide networks, small steps) the gap and the kernel's motion stay small; a gap that grows with
training says the kernel picture stops describing the network.

NOTE [same conditions]
    Both sides start from the same θ0 and run in eval semantics (the linearization's: dropout off, BatchNorm on
    its running statistics), so at step 0 they are the same function and the gap is exactly 0. Each step draws
    one minibatch from a seeded permutation per epoch and hands that batch to both; each side has its own
    optimizer built by the same factory, so momentum and Adam state evolve on the same schedule. The caller's
    model is never trained (a deep copy is).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ntk_service.analysis.distance import kernel_distance, relative_change
from ntk_service.analysis.linearize import linearize
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.api import compute_ntk
from ntk_service.kernels.problem.parameter_selection import select_parameters

__all__ = ["DEFAULT_LEARNING_RATE", "TrainingComparison", "compare_training"]

DEFAULT_LEARNING_RATE = 0.1
"""SGD's step when no optimizer is given: small enough for a standard-parameterized MLP on unit-scale inputs."""

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainingComparison:
    """What ``compare_training`` recorded, S = steps.

    Attributes:
        steps: (S+1,) 0…S; entry s is before the (s+1)-th optimizer step.
        train_gap, test_gap: (S+1,) RMS over entries of f_network − f_linearized on x_train (N·k entries) and
            x_test (None without x_test).
        train_moved, test_moved: (S+1,) RMS of f_network − f_network(step 0) on x_train / x_test (None without
            it): the scale each gap compares with.
        network_loss, linearized_loss: (S+1,) the loss of each on the whole training set.
        kernel_steps: (K,) steps where the network's kernel was computed (on x_train, ``kernel_mode``).
        kernel_distance: (K,) 1 − cos(Θ_0, Θ_s) (Fort et al. 2020). kernel_relative_change: (K,)
            ‖Θ_s − Θ_0‖_F / ‖Θ_0‖_F (Lee et al. 2019).
        kernel_mode: the mode those kernels were computed in.
    """

    steps: np.ndarray
    train_gap: np.ndarray
    test_gap: np.ndarray | None
    train_moved: np.ndarray
    test_moved: np.ndarray | None
    network_loss: np.ndarray
    linearized_loss: np.ndarray
    kernel_steps: np.ndarray
    kernel_distance: np.ndarray
    kernel_relative_change: np.ndarray
    kernel_mode: str


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=DEFAULT_LEARNING_RATE)


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().pow(2).mean().sqrt())


def _check(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor | None, steps: int, batch: int) -> None:
    operation = "compare_training"
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise InvalidInput(f"{operation}: steps must be an integer ≥ 0, got {steps!r}")
    if x_train.ndim == 0 or x_train.shape[0] == 0:
        raise ShapeMismatch(f"{operation}: x_train must be a non-empty batch (N, *input), got shape {x_train.shape}")
    if y_train.shape[0] != x_train.shape[0]:
        raise ShapeMismatch(
            f"{operation}: y_train has {y_train.shape[0]} rows, x_train {x_train.shape[0]}; one target per example"
        )
    if x_test is not None and x_test.shape[1:] != x_train.shape[1:]:
        raise ShapeMismatch(
            f"{operation}: x_test has per-example shape {tuple(x_test.shape[1:])}, x_train "
            f"{tuple(x_train.shape[1:])}; both must match the model's input"
        )
    if not 1 <= batch <= x_train.shape[0]:
        raise InvalidInput(f"{operation}: batch_size must be in [1, N = {x_train.shape[0]}], got {batch}")


def _batches(n: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The row indices of each step's minibatch: a fresh seeded permutation per epoch (NOTE [same conditions])."""
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        order = torch.randperm(n, generator=gen) if batch < n else torch.arange(n)
        out.extend(order[i : i + batch] for i in range(0, n - batch + 1, batch))
    return out[:steps]


def compare_training(
    model: nn.Module,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor | None = None,
    *,
    loss: LossFn,
    steps: int,
    optimizer: OptimizerFactory | None = None,
    batch_size: int | None = None,
    params: Sequence[str] | None = None,
    kernel_steps: Sequence[int] | None = None,
    kernel_mode: str = "trace",
    seed: int = 0,
) -> TrainingComparison:
    """Train the network and its linearization side by side and record how far apart they drift.

    Args:
        model (nn.Module): the network at θ0 (copied; the caller's model is not trained).
        x_train (Tensor): (N, *input). y_train (Tensor): targets ``loss`` takes, e.g. (N,) class indices for
            ``nn.CrossEntropyLoss()`` or (N, k) for ``nn.MSELoss()``.
        x_test (Tensor | None): (M, *input) inputs on which the gap is also measured. Default: None.
        loss (callable): ``loss(outputs, targets)`` -> scalar, e.g. ``nn.CrossEntropyLoss()``.
        steps (int): optimizer steps S ≥ 0.
        optimizer (callable | None): builds an optimizer from parameters, called once per side, e.g.
            ``lambda p: torch.optim.Adam(p, lr=1e-3)``. Default: SGD at lr = 0.1.
        batch_size (int | None): minibatch rows per step (a seeded permutation per epoch, the same for both).
            Default: None (full batch).
        params (list of str | None): globs of the parameters that train (others stay at θ0 on both sides).
            Default: None (all).
        kernel_steps (sequence of int | None): steps at which the network's Θ_s(x_train, x_train) is computed
            (of the parameters that train).
            Default: (0, S).
        kernel_mode (str): "trace" or "full". Default: "trace".
        seed (int): the minibatch order's seed. Default: 0.

    Returns:
        TrainingComparison: per-step (S+1,) gaps, movement and losses; (K,) kernel distances.

    Raises:
        InvalidInput: steps < 0, a bad batch_size or kernel step; ShapeMismatch: inputs and targets that do not
        fit; errors of ``linearize`` and ``compute_ntk``.

    Cost: per step, two optimizer steps (the linearized one about twice a forward and backward pass) and
    forward passes on x_train and x_test for the records; one ``compute_ntk`` per kernel step.

        >>> cmp = compare_training(model, x, y, x_test, loss=nn.CrossEntropyLoss(), steps=200)  # doctest: +SKIP
        >>> cmp.train_gap.shape, cmp.kernel_distance.shape      # (201,), (2,)                  # doctest: +SKIP
    """
    batch = x_train.shape[0] if batch_size is None else int(batch_size)
    _check(x_train, y_train, x_test, steps, batch)
    wanted = sorted({0, steps} if kernel_steps is None else {int(s) for s in kernel_steps})
    if any(s < 0 or s > steps for s in wanted):
        raise InvalidInput(f"compare_training: kernel_steps must lie in [0, {steps}], got {list(kernel_steps or [])}")
    network = copy.deepcopy(model).eval()  # NOTE [same conditions]
    trained = set(select_parameters(network, params))
    for name, p in network.named_parameters():
        if name not in trained:
            p.requires_grad_(False)
    linear = linearize(network)
    make = optimizer or _sgd
    sides = [(network, make([p for p in network.parameters() if p.requires_grad])), (linear, make(linear.parameters()))]
    theta0 = compute_ntk(network, x_train, mode=kernel_mode, params=params).theta if wanted else None
    records: dict[str, list[float]] = {k: [] for k in ("train", "test", "moved", "test_moved", "net_loss", "lin_loss")}
    distances: list[float] = []
    changes: list[float] = []
    with torch.no_grad():
        start = network(x_train)
        start_test = None if x_test is None else network(x_test)
    batches = _batches(x_train.shape[0], batch, steps, seed)
    for s in range(steps + 1):
        with torch.no_grad():
            f_net, f_lin = network(x_train), linear(x_train)
            records["train"].append(_rms(f_net, f_lin))
            records["moved"].append(_rms(f_net, start))
            records["net_loss"].append(float(loss(f_net, y_train)))
            records["lin_loss"].append(float(loss(f_lin, y_train)))
            if x_test is not None and start_test is not None:
                g_net = network(x_test)
                records["test"].append(_rms(g_net, linear(x_test)))
                records["test_moved"].append(_rms(g_net, start_test))
        if s in wanted and theta0 is not None:
            theta = theta0 if s == 0 else compute_ntk(network, x_train, mode=kernel_mode, params=params).theta
            distances.append(kernel_distance(theta0, theta))
            changes.append(relative_change(theta0, theta))
        if s < steps:
            rows = batches[s]
            for side, opt in sides:
                opt.zero_grad()
                loss(side(x_train[rows]), y_train[rows]).backward()  # type: ignore[no-untyped-call]
                opt.step()
    return TrainingComparison(
        steps=np.arange(steps + 1),
        train_gap=np.array(records["train"]),
        test_gap=np.array(records["test"]) if x_test is not None else None,
        train_moved=np.array(records["moved"]),
        test_moved=np.array(records["test_moved"]) if x_test is not None else None,
        network_loss=np.array(records["net_loss"]),
        linearized_loss=np.array(records["lin_loss"]),
        kernel_steps=np.array(wanted, dtype=np.int64),
        kernel_distance=np.array(distances),
        kernel_relative_change=np.array(changes),
        kernel_mode=str(kernel_mode),
    )
