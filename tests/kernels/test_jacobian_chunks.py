"""The Jacobian build in chunks of examples and with eval BatchNorm as its affine map (jacobian_contraction.py,
affine_batchnorm.py), against the independent float64 reference."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._models import ResNet, randomize_batchnorm
from ntk_service.kernels.affine_batchnorm import affine_batchnorm
from ntk_service.kernels.jacobian_contraction import jacobians
from ntk_service.kernels.problem_pool import prepared_problem
from tests.reference import reference_jacobian


@functools.cache
def _reference() -> torch.Tensor:
    model, x = _resnet()
    return reference_jacobian(model, x)  # (n, k, P), named_parameters() order


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(1)
    model = randomize_batchnorm(ResNet(widths=(2, 3, 4), in_channels=2, k=3), g).eval()
    return model, torch.randn(5, 2, 6, 6, generator=g)


@pytest.mark.parametrize("chunk", [2, 7])
@pytest.mark.parametrize("affine_bn", [True, False])
def test_chunked_jacobians_match_the_reference(chunk: int, affine_bn: bool) -> None:
    """A ragged last chunk and one chunk larger than n both give the reference J, example by example."""
    model, x = _resnet()
    expected = _reference()
    with prepared_problem(model.double(), x.double(), None, params=None, dtype=torch.float64) as prepared:
        got = jacobians(prepared.problem, prepared.x1, chunk=chunk, affine_bn=affine_bn)
    flat = torch.cat([got[name].reshape(5, 3, -1) for name, _ in model.named_parameters()], dim=2)
    assert flat.shape == expected.shape
    assert (flat - expected).abs().max().item() <= 1e-12 * expected.abs().max().item()


def test_affine_batchnorm_is_eval_batch_norm() -> None:
    """The mode's map is F.batch_norm in eval (float64 to the last bits); training-mode calls are left alone."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64)
    mean, var = torch.randn(3, generator=g, dtype=torch.float64), torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    w, b = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    expected = (x - mean.view(1, 3, 1, 1)) / torch.sqrt(var.view(1, 3, 1, 1) + 1e-3) * w.view(1, 3, 1, 1)
    expected = expected + b.view(1, 3, 1, 1)
    with affine_batchnorm():
        got = F.batch_norm(x, mean, var, w, b, training=False, eps=1e-3)
        train = F.batch_norm(x, mean.clone(), var.clone(), w, b, training=True)
    assert (got - expected).abs().max().item() <= 1e-14
    assert (train - F.batch_norm(x, mean.clone(), var.clone(), w, b, training=True)).abs().max().item() == 0.0
