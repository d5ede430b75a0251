"""NTK-vector products: Θ(x1, x2) e_c = J(x2) (J(x1)ᵀ e_c); J(x2) is never built.

For a block of x1 the k VJP rows u_{i,c} = J(x1_i)ᵀ e_c are formed (vmap over the output basis of one
``vjp`` per example); one ``jvp`` of the batched model per row then gives J(x2_j) u_{i,c} for every x2 example
of the block, vmapped over the rows. TRACE and OUTPUT_DIAGONAL keep only the c-th entry, inside the vmap.

Time N·k·[FP]·(1+2k)/k + 2·N·M·k·[FP]; memory n·k·P for the rows plus n·k·m forward-mode activations per block.
Best when P is huge relative to [FP] (wide layers, few examples) or k is large.

Forward-mode products run under ``math_attention()``: attention's fused eval kernels have no forward-mode AD, its
math path has (``problem/math_attention.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.func import jvp, vmap

from ntk_service.kernels.jacobian_contraction import jacobians
from ntk_service.kernels.modes import KernelMode, Outputs
from ntk_service.kernels.problem.batch import Batch, batch_size
from ntk_service.kernels.problem.embedding_padding import padding_as_constant
from ntk_service.kernels.problem.forward_mode import FORWARD_AD_LOCK, forward_mode
from ntk_service.kernels.problem.math_attention import math_attention
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.types import NamedTensors, NtkImplementation

__all__ = ["NTK_VECTOR_PRODUCTS_WEIGHT", "NtkVectorProducts"]

NTK_VECTOR_PRODUCTS_WEIGHT = 3.0
"""AUTO's cost of one estimated FLOP of the NTK-vector products, relative to the Jacobian contraction's: forward-mode
products run at a lower fraction of peak than a contraction's dense matmuls on the CPU (measured with
benchmarks/bench_kernels.py; NOTE [auto choice] in choice.py)."""

_FORWARD_AD_LOCK = FORWARD_AD_LOCK
"""The lock's old name here (``problem/forward_mode.py`` holds it now), kept for old imports for one release."""


@contextmanager
def _forward_ad() -> Iterator[None]:
    """A forward-mode pass (``forward_mode``) with attention on its math path (``math_attention``, this thread only)
    and the lookups of an embedding's padding index constant, as reverse mode holds them (``padding_as_constant``).

    Raises:
        UnsupportedModel: torch has no forward-mode AD for an operation the model uses.
    """
    advice = "use implementation='jacobian_contraction' or 'structured'"
    with forward_mode("compute_ntk (ntk_vector_products)", advice), math_attention(), padding_as_constant():
        yield


VjpRows = tuple[Batch, NamedTensors]
"""(x block (n, *input), rows name -> (n, k, *param_shape)): the x1-side of a block."""


def _rows(problem: NtkProblem, x: Batch) -> NamedTensors:
    """u_{i,c} = J(x_i)ᵀ e_c for every example and output: name -> (n, k, *param_shape)."""
    flat = jacobians(problem, x)
    return {name: j.reshape(batch_size(x), problem.k, *problem.params[name].shape) for name, j in flat.items()}


def _jvp_at(problem: NtkProblem, x: Batch, tangent: NamedTensors) -> torch.Tensor:
    """J(x) t for one example x (*input) and one parameter-space tangent t: (k,)."""
    out: torch.Tensor = jvp(lambda p: problem.f_single(p, x), (problem.params,), (tangent,))[1]
    return out


class NtkVectorProducts:
    """The NtkAlgorithm of NTK-vector products (see the module docstring). No optional capability: its right side is
    the inputs themselves (no pass to share with x1's), and it forms no per-parameter terms (Θ·e by one JVP of a VJP
    over all parameters at once) to split by group."""

    implementation = NtkImplementation.NTK_VECTOR_PRODUCTS
    right_is_left = False
    joint_pass: None = None
    group_kernels: None = None

    def left(self, problem: NtkProblem, x: Batch) -> VjpRows:
        return x, _rows(problem, x)

    def right(self, problem: NtkProblem, x: Batch) -> Batch:
        return x

    def pair(self, problem: NtkProblem, left: VjpRows, right: Batch, mode: KernelMode) -> torch.Tensor:
        x1, rows = left
        n, k, m = batch_size(x1), problem.k, batch_size(right)
        outputs = mode.spec.outputs  # what a row keeps (NOTE [mode contractions] in modes.py)
        flat_rows = {name: r.reshape(n * k, *r.shape[2:]) for name, r in rows.items()}
        basis = torch.eye(k, dtype=problem.dtype).repeat(n, 1)  # (n·k, k): e_c for row (i, c)

        def one(row: NamedTensors, e_c: torch.Tensor) -> torch.Tensor:
            # One jvp of the batched model: the examples are independent (checked by the probe), so this is
            # J(x2_j) u_{i,c} for every j at once: (m, k) = Θ(x1_i, x2_j)[c, :].
            product: torch.Tensor = jvp(lambda p: problem.f_batch(p, right), (problem.params,), (row,))[1]
            return product if outputs is Outputs.ALL else product @ e_c

        with _forward_ad():
            products = vmap(one)(flat_rows, basis)  # (n·k, m[, k])
        if outputs is Outputs.ALL:
            return products.view(n, k, m, k).permute(0, 2, 1, 3)
        per_output = products.view(n, k, m).permute(0, 2, 1)  # (n, m, k)
        return per_output if outputs is Outputs.DIAGONAL else per_output.sum(-1)

    def diagonal(self, problem: NtkProblem, left: VjpRows) -> torch.Tensor:
        x1, rows = left

        def one(x_i: Batch, rows_i: NamedTensors) -> torch.Tensor:
            return vmap(lambda row: _jvp_at(problem, x_i, row))(rows_i)  # (k, k)

        with _forward_ad():
            return vmap(one)(x1, rows)

    def side_bytes(self, problem: NtkProblem, n: int, *, left: bool) -> tuple[float, float]:
        if not left:
            return 0.0, 0.0
        kept = n * problem.k * problem.num_params * problem.itemsize
        return kept + n * problem.saved_bytes * (1 + problem.k), kept

    def pair_bytes(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        k = problem.k
        m = m if mode.spec.pairs else 1
        # forward-mode: primal and tangent activations of every (row, x2 example) at once, and the products.
        return n * k * m * (2 * problem.saved_bytes + 2 * k * problem.itemsize)

    def flops(self, problem: NtkProblem, n: int, m: int, mode: KernelMode) -> float:
        k, fp = problem.k, problem.forward_flops
        pairs = n * m if mode.spec.pairs else n
        return n * fp * (1 + 2 * k) + 2 * pairs * k * fp

    def cost_weight(self, problem: NtkProblem) -> float:
        return NTK_VECTOR_PRODUCTS_WEIGHT
