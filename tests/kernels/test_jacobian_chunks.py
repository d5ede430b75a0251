"""The Jacobian build in chunks of examples, with eval BatchNorm as its affine map and strided 1x1 convolutions as
a slice and a matmul (jacobian_contraction.py, problem/affine_batchnorm.py, problem/pointwise_convolution.py),
against the independent float64 reference."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._models import ResNet, randomize_batchnorm
from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.jacobian_contraction import (
    CHUNK_BYTES,
    JacobianContraction,
    contract_groups,
    contract_groups_diagonal,
    jacobian_chunk,
    jacobian_chunks,
    jacobians,
    split_chunks,
)
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.problem.affine_batchnorm import affine_batchnorm, batchnorm_scope
from ntk_service.kernels.problem.pointwise_convolution import pointwise_scope, strided_pointwise_convolution
from ntk_service.kernels.runtime.allocator import MMAP_THRESHOLD_BYTES
from ntk_service.kernels.runtime.problem_pool import prepared_problem
from tests.reference import assert_matches, reference_columns, reference_jacobian, reference_kernel

CONTRACTIONS = list(dict.fromkeys(mode.spec.contraction for mode in KernelMode))
"""What the implementations contract (NOTE [mode contractions]): every contracted mode reduces to one of these."""


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
@pytest.mark.parametrize(("affine_bn", "pointwise"), [(True, True), (False, False), (False, True)])
def test_chunked_jacobians_match_the_reference(chunk: int, affine_bn: bool, pointwise: bool) -> None:
    """A ragged last chunk and one chunk larger than n both give the reference J, example by example, with and
    without the rewrites (the ResNet's shortcuts are strided 1x1 convolutions, 6 -> 3 -> 2 pixels)."""
    model, x = _resnet()
    expected = _reference()
    with prepared_problem(model.double(), x.double(), None, params=None, dtype=torch.float64) as prepared:
        got = jacobians(prepared.problem, prepared.x1, chunk=chunk, affine_bn=affine_bn, pointwise=pointwise)
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


_CONVOLUTIONS = [  # (stride, padding, groups, kernel, rewritten)
    (2, 0, 1, 1, True),
    ((2, 3), (0, 0), 1, 1, True),
    (1, 0, 1, 1, False),  # stride 1: left alone
    (2, 1, 1, 1, False),  # padded
    (2, 0, 2, 1, False),  # grouped
    (2, 1, 1, 3, False),  # 3x3
]


@pytest.mark.parametrize(("stride", "padding", "groups", "kernel", "rewritten"), _CONVOLUTIONS)
@pytest.mark.parametrize("op", ["F.conv2d", "aten.conv2d", "aten.convolution"])
def test_strided_pointwise_convolution_is_conv2d(
    stride: object, padding: object, groups: int, kernel: int, rewritten: bool, op: str
) -> None:
    """The mode's slice and matmul is conv2d (float64, odd sizes, with a bias), for ``F.conv2d`` and for
    ``aten.conv2d`` / ``aten.convolution`` (an exported program's ops); the calls it must not rewrite still reach
    the convolution."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4 // groups, kernel, kernel, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    expected = F.conv2d(x, w, b, stride, padding, 1, groups)

    def pair(v: object) -> list[int]:
        return list(v) if isinstance(v, tuple) else [v, v]  # type: ignore[list-item]

    with strided_pointwise_convolution():
        if op == "aten.conv2d":
            got = torch.ops.aten.conv2d.default(x, w, b, pair(stride), pair(padding), [1, 1], groups)
        elif op == "aten.convolution":
            got = torch.ops.aten.convolution.default(
                x, w, b, pair(stride), pair(padding), [1, 1], False, [0, 0], groups
            )
        else:
            got = F.conv2d(x, w, b, stride, padding, 1, groups)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-13 * expected.abs().max().item()
    assert (type(got.grad_fn).__name__ == "ConvolutionBackward0") is not rewritten


def test_pointwise_scope_only_for_models_with_strided_1x1_convolutions() -> None:
    """The scope is the mode for the ResNet (strided shortcuts) and an exported program calling a convolution, and a
    no-op for a model without them."""
    model, _ = _resnet()
    assert isinstance(pointwise_scope(model), strided_pointwise_convolution)
    plain = nn.Sequential(nn.Conv2d(2, 3, 1), nn.Conv2d(3, 3, 3, stride=2))
    assert not isinstance(pointwise_scope(plain), strided_pointwise_convolution)
    program = torch.export.export(nn.Conv2d(2, 3, 1, stride=2), (torch.randn(1, 2, 5, 5),)).module()
    assert isinstance(pointwise_scope(program), strided_pointwise_convolution)  # its graph calls aten.conv2d
    wrapped = nn.Sequential(program)  # a program inside a module of the user's: its graph is still seen
    assert isinstance(pointwise_scope(wrapped), strided_pointwise_convolution)


def test_batchnorm_scope_sees_modules_and_exported_programs() -> None:
    """affine_batchnorm's scope: a model with BatchNorm modules, or a program whose graph calls aten.batch_norm."""
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    assert isinstance(batchnorm_scope(bn), affine_batchnorm)
    assert not isinstance(batchnorm_scope(nn.Linear(3, 4)), affine_batchnorm)
    program = torch.export.export(bn, (torch.randn(2, 3),)).module()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in program.modules())
    assert isinstance(batchnorm_scope(program), affine_batchnorm)


_X2_CHUNK = 3  # x2's side in chunks of 3, 3 (of 6 examples) while x1's are of 2, 2, 1: no chunk pair lines up


@functools.cache
def _reference_x2() -> tuple[torch.Tensor, torch.Tensor]:
    model, _ = _resnet()
    x2 = torch.randn(6, 2, 6, 6, generator=torch.Generator().manual_seed(9))
    return x2, reference_jacobian(model, x2)


@pytest.mark.parametrize("mode", CONTRACTIONS, ids=str)
def test_chunked_sides_contract_to_the_reference_kernel(mode: KernelMode) -> None:
    """Sides kept as their chunks (never copied into one tensor) contract, chunk pair by chunk pair, to the float64
    reference kernel in every mode, with ragged and misaligned chunks on the two sides."""
    model, x = _resnet()
    x2, j2_ref = _reference_x2()
    alg = JacobianContraction()
    with prepared_problem(model.double(), x.double(), x2.double(), params=None, dtype=torch.float64) as prepared:
        left = jacobian_chunks(prepared.problem, prepared.x1, chunk=2)
        right = jacobian_chunks(prepared.problem, prepared.x2, chunk=_X2_CHUNK)
        assert [next(iter(c.values())).shape[0] for c in left] == [2, 2, 1]
        assert [next(iter(c.values())).shape[0] for c in right] == [3, 3]
        if not mode.spec.pairs:
            got = alg.diagonal(prepared.problem, left)
        else:
            got = alg.pair(prepared.problem, left, right, mode)
    assert_matches(got, reference_kernel(_reference(), j2_ref, mode.value), rel=1e-12)


def test_joint_side_split_across_a_chunk_matches_two_sides() -> None:
    """One pass over x1 and x2 together, in chunks that straddle the boundary between them, splits into the two
    sides' Jacobians: the kernel equals the reference."""
    model, x = _resnet()
    x2, j2_ref = _reference_x2()
    alg = JacobianContraction()
    with prepared_problem(model.double(), x.double(), x2.double(), params=None, dtype=torch.float64) as prepared:
        both = jacobian_chunks(prepared.problem, torch.cat([prepared.x1, prepared.x2]), chunk=4)  # 4, 4, 3: 5 | 6
        left, right = split_chunks(both, 5)
        assert [next(iter(c.values())).shape[0] for c in left] == [4, 1]
        assert [next(iter(c.values())).shape[0] for c in right] == [3, 3]
        got = alg.pair(prepared.problem, left, right, KernelMode.FULL)
    assert_matches(got, reference_kernel(_reference(), j2_ref, "full"), rel=1e-12)


@pytest.mark.parametrize("mode", CONTRACTIONS, ids=str)
def test_chunked_sides_contract_per_group(mode: KernelMode) -> None:
    """The group kernels from chunked sides: each group's kernel is the reference over its parameters' columns."""
    model, x = _resnet()
    x2, j2_ref = _reference_x2()
    names = [name for name, _ in model.named_parameters()]
    groups = ParameterGroups(("head", "body"), (tuple(n for n in names if n.startswith("head")),
                                                 tuple(n for n in names if not n.startswith("head"))))  # fmt: skip
    with prepared_problem(model.double(), x.double(), x2.double(), params=None, dtype=torch.float64) as prepared:
        left = jacobian_chunks(prepared.problem, prepared.x1, chunk=2)
        right = jacobian_chunks(prepared.problem, prepared.x2, chunk=_X2_CHUNK)
        if not mode.spec.pairs:
            got = contract_groups_diagonal(left, groups)
        else:
            got = contract_groups(left, right, mode, groups)
    assert got.shape[0] == 2
    for g, members in enumerate(groups.members):
        cols = reference_columns(model, members)
        expected = reference_kernel(_reference()[..., cols], j2_ref[..., cols], mode.value)
        assert_matches(got[g], expected, rel=1e-12)


def test_a_chunk_keeps_the_largest_cotangent_buffer_under_the_mmap_threshold() -> None:
    """NOTE [cotangents on the heap]: the probe measures one example's largest saved tensor (here ReLU's output,
    8 x 6 x 6 float32, written out by hand), and a chunked call keeps k cotangents of it per example under glibc's
    mmap threshold, as well as its transient under CHUNK_BYTES."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 3))
    x = torch.randn(4, 2, 6, 6)
    with prepared_problem(model, x, None, params=None, dtype=None) as prepared:
        problem = prepared.problem
    assert problem.largest_saved_bytes == 8 * 6 * 6 * 4
    for largest in (64 * 2**10, 128 * 2**10, 3 * 2**20):
        # a transient that outweighs the Jacobian, so the call is chunked
        chunked = dataclasses.replace(problem, saved_bytes=2 * largest, largest_saved_bytes=largest)
        chunk = jacobian_chunk(chunked)
        assert chunk >= 1
        assert chunk == 1 or chunk * chunked.k * largest <= MMAP_THRESHOLD_BYTES
        assert (chunk + 1) * chunked.k * largest > MMAP_THRESHOLD_BYTES or (chunk + 1) * 2 * largest * (
            1 + chunked.k
        ) > CHUNK_BYTES
