"""Jacobian contraction: J per block with ``vmap(jacrev)``, then one matmul per parameter tensor.

Time (N+M)·k·[FP]·(1+2k)/k + N·M·k²·P for FULL (N·M·k·P for TRACE and OUTPUT_DIAGONAL, N·k²·P for
EXAMPLE_DIAGONAL); memory (n+m)·k·P floats per block pair plus the block result. Best for small k and an
expensive forward pass. The per-parameter Jacobians are never concatenated into one (N·k, P) matrix.

Each mode is its own contraction, accumulated in place over parameter tensors:
FULL (n·k, f) @ (f, m·k); TRACE (n, k·f) @ (k·f, m); OUTPUT_DIAGONAL k matmuls (n, f) @ (f, m);
EXAMPLE_DIAGONAL n matmuls (k, f) @ (f, k).

Attention runs on its math path (``math_attention``): the CPU flash kernel has no vmap batching rule, so
``vmap(jacrev)`` would run it example by example.

NOTE [joint pass of Jacobians]: one ``vmap(jacrev)`` over x1 and x2 together does the same FLOPs as two, and
spares only the per-call overhead of the second; its buffers are twice as large, and past glibc's mmap threshold
(32 MiB, NOTE [allocator]) each one is fresh memory that faults on first touch. On the benchmark ResNet
(N = M = 32, FULL; one process, alternating) the joint pass took 1.11 s, 0.33 s of it system time, and 136k page
faults per call; two passes 0.74 s, 0.01 s and 1 fault, the torch.func tutorial 0.76 s. So the joint pass is
taken only while its whole side fits under that threshold (``joint_pays``), where the saved overhead matters.

NOTE [Jacobian chunks]: one ``vmap(jacrev)`` call holds the saved tensors of all its examples and k cotangents
of each, ~3.6x the Jacobian itself on the benchmark ResNet (11 MiB against 3 MiB per example). Past the mmap
threshold that transient is fresh memory on every call: on the ResNet at N = 128 a side took 5.07 CPU s and 896k
page faults in one call, against 3.07 s and 131k faults in chunks of 35 (one process, alternating, eval
BatchNorm affine in both), so a call takes at most ``CHUNK_BYTES`` of transient, written into the side's
preallocated (n, k, p) tensors. Below ~32 examples a smaller chunk only adds per-call overhead (16 of 32: 1.13x
the CPU time), hence the bound: the ResNet and transformer at N = 32 run in one call, as before.

NOTE [per-example loop]: a model whose forward branches on values (Hugging Face BERT's attention mask:
``if padding_mask.all(): ...``) is refused by ``vmap`` as data-dependent control flow. The probe
(``functional._check_independent``) then evaluates it one example at a time and, when that works, declares
``NtkProblem.per_example_loop``: the Jacobians are built by one ``jacrev`` per example (the same numbers, n calls
instead of one batched call), AUTO takes this implementation, and the result says so (``NtkResult.per_example_loop``).
The implementations that must batch examples through ``vmap`` (NTK-vector products, the structured capture) refuse
such a problem up front with a message naming this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.func import jacrev, vmap

from ntk_service.kernels.affine_batchnorm import batchnorm_scope
from ntk_service.kernels.allocator import MMAP_THRESHOLD_BYTES
from ntk_service.kernels.functional import NtkProblem
from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.inputs import Batch, batch_size, concat, one_example, take
from ntk_service.kernels.math_attention import math_attention
from ntk_service.kernels.modes import KernelMode
from ntk_service.kernels.types import NamedTensors, NtkImplementation

__all__ = [
    "CHUNK_BYTES",
    "JacobianContraction",
    "contract_groups",
    "contract_groups_diagonal",
    "jacobian_chunk",
    "jacobians",
]

CHUNK_BYTES = 384 * 2**20
"""Bound on one ``vmap(jacrev)`` call's transient (NOTE [Jacobian chunks])."""


def jacobian_chunk(problem: NtkProblem) -> int:
    """Examples per ``vmap(jacrev)`` call: its transient, saved tensors plus k cotangents of them per example,
    kept under ``CHUNK_BYTES`` (NOTE [Jacobian chunks])."""
    per_example = problem.saved_bytes * (1 + problem.k)
    return max(1, int(CHUNK_BYTES // per_example)) if per_example > 0 else 1 << 30


def jacobians(problem: NtkProblem, x: Batch, *, chunk: int | None = None, affine_bn: bool = True) -> NamedTensors:
    """Per-example Jacobians of the selected parameters.

    Args:
        problem: the prepared model.
        x: (n, *input).
        chunk: examples per ``vmap(jacrev)`` call. Default: ``jacobian_chunk(problem)``.
        affine_bn: run eval BatchNorm as its affine map (``affine_batchnorm``). Default: True.

    Returns:
        name -> (n, k, p) with p = numel of that parameter.
    """
    n, k = batch_size(x), problem.k
    chunk = jacobian_chunk(problem) if chunk is None else chunk
    scope = batchnorm_scope(problem.module) if affine_bn else contextlib.nullcontext()
    build = vmap(jacrev(problem.f_single), (None, 0)) if not problem.per_example_loop else _looped(problem)
    with math_attention(), scope:
        if n <= chunk:
            return {name: j.reshape(n, k, -1) for name, j in build(problem.params, x).items()}
        chunk = -(-n // -(-n // chunk))  # as many calls, evened out: 128 in 4 x 32, not 3 x 35 + 23
        out = {name: p.new_empty((n, k, p.numel())) for name, p in problem.params.items()}
        for i0 in range(0, n, chunk):
            for name, j in build(problem.params, take(x, i0, i0 + chunk)).items():
                out[name][i0 : i0 + chunk] = j.reshape(j.shape[0], k, -1)
    return out


def _looped(problem: NtkProblem) -> Callable[[NamedTensors, Batch], NamedTensors]:
    """``vmap(jacrev(f_single))`` as a loop of one ``jacrev`` per example (NOTE [per-example loop])."""
    one = jacrev(problem.f_single)

    def build(params: NamedTensors, x: Batch) -> NamedTensors:
        rows = [one(params, one_example(x, i)) for i in range(batch_size(x))]
        return {name: torch.stack([row[name] for row in rows]) for name in params}

    return build


def contract(j1: NamedTensors, j2: NamedTensors, mode: KernelMode) -> torch.Tensor:
    """Contract per-parameter Jacobians j1 (name -> (n, k, p)) with j2 (name -> (m, k, p)) for ``mode``.

    Returns:
        (n, m, k, k) FULL, (n, m) TRACE, (n, m, k) OUTPUT_DIAGONAL.
    """
    first = next(iter(j1.values()))
    n, k = first.shape[:2]
    m = next(iter(j2.values())).shape[0]
    if mode is KernelMode.FULL:
        out = first.new_zeros(n * k, m * k)
        for name, a in j1.items():
            out.addmm_(a.reshape(n * k, -1), j2[name].reshape(m * k, -1).T)
        return out.view(n, k, m, k).permute(0, 2, 1, 3)
    if mode is KernelMode.TRACE:
        out = first.new_zeros(n, m)
        for name, a in j1.items():
            out.addmm_(a.reshape(n, -1), j2[name].reshape(m, -1).T)
        return out
    if mode is KernelMode.OUTPUT_DIAGONAL:
        out = first.new_zeros(k, n, m)
        for name, a in j1.items():
            out.baddbmm_(a.transpose(0, 1), j2[name].permute(1, 2, 0))
        return out.permute(1, 2, 0)
    raise ValueError(f"contract: mode {mode} is contracted by contract_diagonal")


def contract_diagonal(j1: NamedTensors) -> torch.Tensor:
    """EXAMPLE_DIAGONAL from per-parameter Jacobians name -> (n, k, p): (n, k, k)."""
    first = next(iter(j1.values()))
    n, k = first.shape[:2]
    out = first.new_zeros(n, k, k)
    for a in j1.values():
        out.baddbmm_(a, a.transpose(1, 2))
    return out


def contract_groups(j1: NamedTensors, j2: NamedTensors, mode: KernelMode, groups: ParameterGroups) -> torch.Tensor:
    """``contract`` per parameter group: each parameter's product goes into its group's accumulator.

    Returns:
        (G, n, m, k, k) FULL, (G, n, m) TRACE, (G, n, m, k) OUTPUT_DIAGONAL, in the order of ``groups.names``.
    """
    first = next(iter(j1.values()))
    n, k = first.shape[:2]
    m = next(iter(j2.values())).shape[0]
    of, count = groups.index, len(groups)
    if mode is KernelMode.FULL:
        out = first.new_zeros(count, n * k, m * k)
        for name, a in j1.items():
            out[of[name]].addmm_(a.reshape(n * k, -1), j2[name].reshape(m * k, -1).T)
        return out.view(count, n, k, m, k).permute(0, 1, 3, 2, 4)
    if mode is KernelMode.TRACE:
        out = first.new_zeros(count, n, m)
        for name, a in j1.items():
            out[of[name]].addmm_(a.reshape(n, -1), j2[name].reshape(m, -1).T)
        return out
    if mode is KernelMode.OUTPUT_DIAGONAL:
        out = first.new_zeros(count, k, n, m)
        for name, a in j1.items():
            out[of[name]].baddbmm_(a.transpose(0, 1), j2[name].permute(1, 2, 0))
        return out.permute(0, 2, 3, 1)
    raise ValueError(f"contract_groups: mode {mode} is contracted by contract_groups_diagonal")


def contract_groups_diagonal(j1: NamedTensors, groups: ParameterGroups) -> torch.Tensor:
    """EXAMPLE_DIAGONAL per parameter group from per-parameter Jacobians name -> (n, k, p): (G, n, k, k)."""
    first = next(iter(j1.values()))
    n, k = first.shape[:2]
    out = first.new_zeros(len(groups), n, k, k)
    for name, a in j1.items():
        out[groups.index[name]].baddbmm_(a, a.transpose(1, 2))
    return out


class JacobianContraction:
    """The NtkAlgorithm of Jacobian contraction (see the module docstring)."""

    implementation = NtkImplementation.JACOBIAN_CONTRACTION
    right_is_left = True

    def left(self, problem: NtkProblem, x: Batch) -> NamedTensors:
        return jacobians(problem, x)

    def joint_sides(self, problem: NtkProblem, x1: Batch, x2: Batch) -> tuple[NamedTensors, NamedTensors]:
        """The Jacobians of x1 and of x2 from one pass over both (views)."""
        n = batch_size(x1)
        side = self.left(problem, concat(x1, x2))
        return {name: j[:n] for name, j in side.items()}, {name: j[n:] for name, j in side.items()}

    right = left

    def joint_pays(self, problem: NtkProblem, n: int, m: int) -> bool:
        """Whether one pass over x1 and x2 together beats two (NOTE [joint pass of Jacobians])."""
        return self.side_bytes(problem, n + m, left=True)[0] <= MMAP_THRESHOLD_BYTES

    def pair(self, problem: NtkProblem, left: NamedTensors, right: NamedTensors, mode: KernelMode) -> torch.Tensor:
        return contract(left, right, mode)

    def diagonal(self, problem: NtkProblem, left: NamedTensors) -> torch.Tensor:
        return contract_diagonal(left)

    def pair_groups(
        self, problem: NtkProblem, left: NamedTensors, right: NamedTensors, mode: KernelMode, groups: ParameterGroups
    ) -> torch.Tensor:
        return contract_groups(left, right, mode, groups)

    def diagonal_groups(self, problem: NtkProblem, left: NamedTensors, groups: ParameterGroups) -> torch.Tensor:
        return contract_groups_diagonal(left, groups)

    def side_bytes(self, problem: NtkProblem, n: int, *, left: bool) -> tuple[float, float]:
        kept = n * problem.k * problem.num_params * problem.itemsize
        # One vmap(jacrev) call at a time (NOTE [Jacobian chunks]): its saved tensors plus k cotangents of them,
        # and, when chunked, the chunk's own Jacobian before it is copied into the side.
        chunk = min(n, jacobian_chunk(problem))
        transient = chunk * problem.saved_bytes * (1 + problem.k)
        if chunk < n:
            transient += chunk * problem.k * problem.num_params * problem.itemsize
        return kept + transient, kept

    def pair_bytes(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        k = problem.k
        per_pair = {KernelMode.FULL: k * k, KernelMode.TRACE: 1, KernelMode.OUTPUT_DIAGONAL: k}.get(mode, 0)
        if mode is KernelMode.EXAMPLE_DIAGONAL:
            return n * k * k * problem.itemsize
        return 2 * n * m * per_pair * problem.itemsize  # the accumulator and its copy into theta

    def flops(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        k, p = problem.k, problem.num_params
        sides = (n if mode is KernelMode.EXAMPLE_DIAGONAL else n + m) * problem.forward_flops * (1 + 2 * k)
        contraction = {
            KernelMode.FULL: 2 * n * m * k * k * p,
            KernelMode.TRACE: 2 * n * m * k * p,
            KernelMode.OUTPUT_DIAGONAL: 2 * n * m * k * p,
            KernelMode.EXAMPLE_DIAGONAL: 2 * n * k * k * p,
        }[mode]
        return sides + contraction
