"""``ray_ntk_operator``: Θ(x1, x2) as a matrix-free operator whose products run on Ray actors, one data shard each.

The examples are split into S contiguous shards, x1 = [x1_1; …; x1_S] and x2 = [x2_1; …; x2_S]; actor s holds the
model and shard s of each side. A FULL product is two rounds::

    u   = Σ_s J(x2_s)ᵀ v_s          each actor's VJP pass over its x2 rows (P floats, as named tensors); the driver
                                    sums the S parts in float64
    Θ v = [J(x1_1) u; …; J(x1_S) u] u goes to the object store once; each actor's JVP pass over its x1 rows

so it equals ``ntk_operator``'s product (the same two passes, split over shards). TRACE is k such products, one per
output, and PSEUDO one with v on every output (``apply_in_mode``, as ``NtkOperator``). Cost per FULL product: the
same VJP and JVP work as ``ntk_operator``, spread over S actors, plus 2·S·P floats through the object store and two
round trips; memory per actor O(P + its shard's chunk), on the driver O(S·P) for the parts.

The model goes to the object store once, as a data-free module tree and its weights as numpy (``weights.py``: one
copy per node, which its actors map zero-copy); each shard once, to its actor. The operator is a
``JacobianOperator`` (NOTE [one operator base] in ``kernels/operators/base.py``), so ``gp_inference``,
``solve_kernel``, ``linearized_predictions``, ``max_learning_rate`` and ``spectrum`` take it as they take an
``NtkOperator``. Its Jacobian halves run where the rows are: ``jvp(w, rows)`` ships w (P floats) through the object
store once and each actor pushes it forward over its part of the rows; ``vjp(c, rows)`` has each actor pull its part
back and the driver sums the parts in float64; ``kernel_block`` reads the few landmark examples from their actors
and each actor computes its rows' block with the structured engine. So the parameter-space block method runs with w
replicated by the object store and every block's work on the shard actors (a block takes a share of every shard:
``partitions``). ``view`` gives the other kernels of the same actors
(train-train from a test-train build, another mode) without shipping anything again.

NOTE [ray operator faults]: no fault tolerance. A lost actor (its process killed, its node gone) fails the
product, and every later one, with a JobFailed saying so; it never hangs and never returns a sum without its
shard, since a product gathers every shard's part or raises. The actors are not restarted (Ray's default
``max_restarts=0``): a restarted actor would come back without its shard's operator, and rebuilding it would
need the driver to keep every shard and the model to ship again; build the operator again instead. Reduction is on the
driver (S·P floats arrive there); a tree or an allreduce among the actors would pay only for S in the tens.

NOTE [ray operator placement]: this module lives in ``jobs/executors`` because it needs ``import_ray`` and the
weight shipping of ``weights.py``, and ``kernels/`` may not import ``jobs/`` (DESIGN §2); it imports the engine
(``ntk_operator`` per shard) downwards. ``analysis/`` reaches it through its base class (``JacobianOperator``),
never by import.

Example::

    >>> cross = ray_ntk_operator(model, x_test, x_train, shards=2)      # Θ(x_test, x_train)    # doctest: +SKIP
    >>> train = cross.view(rows="x2")                                    # Θ(x_train, x_train)   # doctest: +SKIP
    >>> train.shape, train.matvec(torch.randn(N, k)).shape               # ((N·k, N·k), (N, k))  # doctest: +SKIP
    >>> gp_inference(train, y, cross, ridge=1e-3).mean.shape             # (M, k)                # doctest: +SKIP
    >>> cross.close()                                                    # the actors go         # doctest: +SKIP
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn

from ntk_service.errors import InvalidInput, JobFailed, NtkServiceError, OptionalDependencyMissing
from ntk_service.jobs.executors.ray import batch_as_numpy, import_ray, ray_init_address
from ntk_service.jobs.executors.weights import pack_module, unpack_module
from ntk_service.kernels import model_device, place_module
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.operators.base import JacobianOperator, Ranges, check_cotangent, check_ranges, ranges_size
from ntk_service.kernels.operators.linear_operator import (
    NtkOperator,
    apply_in_mode,
    as_operand,
    ntk_operator,
    parse_operator_mode,
)
from ntk_service.kernels.problem.batch import Inputs, batch_size, take
from ntk_service.kernels.problem.inputs import validate_inputs
from ntk_service.kernels.problem.outputs import parse_output
from ntk_service.kernels.problem.private_module import check_model

__all__ = ["DEFAULT_SHARDS", "RayNtkOperator", "ShardWorker", "ray_ntk_operator"]

logger = logging.getLogger(__name__)

DEFAULT_SHARDS = 2
"""Shards (and actors) when none are asked for: one per core of this 2-core machine; on a cluster pass its CPUs
divided by ``num_cpus``."""

_OPERATION = "ray_ntk_operator"


_SIDES = {"x1": 0, "x2": 1}
"""The data sets an operator's rows and columns may be (``RayNtkOperator.view``), as indices of a shard's sizes."""


class ShardWorker:
    """One Ray actor of a ``RayNtkOperator``: the model and one shard of x1 and x2, as an ``ntk_operator`` (FULL).

    Its two calls are stateless halves of a product (``pullback``, ``pushforward``) on either side (0: x1, 1: x2),
    so products may overlap and several views share the actor.

    Args:
        threads: torch threads (the CPUs the actor reserves).
    """

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self._op: NtkOperator | None = None

    def load(self, packed: Any, x1: Any, x2: Any, options: dict[str, Any]) -> tuple[int, int, int, int]:
        """Build this shard's operator from the shipped model and its rows.

        Args:
            packed: ``pack_module``'s (skeleton, arrays). x1: (N_s, *input) as numpy (a tuple / dict of them for
            several inputs). x2: (M_s, *input), or None for x2 = x1. options: ``ntk_operator``'s keywords.

        Returns:
            (N_s, M_s, k, P) of this shard.
        """
        model = unpack_module(*packed)  # weights viewing the object store (NOTE [read-only weights])
        x2_t = None if x2 is None else _to_torch(x2)
        op = ntk_operator(model, _to_torch(x1), x2_t, mode=KernelMode.FULL, **options)
        self._op = op
        return op.shape[0] // op.k, op.shape[1] // op.k, op.k, op.num_params

    def pullback(self, cotangent: np.ndarray, side: int) -> dict[str, np.ndarray]:
        """J(x_s)ᵀ c for c (rows of this shard's side, k): P floats by name."""
        op = self._shard().T if side == 0 else self._shard()  # the shard operator's columns are its x2 rows
        return {name: g.numpy() for name, g in op.pullback(_copy(cotangent)).items()}

    def pushforward(self, u: dict[str, np.ndarray], side: int) -> np.ndarray:
        """J(x_s) u: (rows of this shard's side, k)."""
        op = self._shard().T if side == 1 else self._shard()  # the shard operator's rows are its x1 rows
        out: np.ndarray = op.pushforward({name: _copy(g) for name, g in u.items()}).numpy()
        return out

    def jvp(self, u: np.ndarray, side: int, ranges: list[tuple[int, int]]) -> np.ndarray:
        """J(x_s[ranges]) u for u (P,) float64 and ranges local to this shard's side: (rows, k) float64."""
        op = self._shard().T if side == 1 else self._shard()
        return op.jvp(u, ranges)

    def vjp(self, c: np.ndarray, side: int, ranges: list[tuple[int, int]]) -> np.ndarray:
        """J(x_s[ranges])ᵀ c: (P,) float64, for c (rows of the ranges, k) and ranges local to this shard."""
        op = self._shard().T if side == 0 else self._shard()
        return op.vjp(c, ranges)

    def rows(self, side: int, index: np.ndarray) -> Any:
        """This shard's examples ``index`` (local) of one side, as numpy (``batch_as_numpy``)."""
        op = self._shard().T if side == 0 else self._shard()
        return batch_as_numpy(op.select_columns(index))

    def kernel(self, side: int, ranges: list[tuple[int, int]], other: Any, mode: KernelMode) -> np.ndarray:
        """Θ(x_s[ranges], other) by the structured engine (``NtkOperator.kernel_against``), float64; ``other``
        numpy inputs (None for the example diagonal)."""
        op = self._shard().T if side == 0 else self._shard()
        return op.kernel_against(ranges, None if other is None else _to_torch(other), mode)

    def _shard(self) -> NtkOperator:
        assert self._op is not None, "ShardWorker.load runs first"
        return self._op


class _Shards:
    """What the views of one ``ray_ntk_operator`` share: Ray, the actors, and each shard's (N_s, M_s)."""

    def __init__(self, ray: Any, actors: list[Any], sizes: list[tuple[int, int]], symmetric: bool) -> None:
        self.ray, self.actors, self.sizes, self.symmetric = ray, actors, sizes, symmetric

    def examples(self, side: int) -> int:
        return sum(size[side] for size in self.sizes)

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - an actor already gone needs no kill
                logger.debug("%s: an actor was already gone at close", _OPERATION)
        self.actors = []


class RayNtkOperator(JacobianOperator):
    """Θ(x_rows, x_cols) on Ray actors (see the module docstring); build it with ``ray_ntk_operator``, and more
    kernels of the same shipped model and data with ``view``.

    Attributes:
        mode: FULL, TRACE or PSEUDO.
        shape: (N·k, M·k) for FULL, (N, M) for TRACE and PSEUDO (the layout of ``NtkOperator``).
        k: outputs per example. num_params: P. dtype: the compute dtype.
        shards: S, the actors (clamped to the examples of the smaller side).
        rows, cols: which data set the rows and the columns are ("x1" or "x2"; "x1" both when x2 was omitted).
        is_symmetric: rows and columns are one data set: Θ is symmetric positive semi-definite.
    """

    mode: KernelMode | DerivedMode  # never None: a kernel operator says its layout

    def __init__(
        self,
        shards: _Shards,
        *,
        rows: int,
        cols: int,
        mode: KernelMode | DerivedMode,
        k: int,
        num_params: int,
        dtype: torch.dtype,
    ) -> None:
        self._shards, self._rows, self._cols = shards, rows, cols
        self.mode, self.k, self.num_params, self.dtype = mode, k, num_params, dtype
        self.rows, self.cols = ("x1", "x2")[rows], ("x1", "x2")[cols]
        self.is_symmetric = rows == cols
        self.shards = len(shards.actors)
        per = k if mode is KernelMode.FULL else 1
        self.examples = (shards.examples(rows), shards.examples(cols))
        self.shape = (self.examples[0] * per, self.examples[1] * per)

    def matvec(self, v: Any) -> torch.Tensor:
        """Θ v. v: (M, k) for FULL (or flat (M·k,)), (M,) for TRACE and PSEUDO. Returns (N, k) (flat (N·k,) for a
        flat v) or (N,), in the compute dtype.

        Raises:
            ShapeMismatch: v has another shape. NonFiniteInput: v holds NaN or inf.
            InvalidInput: the operator was closed. JobFailed: an actor was lost (build the operator again).
        """
        return self._apply(v, self._rows, self._cols, "matvec")

    def rmatvec(self, w: Any) -> torch.Tensor:
        """Θᵀ w = Θ(x_cols, x_rows) w. w: (N, k) for FULL (or flat (N·k,)), (N,) otherwise. Returns (M, k) or
        (M,)."""
        return self._apply(w, self._cols, self._rows, "rmatvec")

    def _matmat(self, v: torch.Tensor) -> torch.Tensor:
        """Θ V for V (M·k, r) (FULL) or (M, r): one product per column. Returns (N·k, r) or (N, r)."""
        return torch.stack([self.matvec(v[:, j]) for j in range(v.shape[1])], dim=1)

    # --- the Jacobian by halves, each range on the actor of its shard (NOTE [jacobian operator]) ----------------
    def partitions(self) -> list[tuple[int, int]]:
        """The shards' example ranges of the column side: a block with one range in each keeps every actor busy."""
        bounds = np.cumsum([0] + [size[self._cols] for size in self._shards.sizes])
        return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]

    def jvp(self, u: np.ndarray, rows: Ranges | None = None) -> np.ndarray:
        """J(x_rows[rows]) u: u (P,) float64 -> (rows, k) float64; each shard's ranges on its actor, u shipped
        once through the object store."""
        ray = self._ready("jvp")
        ranges = check_ranges(rows, self.examples[0], operation=f"{_OPERATION}.jvp")
        plan = self._split(ranges, self._rows)
        shared = ray.put(np.asarray(u, dtype=np.float64))
        refs = [self._shards.actors[s].jvp.remote(shared, self._rows, local) for s, local in plan]
        return np.concatenate(_get(ray, refs)) if refs else np.zeros((0, self.k))

    def vjp(self, c: np.ndarray, cols: Ranges | None = None) -> np.ndarray:
        """J(x_cols[cols])ᵀ c: (P,) float64, each shard's part on its actor, summed in float64 on the driver."""
        ray = self._ready("vjp")
        ranges = check_ranges(cols, self.examples[1], operation=f"{_OPERATION}.vjp")
        c = check_cotangent(c, ranges, self.k, operation=f"{_OPERATION}.vjp")
        refs, offset = [], 0
        for s, local in self._split(ranges, self._cols):
            size = ranges_size(local)
            refs.append(self._shards.actors[s].vjp.remote(c[offset : offset + size], self._cols, local))
            offset += size
        return np.sum(_get(ray, refs), axis=0) if refs else np.zeros(self.num_params)

    def kernel_block(
        self, cols: Ranges, landmarks: np.ndarray | None, mode: KernelMode = KernelMode.FULL
    ) -> np.ndarray:
        """Θ(x_cols[cols], x_cols[landmarks]): the landmark examples are read from their actors once, then each
        shard computes its rows' block in parallel (float64, as ``NtkOperator.kernel_block``; landmarks None:
        the examples of ``cols`` themselves)."""
        ray = self._ready("kernel_block")
        ranges = check_ranges(cols, self.examples[1], operation=f"{_OPERATION}.kernel_block")
        other = None
        if mode.spec.pairs:  # a per-example mode has no column side
            if landmarks is None:
                landmarks = np.concatenate([np.arange(a, b) for a, b in ranges])
            index = np.asarray(landmarks, dtype=np.int64)
            bounds = np.cumsum([0] + [size[self._cols] for size in self._shards.sizes])
            owner = np.searchsorted(bounds, index, side="right") - 1
            parts = [
                self._shards.actors[s].rows.remote(self._cols, index[owner == s] - bounds[s])
                for s in range(len(self._shards.actors))
                if np.any(owner == s)
            ]
            other = ray.put(_concat_numpy(_get(ray, parts), np.argsort(np.argsort(owner, kind="stable"))))
        refs = [
            self._shards.actors[s].kernel.remote(self._cols, local, other, mode)
            for s, local in self._split(ranges, self._cols)
        ]
        return np.concatenate(_get(ray, refs))

    def _ready(self, name: str) -> Any:
        if not self._shards.actors:
            raise InvalidInput(f"{_OPERATION}.{name}: the operator was closed; build it again")
        return self._shards.ray

    def _split(self, ranges: list[tuple[int, int]], side: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """``ranges`` cut at the shard boundaries of ``side``: (shard, its local ranges), shards in order."""
        bounds = np.cumsum([0] + [size[side] for size in self._shards.sizes])
        plan = []
        for s in range(len(self._shards.actors)):
            lo, hi = int(bounds[s]), int(bounds[s + 1])
            local = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if min(b, hi) > max(a, lo)]
            if local:
                plan.append((s, local))
        return plan

    def view(
        self, *, rows: str | None = None, cols: str | None = None, mode: KernelMode | DerivedMode | str | None = None
    ) -> RayNtkOperator:
        """Another kernel of the same actors, shipped model and data: Θ(x_rows, x_cols) in ``mode``.

        ``op = ray_ntk_operator(model, x_test, x_train)`` is the test-train kernel; ``op.view(rows="x2")`` the
        train-train one, ``op.view(mode="trace")`` its TRACE kernel, ``op.T`` the train-test one. Views share the
        actors: ``close`` on any closes them all.

        Args:
            rows, cols (str, optional): "x1" or "x2". Default: this operator's. mode: as ``ray_ntk_operator``.
                Default: this operator's.

        Raises:
            InvalidInput: a side that is neither "x1" nor "x2". UnknownMode: a diagonal mode.
        """
        kernel_mode = self.mode if mode is None else parse_operator_mode(mode, operation=f"{_OPERATION}.view")
        sides = []
        for name, side, own in (("rows", rows, self._rows), ("cols", cols, self._cols)):
            if side is not None and side not in _SIDES:
                raise InvalidInput(f"{_OPERATION}.view: {name} must be 'x1' or 'x2', got {side!r}")
            index = own if side is None else _SIDES[side]
            sides.append(0 if self._shards.symmetric else index)  # x2 = x1: one data set
        return RayNtkOperator(
            self._shards,
            rows=sides[0],
            cols=sides[1],
            mode=kernel_mode,
            k=self.k,
            num_params=self.num_params,
            dtype=self.dtype,
        )

    def _transpose(self) -> RayNtkOperator:
        return self.view(rows=self.cols, cols=self.rows)

    @property
    def T(self) -> RayNtkOperator:  # noqa: N802 (the matrix transpose, as torch and numpy spell it)
        """Θ(x_cols, x_rows), over the same actors."""
        return self._transpose()

    def close(self) -> None:
        """Stop the actors (their CPUs go back to Ray); no view of them can multiply afterwards."""
        self._shards.close()

    def __enter__(self) -> RayNtkOperator:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _apply(self, v: Any, rows: int, cols: int, name: str) -> torch.Tensor:
        if not self._shards.actors:
            raise InvalidInput(f"{_OPERATION}.{name}: the operator was closed; build it again")
        t, flat = as_operand(
            v,
            mode=self.mode,
            k=self.k,
            columns=self._shards.examples(cols),
            dtype=self.dtype,
            operation=f"{_OPERATION}.{name}",
        )
        out = apply_in_mode(
            lambda c: self._product(c, rows, cols), t, mode=self.mode, k=self.k, rows=self._shards.examples(rows)
        )
        return out.reshape(-1) if flat else out

    def _product(self, cotangent: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """J(x_rows) Σ_s J(x_cols,s)ᵀ c_s: c (M, k) -> (N, k), the FULL product over the shards."""
        ray, actors = self._shards.ray, self._shards.actors
        bounds = np.cumsum([0] + [size[cols] for size in self._shards.sizes])
        array = cotangent.numpy()
        parts = _get(
            ray, [actor.pullback.remote(array[bounds[s] : bounds[s + 1]], cols) for s, actor in enumerate(actors)]
        )
        u = {
            # NOTE [float64 reduction]: the S partial sums are added in float64 whatever the compute dtype, so the
            # order of the shards costs no precision (each is already a sum over its examples in the compute dtype)
            name: np.sum([part[name] for part in parts], axis=0, dtype=np.float64).astype(parts[0][name].dtype)
            for name in parts[0]
        }
        tangent = ray.put(u)  # once in the object store, for every actor
        out = _get(ray, [actor.pushforward.remote(tangent, rows) for actor in actors])
        return torch.from_numpy(np.concatenate(out))


def _get(ray: Any, refs: list[Any]) -> list[Any]:
    """The actors' results, with an actor's domain error re-raised as itself (Ray wraps it).

    Raises:
        JobFailed: an actor died (NOTE [ray operator faults]), or a call failed otherwise.
    """
    try:
        return list(ray.get(refs))
    except ray.exceptions.RayActorError as exc:
        raise JobFailed(
            f"{_OPERATION}: the actor of a shard died during a product (its process was killed, e.g. out of "
            "memory, or its node was lost); its shard exists nowhere else, so no product of this operator can be "
            "completed: close it and build it again with ray_ntk_operator"
        ) from exc
    except Exception as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, NtkServiceError):
            raise cause from exc
        raise JobFailed(f"{_OPERATION}: a shard's product failed on Ray: {exc}") from exc


def ray_ntk_operator(
    model: nn.Module,
    x1: Inputs,
    x2: Inputs | None = None,
    *,
    shards: int = DEFAULT_SHARDS,
    mode: KernelMode | DerivedMode | str = KernelMode.FULL,
    params: Sequence[str] | None = None,
    output: str | None = None,
    dtype: torch.dtype | str | None = None,
    num_cpus: float = 1,
    memory_budget_bytes: int | None = None,
    examples_per_chunk: int | None = None,
    address: str | None = None,
) -> RayNtkOperator:
    """Θ(x1, x2) as a matrix-free operator over ``shards`` Ray actors (module docstring): the same products as
    ``ntk_operator``, the data sharded.

    Args:
        model (nn.Module): maps a batch (N, *input) to (N, *out); its CPU weights are shipped once.
        x1 (Tensor, tuple or mapping): (N, *input), the rows (the output side of ``matvec``).
        x2 (same kind as x1, optional): (M, *input), the columns. Default: None, meaning x2 = x1 (symmetric).
        shards (int): S, the actors, each holding N/S rows of x1 and M/S of x2; more than the smaller side has
            examples are clamped to it (an actor with no rows would only hold a model). Default: ``DEFAULT_SHARDS``.
        mode (str): "full" (N·k, M·k), "trace" (N, M) or "pseudo" (N, M). Default: "full".
        params, output, dtype, examples_per_chunk: as ``ntk_operator``, per shard.
        num_cpus (float): CPUs each actor reserves (its torch threads: at least 1). Default: 1.
        memory_budget_bytes (int, optional): each actor's peak per product. Default: the actor's
            ``default_memory_budget()`` (the actors of one node each read it, but the chunk is capped by
            ``MAX_CHUNK_BYTES`` of activations whatever the budget, so an actor's peak stays O(P + that cap)).
        address (str, optional): for ``ray.init`` when Ray is not initialised in this process (a cluster, or None
            to start a local Ray, which stays up until ``ray.shutdown()``). Default: None.

    Returns:
        RayNtkOperator: ``matvec`` (M, k) -> (N, k) (FULL) or (M,) -> (N,); ``rmatvec``; ``op @ v``; ``close()``
        (also a context manager) stops the actors.

    Raises:
        OptionalDependencyMissing: Ray is not installed (``pip install 'ntk-service[ray]'``).
        InvalidInput: shards or num_cpus not a positive number. UnknownMode: a diagonal mode.
        ShapeMismatch, EmptyBatch, NonFiniteInput, NoMatchingParameters, UnsupportedModel, MemoryEstimateExceeded:
            as ``ntk_operator`` (raised by the actors for their shard, re-raised here).
    """
    kernel_mode = parse_operator_mode(mode, operation=_OPERATION)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InvalidInput(f"{_OPERATION}: shards must be an integer ≥ 1, got {shards!r}")
    if isinstance(num_cpus, bool) or not isinstance(num_cpus, int | float) or not num_cpus > 0:
        raise InvalidInput(f"{_OPERATION}: num_cpus must be a number > 0, got {num_cpus!r}")
    parse_output(output, operation=_OPERATION)
    check_model(model)
    compute_dtype, x1_t, x2_t = validate_inputs(model, x1, x2, dtype)
    n = batch_size(x1_t)
    m = n if x2_t is None else batch_size(x2_t)
    count = min(shards, n, m)
    if count < shards:
        logger.info("%s: %d shards for %d x %d examples; using %d", _OPERATION, shards, n, m, count)
    try:
        ray = import_ray()
    except OptionalDependencyMissing as exc:
        raise OptionalDependencyMissing(
            f"{_OPERATION}: needs Ray, which is not installed; install it with pip install 'ntk-service[ray]', "
            "or use ntk_operator (one process)"
        ) from exc
    if not ray.is_initialized():
        ray.init(address=ray_init_address(address), include_dashboard=False, logging_level=logging.WARNING)
    # the weights of a CPU copy: the actors compute on their CPUs (a model on an accelerator is copied once)
    shipped = model if model_device(model).type == "cpu" else place_module(model, torch.device("cpu"))
    packed = ray.put(pack_module(shipped))
    options = {
        "params": params,
        "output": output,
        "dtype": compute_dtype,
        "memory_budget_bytes": memory_budget_bytes,
        "examples_per_chunk": examples_per_chunk,
    }
    remote = ray.remote(ShardWorker).options(num_cpus=num_cpus)
    actors = [remote.remote(max(1, int(num_cpus))) for _ in range(count)]
    rows, cols = _bounds(n, count), _bounds(m, count)
    loads = []
    for s, actor in enumerate(actors):
        shard_x1 = batch_as_numpy(take(x1_t, *rows[s]))
        shard_x2 = None if x2_t is None else batch_as_numpy(take(x2_t, *cols[s]))
        loads.append(actor.load.remote(packed, shard_x1, shard_x2, options))
    try:
        shapes = _get(ray, loads)
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    k, num_params = shapes[0][2], shapes[0][3]
    shared = _Shards(ray, actors, [(shape[0], shape[1]) for shape in shapes], symmetric=x2_t is None)
    return RayNtkOperator(
        shared, rows=0, cols=0 if x2_t is None else 1, mode=kernel_mode, k=k, num_params=num_params, dtype=compute_dtype
    )


def _bounds(size: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous [start, stop) ranges covering ``size`` rows, their sizes differing by at most one."""
    edges = [size * s // count for s in range(count + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _to_torch(x: Any) -> Any:
    """The inverse of ``batch_as_numpy`` (leaves copied out of the object store's read-only buffers)."""
    if isinstance(x, tuple):
        return tuple(_to_torch(leaf) for leaf in x)
    if isinstance(x, dict):
        return {name: _to_torch(leaf) for name, leaf in x.items()}
    return _copy(x)


def _concat_numpy(parts: list[Any], order: np.ndarray) -> Any:
    """Rows gathered shard by shard (``batch_as_numpy`` form), joined and put back in the order asked for:
    ``order[i]`` is where the i-th requested example sits in the shard-ordered concatenation."""
    if isinstance(parts[0], tuple):
        return tuple(_concat_numpy([p[i] for p in parts], order) for i in range(len(parts[0])))
    if isinstance(parts[0], dict):
        return {name: _concat_numpy([p[name] for p in parts], order) for name in parts[0]}
    return np.concatenate(parts)[order]


def _copy(array: np.ndarray) -> torch.Tensor:
    """A tensor of its own memory from a (possibly read-only) numpy array of the object store."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array).clone()
