"""Exact attribution features: the kernel of the Hessian rows from ``compute_ntk`` and its eigenvectors.

NOTE [exact features]: with K = G Gᵀ = V Λ Vᵀ the training kernel of the Hessian rows (N·c × N·c, modes with
λ > rcond·λmax kept), training rows get the features V Λ^½ (whose Gram matrix is Λ: F is diagonal) and a test
example with cross-kernel row κ* = ∇m(x*)ᵀ Gᵀ gets κ* V Λ^-½. Then m*ᵀ(F + λI)⁻¹G'ᵀ = κ*(K + λI)⁻¹ exactly (the
push-through identity), so the exact path is TRAK with infinite D and shares the scoring code with the sketch.
Dropped modes are the null space of K, which κ* cannot see (it is a combination of the rows of G); ridge 0 then
gives the pseudo-inverse.

Cost: the kernel (one ``compute_ntk`` call, TRACE of the k = 1 margin function for cross-entropy, FULL for mse), one
float64 eigendecomposition (N·c)³, and per test example its kernel row against the training set. Memory
(``exact_memory``): about four (N·c)² float64 arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ntk_service.attribution.checkpoints import AllOutputs, OutputFunction, weighted_inputs
from ntk_service.attribution.options import AttributionLoss, AttributionOptions
from ntk_service.attribution.rows import engine_params
from ntk_service.attribution.targets import OutputWeights
from ntk_service.kernels.api import compute_ntk

__all__ = ["ExactBasis", "ExactTrainSide", "exact_memory", "exact_target", "exact_train_side"]


@dataclass(frozen=True)
class ExactBasis:
    """What places test examples in the exact features (NOTE [exact features]).

    Attributes:
        x_train: the training inputs (the cross-kernel's second side). rows: (N, k) float64 output weights of the
            training rows (cross-entropy), or None (mse: all k outputs). kernel_map: (N·c, r) float64, V Λ^-½.
    """

    x_train: Any
    rows: torch.Tensor | None
    kernel_map: np.ndarray


@dataclass(frozen=True)
class ExactTrainSide:
    """The exact training side: features (N, r) G', loss weights (N,), eigenvalues (r,) (F = diag), the number of
    Hessian rows, and the basis for test examples."""

    features: np.ndarray
    loss_weights: np.ndarray
    eigenvalues: np.ndarray
    rows: int
    basis: ExactBasis


def exact_memory(n: int, k: int, loss: AttributionLoss) -> int:
    """Bytes of the exact path's training side: about four (N·c)² float64 arrays (kernel, copy, eigenvectors, eigh
    workspace); mse's (N, N, k, k) kernel is the same size as its (N·k)² matrix."""
    rows = n * (1 if loss is AttributionLoss.CROSS_ENTROPY else k)
    return 4 * rows * rows * 8


def _as_matrix(theta: torch.Tensor) -> torch.Tensor:
    """A FULL kernel (N, N, k, k) as the symmetric (N·k, N·k) matrix, row n·k + a."""
    n, k = theta.shape[0], theta.shape[2]
    matrix = theta.permute(0, 2, 1, 3).reshape(n * k, n * k)
    return (matrix + matrix.T) / 2


def exact_train_side(
    model: nn.Module, x: Any, weights: OutputWeights, options: AttributionOptions, budget: int
) -> ExactTrainSide:
    """The exact training side (NOTE [exact features]) of a float64 model on float64 inputs x (N, *input).

    Args:
        model: the checkpoint's model, float64. x: all training inputs, float64. weights: ``targets.train_weights``
            of the checkpoint's outputs. options: params. budget: the memory budget for ``compute_ntk``.
    """
    common: dict[str, Any] = {"params": engine_params(options), "dtype": torch.float64, "memory_budget_bytes": budget}
    if weights.rows is not None:
        theta = compute_ntk(OutputFunction(model), weighted_inputs(x, weights.rows), mode="trace", **common).theta
        kernel = (theta + theta.T) / 2
    else:
        theta = compute_ntk(AllOutputs(model), x, mode="full", **common).theta  # (N, N, k, k)
        kernel = _as_matrix(theta)
    n = int(theta.shape[0])
    del theta
    lam, vec = torch.linalg.eigh(kernel)  # torch: its threads sleep while waiting (NOTE in scoring.py)
    del kernel
    tol = lam.shape[0] * torch.finfo(torch.float64).eps * max(float(lam[-1]), 0.0)
    keep = lam > tol
    lam, vec = lam[keep], vec[:, keep]
    rows_features = (vec * lam.sqrt()).numpy()
    if weights.rows is not None:
        g, s = rows_features, weights.loss.numpy()
    else:
        g = np.einsum("na,nar->nr", weights.loss.numpy(), rows_features.reshape(n, -1, rows_features.shape[1]))
        s = np.ones(n)
    basis = ExactBasis(x_train=x, rows=weights.rows, kernel_map=(vec / lam.sqrt()).numpy())
    return ExactTrainSide(g, s, lam.numpy(), int(vec.shape[0]), basis)


def exact_target(
    model: nn.Module, xb: Any, u: torch.Tensor, basis: ExactBasis, options: AttributionOptions, budget: int
) -> np.ndarray:
    """Test features κ* V Λ^-½ (m, r) of test inputs xb with measurement weights u (m, k), float64."""
    common: dict[str, Any] = {"params": engine_params(options), "dtype": torch.float64, "memory_budget_bytes": budget}
    if basis.rows is not None:
        cross = compute_ntk(
            OutputFunction(model),
            weighted_inputs(xb, u),
            weighted_inputs(basis.x_train, basis.rows),
            mode="trace",
            **common,
        ).theta
    else:
        theta = compute_ntk(AllOutputs(model), xb, basis.x_train, mode="full", **common).theta  # (m, N, k, k)
        cross = torch.einsum("ma,mnab->mnb", u, theta).reshape(theta.shape[0], -1)
    return (cross @ torch.from_numpy(basis.kernel_map)).numpy()
