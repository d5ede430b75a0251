"""The one operator base (NOTE [one operator base]): every operator of the package is a ``LinearOperator``, its
products and SciPy view agree with the dense matrix, and a ``JacobianOperator``'s halves (jvp, vjp, kernel_block)
equal the float64 Jacobian and kernel of tests/reference.py (an independent per-example autograd loop)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg
import torch
from torch import nn

from ntk_service.analysis.solve import as_operator, kernel_operator
from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels import KernelMode, dataset_operator, ntk_operator
from ntk_service.kernels.operators.base import JacobianOperator, LinearOperator, MatrixOperator, check_ranges
from tests.reference import reference_jacobian, reference_ntk

K = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, K)).double()


def _x() -> torch.Tensor:
    return torch.randn(9, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _rows(ranges: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in ranges])


@pytest.mark.parametrize("build", ["ntk_operator", "dataset_operator"])
def test_the_jacobian_halves_equal_the_reference(build: str) -> None:
    model, x = _model(), _x()
    op = ntk_operator(model, x) if build == "ntk_operator" else dataset_operator(model, x.numpy(), examples_per_chunk=4)
    assert isinstance(op, JacobianOperator) and isinstance(op, LinearOperator) and op.examples == (9, 9)
    jac = reference_jacobian(model, x).numpy()  # (N, k, P), parameters in named_parameters() order
    rng = np.random.default_rng(2)
    u = rng.standard_normal(op.num_params)
    ranges = [(1, 3), (5, 6), (7, 9)]
    rows = _rows(ranges)
    np.testing.assert_allclose(op.jvp(u, ranges), jac[rows] @ u, rtol=0, atol=1e-12)
    np.testing.assert_allclose(op.jvp(u), jac @ u, rtol=0, atol=1e-12)
    c = rng.standard_normal((rows.size, K))
    np.testing.assert_allclose(op.vjp(c, ranges), np.einsum("nkp,nk->p", jac[rows], c), rtol=0, atol=1e-12)
    landmarks = np.array([8, 0, 4])  # any order: the columns come back in it
    block = op.kernel_block(ranges, landmarks, KernelMode.FULL)
    expected = reference_ntk(model, x[rows], x[landmarks]).numpy()
    np.testing.assert_allclose(block, expected, rtol=0, atol=1e-12)
    trace = op.kernel_block(ranges, landmarks, KernelMode.TRACE)
    np.testing.assert_allclose(trace, np.einsum("nmaa->nm", expected), rtol=0, atol=1e-12)
    symmetric = op.kernel_block(ranges, None, KernelMode.FULL)
    np.testing.assert_allclose(symmetric, reference_ntk(model, x[rows]).numpy(), rtol=0, atol=1e-12)
    diagonal = op.kernel_block(ranges, None, KernelMode.EXAMPLE_DIAGONAL)
    np.testing.assert_allclose(diagonal, np.einsum("nkp,nlp->nkl", jac[rows], jac[rows]), rtol=0, atol=1e-12)


def test_every_product_agrees_with_the_dense_matrix() -> None:
    model, x = _model(), _x()
    dense = reference_ntk(model, x).permute(0, 2, 1, 3).reshape(18, 18).numpy()
    v = np.random.default_rng(3).standard_normal((18, 4))
    for op in (ntk_operator(model, x), MatrixOperator(dense, mode=KernelMode.FULL, k=K, is_symmetric=True)):
        np.testing.assert_allclose(op.matmat(torch.from_numpy(v)).numpy(), dense @ v, rtol=0, atol=1e-12)
        np.testing.assert_allclose((op @ torch.from_numpy(v[:, 0])).numpy(), dense @ v[:, 0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(op.matmat_float64(v), dense @ v, rtol=0, atol=1e-12)
        linear = op.as_linear_operator()
        np.testing.assert_allclose(linear @ v[:, 1], dense @ v[:, 1], rtol=0, atol=1e-12)
        top = scipy.sparse.linalg.eigsh(linear, k=2, which="LA", return_eigenvectors=False)
        np.testing.assert_allclose(np.sort(top), np.linalg.eigvalsh(dense)[-2:], rtol=1e-9)
        assert op.is_symmetric
        np.testing.assert_allclose(op.T.matmat_float64(v), dense @ v, rtol=0, atol=1e-12)  # Θᵀ = Θ
    cross = reference_ntk(model, x[:4], x).permute(0, 2, 1, 3).reshape(8, 18).numpy()
    rect = MatrixOperator(cross)
    np.testing.assert_allclose(rect.T.matmat(torch.ones(8, 1, dtype=torch.float64)).numpy()[:, 0], cross.T @ np.ones(8))


def test_foreign_operators_are_taken_in_at_the_boundary() -> None:
    dense = np.diag(np.arange(1.0, 7.0))
    op = as_operator(scipy.sparse.linalg.aslinearoperator(dense))
    assert isinstance(op, LinearOperator) and op.mode is None and op.shape == (6, 6)
    np.testing.assert_allclose(op.matmat_float64(np.eye(6)), dense)
    view = kernel_operator(scipy.sparse.linalg.aslinearoperator(dense), k=1, name="a", operation="test")
    assert view.source is None and isinstance(view, LinearOperator)
    np.testing.assert_allclose(view.matmat(torch.eye(6, dtype=torch.float64)).numpy(), dense)
    with pytest.raises(InvalidInput, match="not an operator"):
        as_operator(object())


def test_bad_ranges_and_shapes_are_refused() -> None:
    model, x = _model(), _x()
    op = ntk_operator(model, x)
    for ranges in ([(3, 2)], [(0, 4), (2, 5)], [(0, 10)], [(-1, 2)]):
        with pytest.raises(InvalidInput, match="example ranges must be sorted, disjoint and inside"):
            check_ranges(ranges, 9, operation="test")
    with pytest.raises(ShapeMismatch, match="expected P"):
        op.jvp(np.zeros(3))
    with pytest.raises(ShapeMismatch, match="one row per example"):
        op.vjp(np.zeros((3, K)), [(0, 2)])
    with pytest.raises(ShapeMismatch, match="matmat"):
        op.matmat(torch.zeros(5, 1, dtype=torch.float64))
