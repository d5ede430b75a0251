"""``ntk_operator``: Θ(x1, x2) as a matrix-free linear operator, v ↦ Θ v = J(x1) (J(x2)ᵀ v); never builds J or Θ.

One VJP of the batched model over x2 with cotangent v gives u = J(x2)ᵀ v in parameter space (summed over
chunks of examples); one JVP over x1 with tangent u gives J(x1) u. Both run over chunks of examples sized to
the memory budget and ``MAX_CHUNK_BYTES`` of activations, so memory is O(P + (N + M)·k) plus one chunk of
activations, whatever N is: the operator is how to use Θ when it does not fit (Lanczos with
``scipy.sparse.linalg.eigsh``, conjugate gradients).

=================== ============================== ============= ===========================================
mode                matrix                         v             cost per product
=================== ============================== ============= ===========================================
FULL                (N·k, M·k), row n·k + a        (M, k)        M VJPs + N JVPs, examples batched
TRACE               (N, M), Σ_a Θ_aa               (M,)          k times FULL (one VJP and JVP per output)
PSEUDO              (N, M), (1/k) Σ_ab Θ_ab        (M,)          as FULL (cotangent v_m on every output)
=================== ============================== ============= ===========================================

The FULL matrix is example-major: entry (n·k + a, m·k + b) is Θ[n, m, a, b], i.e.
``theta.permute(0, 2, 1, 3).reshape(N*k, M*k)`` of ``compute_ntk``'s FULL kernel (see ANALYSIS.md).

The operator works on a private copy of the model at its parameters when built: in the model's own dtype the
parameters are shared (in-place updates show); computed in another dtype they are a converted snapshot.

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> op = ntk_operator(model, torch.randn(5, 3))
    >>> op.shape, op.matvec(torch.randn(5, 2)).shape          # ((N·k, N·k), (N, k))
    ((10, 10), torch.Size([5, 2]))
    >>> scipy.sparse.linalg.eigsh(op.as_linear_operator(), k=3)[0].shape   # top eigenvalues by Lanczos
    (3,)
"""

from __future__ import annotations

import contextlib
import glob
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import jvp, vjp

from ntk_service import vocabulary
from ntk_service.errors import (
    InvalidInput,
    MemoryEstimateExceeded,
    NonFiniteInput,
    OptionalDependencyMissing,
    ShapeMismatch,
    UnknownMode,
    UnsupportedModel,
    format_bytes,
)
from ntk_service.kernels.api import compute_ntk
from ntk_service.kernels.core import Call, on_model_device, run
from ntk_service.kernels.derived import map_of, outputs_of
from ntk_service.kernels.modes import DerivedMode, KernelMode, Outputs, contraction, parse_any_mode
from ntk_service.kernels.operators.base import JacobianOperator, Ranges, check_cotangent, check_ranges
from ntk_service.kernels.options import NtkOptions, Shorthands, resolve_options
from ntk_service.kernels.problem.batch import Batch, Inputs, batch_size, concat, take
from ntk_service.kernels.problem.embedding_padding import padding_as_constant
from ntk_service.kernels.problem.forward_mode import forward_mode
from ntk_service.kernels.problem.inputs import validate_inputs
from ntk_service.kernels.problem.math_attention import attention_scope
from ntk_service.kernels.problem.preparation import build_problem
from ntk_service.kernels.problem.private_module import check_model, private_copy
from ntk_service.kernels.problem.problem import NtkProblem
from ntk_service.kernels.spec import KernelSpec, SpecKeywords, refuse_fields, resolve_spec
from ntk_service.kernels.types import NamedTensors

__all__ = [
    "MAX_CHUNK_BYTES",
    "OPERATOR_MODES",
    "NtkOperator",
    "apply_in_mode",
    "as_operand",
    "gather_ranges",
    "gather_rows",
    "ntk_operator",
    "parse_operator_mode",
    "run_operator",
    "scipy_view",
]

OPERATOR_MODES = vocabulary.OPERATOR_MODES
"""The modes that are linear maps between the x2 side and the x1 side (the diagonals are not): the rows of
``vocabulary.MODES`` whose kernel is a matrix."""

MAX_CHUNK_BYTES = 256 * 2**20
"""The activations of one chunk of examples (what a VJP / JVP call holds beyond the parameter-space vectors) are
kept under this many bytes whatever the budget allows: the peak of a product is then O(P + chunk), flat in N,
instead of every example's activations at once. Chunks cost a fixed overhead per call (18 BLAS calls per chunk
for an MLP), so they are made as large as this bound allows: on the benchmark MLP (about 12,000 examples per
chunk) N = 10,000 runs as one chunk, and halving the chunk cost 1.15-1.4x per product on the contended 2-core
machine (benchmarks/bench_solvers.py --section chunk)."""

_OPERATION = "ntk_operator"


def parse_operator_mode(mode: KernelMode | DerivedMode | str, *, operation: str) -> KernelMode | DerivedMode:
    """``mode`` parsed, one of ``OPERATOR_MODES``.

    Raises:
        UnknownMode: a diagonal mode (not a linear map between the sides), or no mode at all.
    """
    kernel_mode = parse_any_mode(mode, operation=operation)
    if kernel_mode not in OPERATOR_MODES:
        valid = ", ".join(repr(m.value) for m in OPERATOR_MODES)
        raise UnknownMode(f"{operation}: mode {kernel_mode.value!r} is not a linear operator; expected one of {valid}")
    return kernel_mode


def as_operand(
    v: object, *, mode: KernelMode | DerivedMode, k: int, columns: int, dtype: torch.dtype, operation: str
) -> tuple[torch.Tensor, bool]:
    """The vector of a product, checked: (columns, k) for FULL (or flat (columns·k,)), (columns,) otherwise.

    Returns:
        (t, flat): t (columns, k) for FULL or (columns,), in ``dtype``; flat: v was the flat FULL form (the
        product is returned flat too).

    Raises:
        ShapeMismatch: another shape, or not a float tensor. NonFiniteInput: NaN or inf.
    """
    full = mode.spec.outputs is Outputs.ALL
    t = torch.as_tensor(v)
    flat = full and t.ndim == 1
    expected = (columns, outputs_of(mode, k)) if full else (columns,)
    if not t.is_floating_point() or (tuple(t.shape) != expected and not (flat and t.numel() == math.prod(expected))):
        flat_hint = f" or flat ({math.prod(expected)},)" if full else ""
        raise ShapeMismatch(
            f"{operation}: the vector has shape {tuple(t.shape)} and dtype {t.dtype}; expected a float "
            f"tensor of shape {expected}{flat_hint} for mode {mode.value}"
        )
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteInput(f"{operation}: the vector holds NaN or inf")
    return t.to(dtype).reshape(expected), flat


def apply_in_mode(
    product: Callable[[torch.Tensor], torch.Tensor],
    t: torch.Tensor,
    *,
    mode: KernelMode | DerivedMode,
    k: int,
    rows: int,
) -> torch.Tensor:
    """Θ t in ``mode`` from the FULL product J(rows) (J(cols)ᵀ c), ``product``: c (M, k) -> (N, k).

    t: (M, k) for FULL, (M,) for TRACE and PSEUDO (as ``as_operand`` returns it). Returns (N, k) or (N,).
    TRACE is Σ_a J_a(rows) J_a(cols)ᵀ t, one product per output (memory O(P); it has no single-pass form);
    a derived mode is its base mode of the product W J(rows) J(cols)ᵀ Wᵀ (``derived.OUTPUT_MAPS``): PSEUDO one
    product with t / √k on every output, summed and divided by √k.
    """
    if isinstance(mode, DerivedMode):
        output_map = map_of(mode)

        def mapped(c: torch.Tensor) -> torch.Tensor:  # (M, k') -> (N, k')
            return output_map.apply(product(output_map.adjoint(c, k)))

        return apply_in_mode(mapped, t, mode=contraction(mode), k=output_map.size(k), rows=rows)
    if mode.spec.outputs is Outputs.ALL:
        return product(t)
    out = torch.zeros(rows, dtype=t.dtype)
    for a in range(k):
        cot = torch.zeros(t.shape[0], k, dtype=t.dtype)
        cot[:, a] = t
        out += product(cot)[:, a]
    return out


def scipy_view(op: Any, *, operation: str) -> Any:
    """Deprecated (one release): every operator has ``as_linear_operator()`` from ``LinearOperator``.

    ``op`` (``matvec`` / ``rmatvec`` on torch tensors, ``shape``, a torch ``dtype``) as a
    ``scipy.sparse.linalg.LinearOperator`` on flat numpy vectors (float64 in; float64 or float32 out).

    Raises:
        OptionalDependencyMissing: SciPy is not installed (``pip install 'ntk-service[linalg]'``).
    """
    try:
        from scipy.sparse.linalg import LinearOperator
    except ImportError as exc:  # pragma: no cover - scipy is in the dev extra
        raise OptionalDependencyMissing(
            f"{operation}.as_linear_operator: needs SciPy; install it with pip install 'ntk-service[linalg]'"
        ) from exc

    def apply(x: np.ndarray, fn: Any) -> np.ndarray:
        flat = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64).reshape(-1))
        out: np.ndarray = fn(flat).double().numpy().reshape((-1, *x.shape[1:]))  # x is (n,) or (n, 1)
        return out

    return LinearOperator(
        shape=op.shape,
        dtype=np.float64 if op.dtype == torch.float64 else np.float32,
        matvec=lambda x: apply(x, op.matvec),
        rmatvec=lambda x: apply(x, op.rmatvec),
    )


class _Sides:
    """What both orientations of one operator share: the problem, the inputs, the chunk size, a lock, and what
    ``kernel_block`` hands the structured engine (the parameters' names and the output path as given)."""

    def __init__(
        self, problem: NtkProblem, x1: Batch, x2: Batch, chunk: int, estimate: int, output: str | None = None
    ) -> None:
        self.problem = problem
        self.x1, self.x2 = x1, x2
        self.chunk = chunk
        self.estimate = estimate
        self.output = output
        # functional_call swaps the private module's parameters during a call: one product at a time
        self.lock = threading.Lock()


class NtkOperator(JacobianOperator):
    """Θ(x1, x2) as a linear operator (see the module docstring); ``op @ v`` and ``op.T`` are the torch view,
    ``as_linear_operator()`` the SciPy view, ``jvp`` / ``vjp`` / ``kernel_block`` the Jacobian by halves
    (NOTE [jacobian operator] in ``base.py``).

    Attributes:
        mode: FULL, TRACE or PSEUDO.
        shape: (N·k, M·k) for FULL, (N, M) for TRACE and PSEUDO.
        k: outputs per example.
        num_params: P, the parameters the kernel differentiates.
        examples: (N, M).
        dtype: the compute dtype.
        examples_per_chunk: examples per VJP / JVP call, from the memory budget.
        estimate_bytes: the planned peak memory of one product.
        is_symmetric: x2 was omitted (x2 = x1): Θ is symmetric positive semi-definite, ``rmatvec`` = ``matvec``.
    """

    mode: KernelMode | DerivedMode  # never None: a kernel operator says its layout

    def __init__(self, sides: _Sides, mode: KernelMode | DerivedMode, *, transposed: bool, symmetric: bool) -> None:
        self._sides = sides
        self._transposed = transposed
        self.mode = mode
        self.is_symmetric = symmetric
        self.k = sides.problem.k
        self.num_params = sides.problem.num_params
        self.dtype = sides.problem.dtype
        self.examples_per_chunk = sides.chunk
        self.estimate_bytes = sides.estimate
        rows, cols = (sides.x2, sides.x1) if transposed else (sides.x1, sides.x2)
        self._rows, self._cols = rows, cols
        self.examples = (batch_size(rows), batch_size(cols))
        per = outputs_of(mode, self.k) if mode.spec.outputs is Outputs.ALL else 1
        self.shape = (self.examples[0] * per, self.examples[1] * per)

    # --- the torch view ---------------------------------------------------------------------------------------
    def matvec(self, v: Any) -> torch.Tensor:
        """Θ v. v: (M, k) for FULL (or flat (M·k,)), (M,) for TRACE and PSEUDO. Returns (N, k) (flat (N·k,) for
        a flat v) or (N,).

        Raises:
            ShapeMismatch: v has another shape.
            NonFiniteInput: v holds NaN or inf.
        """
        return self._apply(v, self._rows, self._cols, "matvec")

    def rmatvec(self, w: Any) -> torch.Tensor:
        """Θᵀ w = Θ(x2, x1) w. w: (N, k) for FULL (or flat (N·k,)), (N,) otherwise. Returns (M, k) or (M,)."""
        return self._apply(w, self._cols, self._rows, "rmatvec")

    def _matmat(self, v: torch.Tensor) -> torch.Tensor:
        """Θ V for V (M·k, r) (FULL) or (M, r): one product per column."""
        return torch.stack([self.matvec(v[:, j]) for j in range(v.shape[1])], dim=1)

    def _transpose(self) -> NtkOperator:
        """Θ(x2, x1): the transposed operator (the same object's data, no recomputation)."""
        return NtkOperator(self._sides, self.mode, transposed=not self._transposed, symmetric=self.is_symmetric)

    @property
    def T(self) -> NtkOperator:  # noqa: N802 (the matrix transpose, as torch and numpy spell it)
        """Θ(x2, x1): the transposed operator (the same object's data, no recomputation)."""
        return self._transpose()

    # --- the two halves of a FULL product (a sharded operator reduces the first over shards) ------------------
    def pullback(self, v: torch.Tensor) -> NamedTensors:
        """u = J(x2)ᵀ v, the parameter-space half of a FULL product (one VJP pass over the columns).

        Args:
            v: (M, k) float tensor (flat (M·k,) accepted), a cotangent on every column example's outputs.

        Returns:
            u: {name: tensor of that parameter's shape}, P floats in all, in the compute dtype.

        Raises:
            ShapeMismatch: v has another shape. NonFiniteInput: v holds NaN or inf.
        """
        t, _ = as_operand(
            v,
            mode=KernelMode.FULL,
            k=self.k,
            columns=batch_size(self._cols),
            dtype=self.dtype,
            operation=f"{_OPERATION}.pullback",
        )
        with self._sides.lock, self._scope():
            return self._vjp_sum(self._cols, t)

    def pushforward(self, u: NamedTensors) -> torch.Tensor:
        """J(x1) u, the output-space half of a FULL product (one JVP pass over the rows).

        Args:
            u: {name: tensor}, the parameters' names and shapes as ``pullback`` returns them.

        Returns:
            (N, k) tensor in the compute dtype.

        Raises:
            ShapeMismatch: u misses a parameter, has another, or a tensor of another shape.
        """
        params = self._sides.problem.params
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        given = {name: tuple(torch.as_tensor(g).shape) for name, g in u.items()}
        if given != shapes:
            wrong = sorted(set(shapes).symmetric_difference(given)) or sorted(
                name for name in shapes if shapes[name] != given[name]
            )
            raise ShapeMismatch(
                f"{_OPERATION}.pushforward: u must hold the selected parameters by name with their shapes "
                f"(as pullback returns them); {', '.join(wrong[:3])} differ"
            )
        tangent = {name: torch.as_tensor(g).to(self.dtype) for name, g in u.items()}
        with self._sides.lock, self._scope():
            return self._jvp(self._rows, tangent)

    # --- the Jacobian by halves on flat float64 vectors (NOTE [jacobian operator]) ------------------------------
    @property
    def parameter_names(self) -> list[str]:
        """The differentiated parameters in the order of a flat parameter vector."""
        return list(self._sides.problem.params)

    def jvp(self, u: np.ndarray, rows: Ranges | None = None) -> np.ndarray:
        """J(x1[rows]) u: u (P,) float64 -> (rows, k) float64 (computed in the compute dtype).

        Raises:
            ShapeMismatch: u is not (P,). InvalidInput: rows not sorted, disjoint ranges inside [0, N).
        """
        tangent = self._unflatten(u, "jvp")
        x = gather_ranges(self._rows, check_ranges(rows, self.examples[0], operation=f"{_OPERATION}.jvp"))
        with self._sides.lock, self._scope():
            return np.asarray(self._jvp(x, tangent).double().numpy())

    def vjp(self, c: np.ndarray, cols: Ranges | None = None) -> np.ndarray:
        """J(x2[cols])ᵀ c: c (cols, k) float64 -> (P,) float64 (the ranges read as one batch, one VJP pass).

        Raises:
            ShapeMismatch: c does not have one row per example of ``cols`` and k columns.
        """
        ranges = check_ranges(cols, self.examples[1], operation=f"{_OPERATION}.vjp")
        c = check_cotangent(c, ranges, self.k, operation=f"{_OPERATION}.vjp")
        x = gather_ranges(self._cols, ranges)
        with self._sides.lock, self._scope():
            return self._flatten(self._vjp_sum(x, torch.from_numpy(c).to(self.dtype)))

    def kernel_block(
        self, cols: Ranges, landmarks: np.ndarray | None, mode: KernelMode = KernelMode.FULL
    ) -> np.ndarray:
        """Θ(x2[cols], x2[landmarks]) by ``compute_ntk`` on this operator's model, parameters and output, float64:
        (b, s, k, k) FULL, (b, s) TRACE; landmarks None: Θ(x2[cols], x2[cols]), symmetric; EXAMPLE_DIAGONAL: the
        (b, k, k) blocks of x2[cols]."""
        other = None if landmarks is None or not mode.spec.pairs else self.select_columns(landmarks)
        return self.kernel_against(cols, other, mode)

    def select_columns(self, index: np.ndarray) -> Batch:
        """Examples ``index`` of x2, in that order (consecutive ones read as one slice of a row source)."""
        return gather_rows(self._cols, np.asarray(index, dtype=np.int64))

    def kernel_against(self, cols: Ranges, other: Batch | None, mode: KernelMode) -> np.ndarray:
        """Θ(x2[cols], other) of this operator's model, parameters and output by ``compute_ntk``, float64
        (``kernel_block`` with the other side's inputs already read; a shard's half of the Ray one)."""
        ranges = check_ranges(cols, self.examples[1], operation=f"{_OPERATION}.kernel_block")
        x = gather_ranges(self._cols, ranges)
        problem = self._sides.problem
        names = [glob.escape(name) for name in problem.params]
        with self._sides.lock:
            theta = compute_ntk(
                problem.module, x, other, mode=mode, params=names, output=self._sides.output, dtype=problem.dtype
            ).theta
        return np.asarray(theta.detach().cpu().double().numpy())

    def _unflatten(self, u: np.ndarray, name: str) -> NamedTensors:
        flat = torch.from_numpy(np.ascontiguousarray(u, dtype=np.float64)).reshape(-1)
        if flat.numel() != self.num_params:
            raise ShapeMismatch(f"{_OPERATION}.{name}: u has {flat.numel()} entries, expected P = {self.num_params}")
        out, offset = {}, 0
        for key, p in self._sides.problem.params.items():
            out[key] = flat[offset : offset + p.numel()].reshape(p.shape).to(self.dtype)
            offset += p.numel()
        return out

    def _flatten(self, u: NamedTensors) -> np.ndarray:
        return np.concatenate([u[key].detach().double().reshape(-1).numpy() for key in self._sides.problem.params])

    # --- the products -----------------------------------------------------------------------------------------
    def _apply(self, v: object, rows: Batch, cols: Batch, name: str) -> torch.Tensor:
        t, flat = as_operand(
            v, mode=self.mode, k=self.k, columns=batch_size(cols), dtype=self.dtype, operation=f"{_OPERATION}.{name}"
        )
        with self._sides.lock, self._scope():
            out = apply_in_mode(
                lambda c: self._jvp(rows, self._vjp_sum(cols, c)), t, mode=self.mode, k=self.k, rows=batch_size(rows)
            )
        return out.reshape(-1) if flat else out

    @contextlib.contextmanager
    def _scope(self) -> Iterator[None]:
        """Both passes of a product run in it. Attention takes its math path (``attention_scope``): its fused
        kernels have no forward-mode AD, and one path keeps both passes' f the same; an embedding's padding
        lookups are constants (``padding_as_constant``), as reverse mode has them."""
        problem = self._sides.problem
        with attention_scope(problem.module, problem.calls_attention), padding_as_constant():
            yield

    def _vjp_sum(self, cols: Batch, cotangent: torch.Tensor) -> NamedTensors:
        """J(cols)ᵀ cotangent: (M, k) -> P floats by name, summed over chunks of examples."""
        problem, chunk = self._sides.problem, self._sides.chunk
        u: NamedTensors | None = None
        for i in range(0, batch_size(cols), chunk):
            x = take(cols, i, i + chunk)
            pullback = vjp(lambda p, x=x: problem.f_batch(p, x), problem.params)[1]
            (part,) = pullback(cotangent[i : i + chunk])
            if u is None:
                u = part
            else:
                for name, g in part.items():
                    u[name] += g
        assert u is not None
        return {name: g.detach() for name, g in u.items()}

    def _jvp(self, rows: Batch, tangent: NamedTensors) -> torch.Tensor:
        """J(rows) tangent: P floats by name -> (N, k), in chunks of examples."""
        problem, chunk = self._sides.problem, self._sides.chunk
        out = []
        advice = "build the kernel with compute_ntk(implementation='jacobian_contraction') instead"
        with forward_mode(_OPERATION, advice):
            for i in range(0, batch_size(rows), chunk):
                x = take(rows, i, i + chunk)
                out.append(jvp(lambda p, x=x: problem.f_batch(p, x), (problem.params,), (tangent,))[1])
        return torch.cat(out).detach()


def gather_ranges(x: Batch, ranges: Ranges) -> Batch:
    """The examples of ``ranges`` of x (a batch or a row source) as one batch, in order."""
    parts = [take(x, start, stop) for start, stop in ranges]
    out = parts[0]
    for part in parts[1:]:
        out = concat(out, part)
    return out


def gather_rows(x: Batch, index: np.ndarray) -> Batch:
    """Examples ``index`` of x, in that order, read as runs of consecutive rows (a row source reads slices)."""
    if index.size == 0:
        raise InvalidInput(f"{_OPERATION}.kernel_block: needs at least one landmark example")
    starts = np.flatnonzero(np.diff(index, prepend=index[0] - 2) != 1)
    bounds = [(int(index[s]), int(index[e - 1]) + 1) for s, e in zip(starts, [*starts[1:], index.size], strict=True)]
    return gather_ranges(x, bounds)


def ntk_operator(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None = None,
    *,
    spec: KernelSpec | None = None,
    options: NtkOptions | None = None,
    examples_per_chunk: int | None = None,
    mode: KernelMode | DerivedMode | str | None = None,
    params: Sequence[str] | None = None,
    output: str | None = None,
    dtype: torch.dtype | str | None = None,
    memory_budget_bytes: int | None = None,
) -> NtkOperator:
    """Θ(x1, x2) as a matrix-free operator: products with one VJP and one JVP pass over the data.

    Args:
        model (nn.Module): maps a batch (N, *input) to (N, *out); run in eval semantics on a private copy.
        x1 (Tensor, tuple or mapping): (N, *input): the rows (the output side of ``matvec``); or forward's
            positional / keyword inputs, as ``compute_ntk``.
        x2 (same kind as x1, optional): (M, *input): the columns. Default: None, meaning x2 = x1 (a symmetric
            operator).
        spec (KernelSpec, optional): what: ``mode``, ``params`` and ``output``. Default: None, the one the
            shorthands below give.
        options (NtkOptions, optional): how: the dtype and the memory budget of one product; the operator runs
            where the model is. Default: None, the one the shorthands below give.
        examples_per_chunk (int, optional): examples per VJP / JVP call at most (the budget may allow fewer).
            Default: None, meaning as many as ``MAX_CHUNK_BYTES`` of activations hold: the peak is O(P + chunk)
            whatever N is.
        mode (str): shorthand for ``spec.mode``: "full" (N·k, M·k), "trace" (N, M) or "pseudo" (N, M). Default:
            "full".
        params (list of str, optional): shorthand for ``spec.params``: the kernel of a parameter subset (globs).
            Default: None (all).
        output (str, optional): shorthand for ``spec.output``: which tensor of forward's return value is f, as
            ``compute_ntk``. Default: None.
        dtype (torch.dtype or str, optional): shorthand for ``options.dtype``: float32 or float64. Default: the
            model's dtype.
        memory_budget_bytes (int, optional): shorthand for ``options.memory_budget_bytes``: peak memory of one
            product. Default: ``default_memory_budget()``.

    Returns:
        NtkOperator: ``matvec`` (M, k) -> (N, k) (FULL) or (M,) -> (N,); ``rmatvec``; ``op @ v``; ``op.T``;
        ``as_linear_operator()`` for SciPy.

    Raises:
        InvalidInput: examples_per_chunk < 1 or not an integer; shorthands given with their value; a spec with
            groups or a layer; ``options.device`` other than the model's.
        UnknownMode: a mode that is not a linear operator (the diagonals) or no mode at all.
        ShapeMismatch, EmptyBatch, NonFiniteInput, NoMatchingParameters, UnsupportedModel: as ``compute_ntk``;
            UnsupportedModel also for a model that cannot be copied.
        MemoryEstimateExceeded: the parameter-space vectors and one example's activations exceed the budget.
    """
    what = resolve_spec(spec, SpecKeywords(mode=mode, params=params, output=output), operation=_OPERATION)
    how = resolve_options(options, Shorthands(None, dtype, memory_budget_bytes, None, None, None), operation=_OPERATION)
    parse_operator_mode(what.mode, operation=_OPERATION)
    refuse_fields(what, ("groups", "rest", "layer"), operation=_OPERATION)
    if examples_per_chunk is not None and (
        isinstance(examples_per_chunk, bool) or not isinstance(examples_per_chunk, int) or examples_per_chunk < 1
    ):
        raise InvalidInput(f"{_OPERATION}: examples_per_chunk must be an integer ≥ 1, got {examples_per_chunk!r}")
    on_model_device(how, model, operation=_OPERATION)
    return run(lambda call: run_operator(model, x1, x2, call, examples_per_chunk), what, how, device_of=model)


def run_operator(
    model: nn.Module, x1: Inputs, x2: Inputs | None, call: Call, examples_per_chunk: int | None
) -> NtkOperator:
    """``ntk_operator`` of a checked call (``kernels/core.py``): the implementation, never re-checking it."""
    budget = call.budget
    check_model(model)
    compute_dtype, x1t, x2t = validate_inputs(model, x1, x2, call.options.dtype)
    private = private_copy(model)
    if private is None:
        raise UnsupportedModel(
            f"{_OPERATION}: the model cannot be copied (copy.deepcopy failed), and an operator keeps its own copy; "
            "use compute_ntk instead"
        )
    problem = build_problem(
        private, x1t, x2t, params=call.spec.params, dtype=compute_dtype, output=call.spec.output_path
    )
    cols = x1t if x2t is None else x2t
    item = problem.itemsize
    # u, one chunk's gradients, the JVP's tangent (P each); v and the output; per example: the forward's saved
    # activations for the VJP, primal and tangent activations for the JVP, and its k outputs
    fixed = 3 * problem.num_params * item + (batch_size(x1t) + batch_size(cols)) * problem.k * item * 3
    per_example = 2 * problem.saved_bytes + 4 * problem.k * item
    chunk = int((budget - fixed) // per_example) if budget > fixed else 0
    if chunk < 1:
        needed = fixed + per_example
        raise MemoryEstimateExceeded(
            f"{_OPERATION}: one product needs at least {format_bytes(needed)} (P={problem.num_params} parameters, "
            f"k={problem.k}), over the memory budget of {format_bytes(budget)}; use a parameter subset or a larger "
            "budget",
            estimate_bytes=int(needed),
            budget_bytes=budget,
        )
    cap = max(1, int(MAX_CHUNK_BYTES // per_example)) if examples_per_chunk is None else examples_per_chunk
    chunk = min(chunk, cap, max(batch_size(x1t), batch_size(cols)))
    sides = _Sides(problem, x1t, cols, chunk, int(fixed + chunk * per_example), output=call.spec.output)
    return NtkOperator(sides, call.spec.mode, transposed=False, symmetric=x2t is None)
