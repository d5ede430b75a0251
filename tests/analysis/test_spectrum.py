"""spectrum against numpy.linalg.eigvalsh, Lanczos on every operand kind, and the ranks written out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse.linalg
import zarr

from ntk_service.analysis import spectrum, stored_kernel_operator
from ntk_service.errors import InvalidInput, ShapeMismatch
from tests.analysis.conftest import Features, make_features


def test_eigenvalues_and_ranks_match_numpy(features: Features) -> None:
    s = spectrum(features.theta)
    want = np.linalg.eigvalsh(features.matrix)[::-1]
    np.testing.assert_allclose(s.eigenvalues, want, rtol=0, atol=1e-13)
    assert s.method == "eigh" and s.n == 21 and s.is_complete
    k = features.matrix
    assert s.participation_ratio == pytest.approx(np.trace(k) ** 2 / np.sum(k * k), rel=1e-12)
    assert s.stable_rank == pytest.approx(np.trace(k) / want[0], rel=1e-12)
    assert s.numerical_rank == np.linalg.matrix_rank(k)
    p = want / want.sum()
    assert s.entropy == pytest.approx(math.exp(-sum(pi * math.log(pi) for pi in p)), rel=1e-10)
    assert s.condition_number == pytest.approx(want[0] / want[-1], rel=1e-8)
    assert s.effective_dof(0.1) == pytest.approx(np.trace(k @ np.linalg.inv(k + 0.1 * np.eye(21))), rel=1e-10)


def test_eigenvectors_reconstruct_the_matrix(features: Features) -> None:
    s = spectrum(features.theta, eigenvectors=True)
    assert s.eigenvectors is not None
    np.testing.assert_allclose((s.eigenvectors * s.eigenvalues) @ s.eigenvectors.T, features.matrix, atol=1e-13)


def test_rank_deficient_kernel_has_infinite_condition_number() -> None:
    f = make_features(n=6, k=2, p=5, seed=1)
    s = spectrum(f.theta)
    assert s.condition_number == math.inf and s.numerical_rank == 5


class _MatvecOnly:
    """The minimal protocol a matrix-free operator offers: shape and matvec."""

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix, self.shape, self.dtype = matrix, matrix.shape, matrix.dtype
        self.calls = 0

    def matvec(self, v: np.ndarray) -> np.ndarray:
        self.calls += 1
        return self.matrix @ v


def test_lanczos_on_dense_operator_and_matvec_objects(tmp_path) -> None:
    f = make_features(n=40, k=2, p=200, seed=2)
    want = np.linalg.eigvalsh(f.matrix)[::-1][:5]
    dense = spectrum(f.theta, top=5, method="lanczos")
    operator = spectrum(scipy.sparse.linalg.aslinearoperator(f.matrix), top=5)
    matvec = _MatvecOnly(f.matrix)
    plain = spectrum(matvec, top=5)
    stored = zarr.create_array(store=str(tmp_path / "k.zarr"), shape=f.theta.shape, chunks=(8, 40, 2, 2), dtype="f8")
    stored[:] = f.theta
    on_disk = spectrum(stored_kernel_operator(stored, block_rows=16), top=5)
    for s in (dense, operator, plain, on_disk):
        assert s.method == "lanczos" and s.eigenvalues.shape == (5,) and not s.is_complete
        np.testing.assert_allclose(s.eigenvalues, want, rtol=1e-10)
        assert s.lambda_min is None and s.condition_number is None
    assert matvec.calls > 0 and plain.participation_ratio is None
    with pytest.raises(InvalidInput, match="needs every eigenvalue"):
        dense.effective_dof(0.1)


def test_bad_inputs(features: Features) -> None:
    with pytest.raises(ShapeMismatch, match="must be square"):
        spectrum(features.theta_test)
    with pytest.raises(InvalidInput, match="give 1 ≤ top < 21"):
        spectrum(features.theta, method="lanczos")
    with pytest.raises(InvalidInput, match="needs a dense kernel"):
        spectrum(_MatvecOnly(features.matrix), method="eigh")
    with pytest.raises(InvalidInput, match="unknown method"):
        spectrum(features.theta, method="svd")
