"""Jacobian contraction: J per block with ``vmap(jacrev)``, then one matmul per parameter tensor.

Time (N+M)·k·[FP]·(1+2k)/k + N·M·k²·P for FULL (N·M·k·P for TRACE and OUTPUT_DIAGONAL, N·k²·P for
EXAMPLE_DIAGONAL); memory (n+m)·k·P floats per block pair plus the block result. Best for small k and an
expensive forward pass. The per-parameter Jacobians are never concatenated into one (N·k, P) matrix.

Each mode is its own contraction, accumulated in place over parameter tensors:
FULL (n·k, f) @ (f, m·k); TRACE (n, k·f) @ (k·f, m); OUTPUT_DIAGONAL k matmuls (n, f) @ (f, m);
EXAMPLE_DIAGONAL n matmuls (k, f) @ (f, k).

Attention runs on its math path (``math_attention``): the CPU flash kernel has no vmap batching rule, so
``vmap(jacrev)`` would run it example by example. Eval BatchNorm runs as its affine map (``affine_batchnorm``) and
strided 1x1 convolutions as a slice and a matmul (``strided_pointwise_convolution``): both differentiate under
``vmap(jacrev)`` into cheaper batched ops than their own kernels' backward.

NOTE [joint pass of Jacobians]: one ``vmap(jacrev)`` over x1 and x2 together does the same FLOPs as two, and
spares only the per-call overhead of the second; its buffers are twice as large, and past glibc's mmap threshold
(32 MiB, NOTE [allocator]) each one is fresh memory that faults on first touch. On the benchmark ResNet
(N = M = 32, FULL; one process, alternating) the joint pass took 1.11 s, 0.33 s of it system time, and 136k page
faults per call; two passes 0.74 s, 0.01 s and 1 fault, the torch.func tutorial 0.76 s. So the joint pass is
taken only while its whole side fits under that threshold (``joint_pays``), where the saved overhead matters.

NOTE [Jacobian chunks]: one ``vmap(jacrev)`` call holds the saved tensors of all its examples and k cotangents
of each, ~3.6x the Jacobian itself on the benchmark ResNet (11 MiB against 3 MiB per example), so there a call takes
at most ``CHUNK_BYTES`` of transient (71 examples). The bound was 384 MiB (35 examples) when every large buffer
was a fresh mapping (NOTE [large buffers] in runtime/allocator.py): on the ResNet at N = 128 a side took 5.07 CPU s and
896k page faults in one call, against 3.07 s and 131k faults in chunks of 35. With large buffers reused, a call's
overhead is what chunks cost: the ResNet's N = 128 TRACE kernel took 3.63 user s in 4 calls of 32 per side,
3.35 in 2 of 64, 3.16 in one call, the tutorial (one call, BatchNorm's own kernel) 3.55 (one process,
alternating, contended); 2 of 64 keep the side's peak at ~1.1 GB against ~1.8 GB in one call. Each chunk's
Jacobians are kept as ``vmap(jacrev)`` returned them (``JacobianChunks``) and contracted chunk pair by chunk
pair into slices of one accumulator: copying them into one (n, k, p) tensor per parameter wrote the whole side
twice and held a chunk's Jacobians twice (the transformer at N = M = 64, TRACE: 1.02M page faults and 2.06 s of
system time per call against the tutorial's 534k and 0.89 s; without the copy 428k and 0.65 s against 493k and
0.86 s, one process, alternating, contended). Where the transient is smaller than the Jacobian (the
transformer: 6 MiB against 17 MiB per example) chunking saves under half the side's peak and costs calls: in
chunks of 32 the transformer's N = 64 TRACE kernel took 1.81 user s against 1.58 in one call (the tutorial 1.59;
chunks of 16: 2.25), so such a side is one call, the tutorial's exact work. A tighter budget is met by smaller
blocks (``plan_blocks``).

NOTE [cotangents on the heap]: a ``vmap(jacrev)`` call's backward holds the cotangents of an activation for
all its examples and k outputs in one buffer, (c·k, *activation). Past glibc's mmap threshold (32 MiB, NOTE
[allocator]) such a buffer is a fresh mapping in every call, faulted in page by page, while below it the heap
reuses freed memory. On the benchmark ResNet (16 channels at 32 x 32: 64 KiB per example, k = 10) a call of 64
examples took 3.50 CPU s for N = M = 64 TRACE and two calls of 32 took 2.21 (the tutorial, one call: 3.52;
FULL: 3.79 and 2.44 against 4.14); with 32 channels (128 KiB) one call 9.32, calls of 32 8.61, of 16 6.95, the
tutorial 10.18 (one process, alternating, contended). So where chunks are taken at all, a call also keeps
k x the largest saved tensor per example under that threshold (``largest_saved_bytes``, from the probe).

NOTE [per-example loop]: a model whose forward branches on values (Hugging Face BERT's attention mask:
``if padding_mask.all(): ...``) is refused by ``vmap`` as data-dependent control flow. The probe
(``probe._check_independent``) then evaluates it one example at a time and, when that works, declares
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

from ntk_service.kernels.algorithm import GroupKernels, JointPass
from ntk_service.kernels.groups import ParameterGroups
from ntk_service.kernels.modes import KernelMode, Outputs
from ntk_service.kernels.problem.affine_batchnorm import batchnorm_scope
from ntk_service.kernels.problem.batch import Batch, batch_size, concat, one_example, take
from ntk_service.kernels.problem.math_attention import math_attention
from ntk_service.kernels.problem.pointwise_convolution import pointwise_scope
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.runtime.allocator import MMAP_THRESHOLD_BYTES
from ntk_service.kernels.types import NamedTensors, NtkImplementation

__all__ = [
    "CHUNK_BYTES",
    "JACOBIAN_CONTRACTION_WEIGHT",
    "JacobianChunks",
    "JacobianContraction",
    "Jacobians",
    "contract_groups",
    "contract_groups_diagonal",
    "jacobian_chunk",
    "jacobian_chunks",
    "jacobians",
    "split_chunks",
]

CHUNK_BYTES = 768 * 2**20
"""Bound on one ``vmap(jacrev)`` call's transient (NOTE [Jacobian chunks])."""


def jacobian_chunk(problem: NtkProblem) -> int:
    """Examples per ``vmap(jacrev)`` call (NOTE [Jacobian chunks]): all of them (one call, the tutorial's work)
    unless a call's transient, saved tensors plus k cotangents of them per example, outweighs the Jacobian it
    builds; then as many as keep that transient under ``CHUNK_BYTES`` and the k cotangents of the largest saved
    tensor under glibc's mmap threshold (NOTE [cotangents on the heap])."""
    per_example = problem.saved_bytes * (1 + problem.k)
    if per_example <= problem.k * problem.num_params * problem.itemsize:
        return 1 << 30
    by_transient = int(CHUNK_BYTES // per_example)
    largest = problem.k * problem.largest_saved_bytes
    by_buffer = int(MMAP_THRESHOLD_BYTES // largest) if largest > 0 else by_transient
    return max(1, min(by_transient, by_buffer))


JacobianChunks = tuple[NamedTensors, ...]
"""A side of the Jacobian contraction: the Jacobians of consecutive chunks of examples, each name -> (c, k, p),
as ``vmap(jacrev)`` returned them (NOTE [Jacobian chunks]: never copied into one tensor)."""


def jacobian_chunks(
    problem: NtkProblem, x: Batch, *, chunk: int | None = None, affine_bn: bool = True, pointwise: bool = True
) -> JacobianChunks:
    """Per-example Jacobians of the selected parameters, one ``vmap(jacrev)`` call per chunk of examples.

    Args:
        problem: the prepared model.
        x: (n, *input).
        chunk: examples per ``vmap(jacrev)`` call. Default: ``jacobian_chunk(problem)``.
        affine_bn: run eval BatchNorm as its affine map (``affine_batchnorm``). Default: True.
        pointwise: run strided 1x1 convolutions as a slice and a matmul (``strided_pointwise_convolution``).
            Default: True.

    Returns:
        The chunks in order, each name -> (c, k, p) with p = numel of that parameter; the c sum to n, and
        as many calls as ``chunk`` needs are evened out (128 in 4 x 32, not 3 x 35 + 23).
    """
    n, k = batch_size(x), problem.k
    chunk = jacobian_chunk(problem) if chunk is None else chunk
    calls = -(-n // max(1, chunk))
    size = -(-n // calls)
    scope = batchnorm_scope(problem.module) if affine_bn else contextlib.nullcontext()
    convolution = pointwise_scope(problem.module) if pointwise else contextlib.nullcontext()
    build = vmap(jacrev(problem.f_single), (None, 0)) if not problem.per_example_loop else _looped(problem)
    with math_attention(), scope, convolution:
        return tuple(
            {name: j.reshape(j.shape[0], k, -1) for name, j in build(problem.params, take(x, i0, i0 + size)).items()}
            for i0 in range(0, n, size)
        )


def _looped(problem: NtkProblem) -> Callable[[NamedTensors, Batch], NamedTensors]:
    """``vmap(jacrev(f_single))`` as a loop of one ``jacrev`` per example (NOTE [per-example loop])."""
    one = jacrev(problem.f_single)

    def build(params: NamedTensors, x: Batch) -> NamedTensors:
        rows = [one(params, one_example(x, i)) for i in range(batch_size(x))]
        return {name: torch.stack([row[name] for row in rows]) for name in params}

    return build


def jacobians(
    problem: NtkProblem, x: Batch, *, chunk: int | None = None, affine_bn: bool = True, pointwise: bool = True
) -> NamedTensors:
    """Per-example Jacobians of the selected parameters as one tensor per parameter (``jacobian_chunks``
    concatenated when there is more than one chunk).

    Args:
        problem, x, chunk, affine_bn, pointwise: as for ``jacobian_chunks``.

    Returns:
        name -> (n, k, p) with p = numel of that parameter.
    """
    chunks = jacobian_chunks(problem, x, chunk=chunk, affine_bn=affine_bn, pointwise=pointwise)
    if len(chunks) == 1:
        return chunks[0]
    return {name: torch.cat([c[name] for c in chunks]) for name in chunks[0]}


def _offsets(side: JacobianChunks) -> list[tuple[int, int]]:
    """(start, stop) of each chunk's examples within its side."""
    spans, start = [], 0
    for c in side:
        stop = start + next(iter(c.values())).shape[0]
        spans.append((start, stop))
        start = stop
    return spans


def split_chunks(side: JacobianChunks, n: int) -> tuple[JacobianChunks, JacobianChunks]:
    """The chunks of examples [0, n) and [n, end) of a side (views; a chunk across n is cut in two)."""
    head: list[NamedTensors] = []
    tail: list[NamedTensors] = []
    for c, (start, stop) in zip(side, _offsets(side), strict=True):
        if stop <= n:
            head.append(c)
        elif start >= n:
            tail.append(c)
        else:
            head.append({name: j[: n - start] for name, j in c.items()})
            tail.append({name: j[n - start :] for name, j in c.items()})
    return tuple(head), tuple(tail)


Jacobians = NamedTensors | JacobianChunks
"""What the contractions take: one name -> (n, k, p) mapping (``jacobians``), or a side's chunks of them."""


def _chunked(side: Jacobians) -> JacobianChunks:
    """A side as its chunks: a single mapping is one chunk."""
    return (side,) if isinstance(side, dict) else side


def _shape(side: JacobianChunks) -> tuple[int, int]:
    """(examples, k) of a side."""
    first = next(iter(side[0].values()))
    return _offsets(side)[-1][1], first.shape[1]


def contract(j1: Jacobians, j2: Jacobians, mode: KernelMode) -> torch.Tensor:
    """Contract the Jacobians of two sides, chunk pair by chunk pair into one accumulator, for ``mode``'s outputs.

    Args:
        j1: the Jacobians of n examples, name -> (n, k, p) or chunks of them (``JacobianChunks``).
        j2: the Jacobians of m examples, likewise.
        mode: a mode of example pairs: its outputs axis picks the contraction (NOTE [mode contractions]).

    Returns:
        (n, m, k, k) all outputs (FULL), (n, m) their sum (TRACE), (n, m, k) their diagonal (OUTPUT_DIAGONAL).

    Raises:
        ValueError: a per-example mode (``contract_diagonal`` contracts its blocks).
    """
    outputs = _pair_outputs(mode, "contract")
    j1, j2 = _chunked(j1), _chunked(j2)
    n, k = _shape(j1)
    m = _shape(j2)[0]
    first = next(iter(j1[0].values()))
    if outputs is Outputs.ALL:
        full = first.new_zeros(n * k, m * k)
        for a, (i0, i1) in zip(j1, _offsets(j1), strict=True):
            for b, (l0, l1) in zip(j2, _offsets(j2), strict=True):
                out = full[i0 * k : i1 * k, l0 * k : l1 * k]
                for name, ja in a.items():
                    out.addmm_(ja.reshape((i1 - i0) * k, -1), b[name].reshape((l1 - l0) * k, -1).T)
        return full.view(n, k, m, k).permute(0, 2, 1, 3)
    if outputs is Outputs.SUM:
        trace = first.new_zeros(n, m)
        for a, (i0, i1) in zip(j1, _offsets(j1), strict=True):
            for b, (l0, l1) in zip(j2, _offsets(j2), strict=True):
                out = trace[i0:i1, l0:l1]
                for name, ja in a.items():
                    out.addmm_(ja.reshape(i1 - i0, -1), b[name].reshape(l1 - l0, -1).T)
        return trace
    if outputs is Outputs.DIAGONAL:
        diag = first.new_zeros(k, n, m)
        for a, (i0, i1) in zip(j1, _offsets(j1), strict=True):
            for b, (l0, l1) in zip(j2, _offsets(j2), strict=True):
                out = diag[:, i0:i1, l0:l1]
                for name, ja in a.items():
                    out.baddbmm_(ja.transpose(0, 1), b[name].permute(1, 2, 0))
        return diag.permute(1, 2, 0)
    raise ValueError(f"contract: outputs {outputs} of mode {mode} have no contraction")


def _pair_outputs(mode: KernelMode, operation: str) -> Outputs:
    """The outputs axis of a mode of example pairs, which picks its contraction (NOTE [mode contractions] in
    modes.py); a per-example mode here is a caller's bug: its blocks are ``{operation}_diagonal``'s."""
    if not mode.spec.pairs:
        raise ValueError(f"{operation}: mode {mode} is per example; its blocks are {operation}_diagonal's")
    return mode.spec.outputs


def contract_diagonal(j1: Jacobians) -> torch.Tensor:
    """EXAMPLE_DIAGONAL from the chunks name -> (c, k, p) of a side of n examples: (n, k, k)."""
    j1 = _chunked(j1)
    n, k = _shape(j1)
    out = next(iter(j1[0].values())).new_zeros(n, k, k)
    for a, (i0, i1) in zip(j1, _offsets(j1), strict=True):
        for ja in a.values():
            out[i0:i1].baddbmm_(ja, ja.transpose(1, 2))
    return out


def contract_groups(j1: JacobianChunks, j2: JacobianChunks, mode: KernelMode, groups: ParameterGroups) -> torch.Tensor:
    """``contract`` per parameter group: each parameter's product goes into its group's accumulator.

    Returns:
        (G, n, m, k, k) all outputs, (G, n, m) their sum, (G, n, m, k) their diagonal, in the order of
        ``groups.names``.

    Raises:
        ValueError: a per-example mode (``contract_groups_diagonal`` contracts its blocks).
    """
    outputs = _pair_outputs(mode, "contract_groups")
    j1, j2 = _chunked(j1), _chunked(j2)
    n, k = _shape(j1)
    m = _shape(j2)[0]
    first = next(iter(j1[0].values()))
    of, count = groups.index, len(groups)
    if outputs is Outputs.ALL:
        full = first.new_zeros(count, n * k, m * k)
        for a, (i0, i1) in zip(j1, _offsets(j1), strict=True):
            for b, (l0, l1) in zip(j2, _offsets(j2), strict=True):
                for name, ja in a.items():
                    full[of[name], i0 * k : i1 * k, l0 * k : l1 * k].addmm_(
                        ja.reshape((i1 - i0) * k, -1), b[name].reshape((l1 - l0) * k, -1).T
                    )
        return full.view(count, n, k, m, k).permute(0, 1, 3, 2, 4)
    if outputs is Outputs.SUM:
        trace = first.new_zeros(count, n, m)
        for a, (i0, i1) in zip(j1, _offsets(j1), strict=True):
            for b, (l0, l1) in zip(j2, _offsets(j2), strict=True):
                for name, ja in a.items():
                    trace[of[name], i0:i1, l0:l1].addmm_(ja.reshape(i1 - i0, -1), b[name].reshape(l1 - l0, -1).T)
        return trace
    if outputs is Outputs.DIAGONAL:
        diag = first.new_zeros(count, k, n, m)
        for a, (i0, i1) in zip(j1, _offsets(j1), strict=True):
            for b, (l0, l1) in zip(j2, _offsets(j2), strict=True):
                for name, ja in a.items():
                    diag[of[name], :, i0:i1, l0:l1].baddbmm_(ja.transpose(0, 1), b[name].permute(1, 2, 0))
        return diag.permute(0, 2, 3, 1)
    raise ValueError(f"contract_groups: outputs {outputs} of mode {mode} have no contraction")


def contract_groups_diagonal(j1: Jacobians, groups: ParameterGroups) -> torch.Tensor:
    """EXAMPLE_DIAGONAL per parameter group from the chunks name -> (c, k, p) of a side: (G, n, k, k)."""
    j1 = _chunked(j1)
    n, k = _shape(j1)
    out = next(iter(j1[0].values())).new_zeros(len(groups), n, k, k)
    for a, (i0, i1) in zip(j1, _offsets(j1), strict=True):
        for name, ja in a.items():
            out[groups.index[name], i0:i1].baddbmm_(ja, ja.transpose(1, 2))
    return out


JACOBIAN_CONTRACTION_WEIGHT = 1.0
"""AUTO's cost of one estimated FLOP of the Jacobian contraction: the reference the other weights are relative to
(NOTE [auto choice] in choice.py)."""


class JacobianContraction:
    """The NtkAlgorithm of Jacobian contraction (see the module docstring); it has both optional capabilities."""

    implementation = NtkImplementation.JACOBIAN_CONTRACTION
    right_is_left = True

    @property
    def joint_pass(self) -> JointPass:
        return self

    @property
    def group_kernels(self) -> GroupKernels:
        return self

    def left(self, problem: NtkProblem, x: Batch) -> JacobianChunks:
        return jacobian_chunks(problem, x)

    right = left

    def pair(self, problem: NtkProblem, left: JacobianChunks, right: JacobianChunks, mode: KernelMode) -> torch.Tensor:
        return contract(left, right, mode)

    def diagonal(self, problem: NtkProblem, left: JacobianChunks) -> torch.Tensor:
        return contract_diagonal(left)

    def side_bytes(self, problem: NtkProblem, n: int, *, left: bool) -> tuple[float, float]:
        kept = n * problem.k * problem.num_params * problem.itemsize
        # One vmap(jacrev) call at a time (NOTE [Jacobian chunks]): its saved tensors plus k cotangents of them;
        # each chunk's Jacobian is kept as it came (no copy), so the side holds nothing more.
        chunk = min(n, jacobian_chunk(problem))
        transient = chunk * problem.saved_bytes * (1 + problem.k)
        return kept + transient, kept

    def pair_bytes(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        k, spec = problem.k, mode.spec
        if not spec.pairs:  # the per-example blocks of all outputs
            return n * k * k * problem.itemsize
        return 2 * n * m * spec.outputs.entries(k) * problem.itemsize  # the accumulator and its copy into theta

    def flops(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        k, p, spec = problem.k, problem.num_params, mode.spec
        sides = (n + m if spec.pairs else n) * problem.forward_flops * (1 + 2 * k)
        if not spec.pairs:  # the per-example blocks of all outputs
            return sides + 2 * n * k * k * p
        return sides + 2 * n * m * spec.outputs.products(k) * p

    def cost_weight(self, problem: NtkProblem) -> float:
        return JACOBIAN_CONTRACTION_WEIGHT

    def joint_sides(self, problem: NtkProblem, x1: Batch, x2: Batch) -> tuple[JacobianChunks, JacobianChunks]:
        """The Jacobians of x1 and of x2 from one pass over both (views)."""
        return split_chunks(self.left(problem, concat(x1, x2)), batch_size(x1))

    def joint_pays(self, problem: NtkProblem, n: int, m: int) -> bool:
        """Whether one pass over x1 and x2 together beats two (NOTE [joint pass of Jacobians])."""
        return self.side_bytes(problem, n + m, left=True)[0] <= MMAP_THRESHOLD_BYTES

    def pair_groups(
        self,
        problem: NtkProblem,
        left: JacobianChunks,
        right: JacobianChunks,
        mode: KernelMode,
        groups: ParameterGroups,
    ) -> torch.Tensor:
        return contract_groups(left, right, mode, groups)

    def diagonal_groups(self, problem: NtkProblem, left: JacobianChunks, groups: ParameterGroups) -> torch.Tensor:
        return contract_groups_diagonal(left, groups)
