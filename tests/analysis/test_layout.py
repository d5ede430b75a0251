"""as_matrix: FULL (N, M, k, k) -> (N·k, M·k) with row n·k + a, checked entry by entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ntk_service.analysis import as_matrix
from ntk_service.errors import NonFiniteInput, ShapeMismatch
from tests.analysis.conftest import Features


def test_full_is_example_major_entry_by_entry() -> None:
    rng = np.random.default_rng(1)
    theta = rng.standard_normal((3, 4, 2, 2))
    matrix = as_matrix(theta)
    assert matrix.shape == (6, 8) and matrix.dtype == np.float64
    for n in range(3):
        for m in range(4):
            for a in range(2):
                for b in range(2):
                    assert matrix[n * 2 + a, m * 2 + b] == theta[n, m, a, b]
    assert not np.array_equal(matrix, theta.reshape(6, 8))  # the plain reshape is a different matrix


def test_matches_the_reshaped_jacobian(features: Features) -> None:
    np.testing.assert_allclose(as_matrix(features.theta), features.matrix, rtol=0, atol=1e-14)


def test_torch_float32_and_trace_pass_through() -> None:
    theta = torch.arange(16, dtype=torch.float32).reshape(2, 2, 2, 2)
    out = as_matrix(theta)
    assert out.dtype == np.float64 and out[1, 2] == float(theta[0, 1, 1, 0])
    trace = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(as_matrix(trace, mode="trace"), trace)


def test_bad_kernels_are_refused() -> None:
    with pytest.raises(ShapeMismatch, match="FULL kernel"):
        as_matrix(np.zeros((2, 2, 2)))
    with pytest.raises(ShapeMismatch, match="trace kernel, but mode 'full'"):
        as_matrix(np.zeros((2, 2)), mode="full")
    with pytest.raises(NonFiniteInput):
        as_matrix(np.full((2, 2), np.nan))
