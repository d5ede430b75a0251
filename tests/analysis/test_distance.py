"""kernel_distance and relative_change against the formulas, dense and streamed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ntk_service.analysis import KernelTile, kernel_distance, relative_change
from ntk_service.errors import InvalidInput, ShapeMismatch
from tests.analysis.conftest import Features, make_features


def test_proportional_kernels_are_at_distance_zero(features: Features) -> None:
    assert kernel_distance(features.theta, 3.7 * features.theta) == pytest.approx(0.0, abs=1e-15)
    assert kernel_distance(features.theta, torch.from_numpy(features.theta).float() * 2) == pytest.approx(0, abs=1e-7)


def test_distance_and_relative_change_match_the_formulas(features: Features) -> None:
    other = make_features(seed=5).theta
    a, b = features.theta.reshape(-1), other.reshape(-1)
    want = 1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    assert kernel_distance(features.theta, other) == pytest.approx(want, rel=1e-13)
    assert relative_change(features.theta, other) == pytest.approx(np.linalg.norm(b - a) / np.linalg.norm(a), rel=1e-13)
    tiles = lambda theta: (KernelTile(r, 0, theta[r : r + 2]) for r in range(0, 7, 2))  # noqa: E731
    assert kernel_distance(tiles(features.theta), tiles(other)) == pytest.approx(want, rel=1e-13)


def test_bad_inputs(features: Features) -> None:
    with pytest.raises(ShapeMismatch, match="same inputs"):
        kernel_distance(features.theta, features.theta_test)
    with pytest.raises(InvalidInput, match="all zeros"):
        kernel_distance(features.theta, np.zeros_like(features.theta))
    with pytest.raises(ShapeMismatch, match="more tiles"):
        kernel_distance(iter([KernelTile(0, 0, features.theta)]), iter([]))
