"""Random kernels built from explicit Jacobian features, so every reference can use J directly.

J (N, k, P) reshaped to (N·k, P) has row n·k + a, so J Jᵀ of that matrix is the example-major kernel matrix by
construction, independent of ``as_matrix``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest


@dataclass(frozen=True)
class Features:
    j_train: np.ndarray  # (N, k, P)
    j_test: np.ndarray  # (M, k, P)

    @property
    def theta(self) -> np.ndarray:  # (N, N, k, k)
        return np.einsum("naf,mbf->nmab", self.j_train, self.j_train)

    @property
    def theta_test(self) -> np.ndarray:  # (M, N, k, k)
        return np.einsum("naf,mbf->nmab", self.j_test, self.j_train)

    @property
    def theta_test_test(self) -> np.ndarray:  # (M, M, k, k)
        return np.einsum("naf,mbf->nmab", self.j_test, self.j_test)

    @property
    def matrix(self) -> np.ndarray:  # (N·k, N·k) from the reshaped Jacobian
        jm = self.j_train.reshape(-1, self.j_train.shape[2])
        return jm @ jm.T

    @property
    def test_matrix(self) -> np.ndarray:  # (M·k, N·k)
        jt = self.j_test.reshape(-1, self.j_test.shape[2])
        return jt @ self.j_train.reshape(-1, self.j_train.shape[2]).T


def make_features(n: int = 7, m: int = 4, k: int = 3, p: int = 40, seed: int = 0) -> Features:
    rng = np.random.default_rng(seed)
    return Features(rng.standard_normal((n, k, p)) / np.sqrt(p), rng.standard_normal((m, k, p)) / np.sqrt(p))


@pytest.fixture
def features() -> Features:
    return make_features()
