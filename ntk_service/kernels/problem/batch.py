"""Model inputs as a batch of leaves: a Tensor, a tuple of tensors (forward's positional arguments) or a mapping
of name -> tensor (forward's keyword arguments).

Every leaf is batched on dim 0 with one N. Floating leaves are cast to the compute dtype; integer leaves (token
ids, attention masks, positions) are data: they are kept as int64 and never differentiated. The engine holds a
batch as ``Batch`` (a Tensor, a tuple or a dict), all three native ``torch.func`` pytrees, so ``vmap`` maps over
every leaf at once; the functions here are the few operations the engine applies to a batch (its size, a slice,
two batches joined, a move, one example's batch of one, the model call).

Example::

    >>> ids, mask = torch.randint(0, 10, (4, 6)), torch.ones(4, 6, dtype=torch.int64)
    >>> batch = as_batch({"input_ids": ids, "attention_mask": mask}, "x1", torch.float32)
    >>> batch_size(batch), tuple(take(batch, 1, 3)["input_ids"].shape)
    (4, (2, 6))
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable, Iterator, Mapping
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.func import functional_call

from ntk_service.errors import EmptyBatch, InvalidInput, NonFiniteInput, ShapeMismatch, operation_name

__all__ = [
    "Batch",
    "EmbeddingFeeds",
    "IdTables",
    "Inputs",
    "as_batch",
    "batch_size",
    "call_module",
    "check_ids",
    "check_sides",
    "concat",
    "embedding_feeds",
    "is_batch",
    "is_data_dependent",
    "leaves",
    "one_example",
    "signature",
    "take",
    "template",
    "to_device",
    "unsqueeze",
]

Inputs: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
"""What a caller passes as x1 / x2: one tensor, forward's positional arguments, or its keyword arguments."""

Batch: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
"""Inputs of n examples: one tensor (n, *input), positional tensors (n, *input_i), or named tensors."""


def is_batch(x: object) -> bool:
    """Whether ``x`` is a tuple or mapping of inputs (not a plain tensor): the pytree path."""
    return isinstance(x, tuple | Mapping)


def leaves(x: Batch) -> list[tuple[str, torch.Tensor]]:
    """The leaves with the names messages use: "" for a tensor, "[i]" for a tuple, "['name']" for a mapping."""
    if isinstance(x, torch.Tensor):
        return [("", x)]
    if isinstance(x, tuple):
        return [(f"[{i}]", t) for i, t in enumerate(x)]
    return [(f"[{name!r}]", t) for name, t in x.items()]


def _rebuild(x: Batch, tensors: list[torch.Tensor]) -> Batch:
    if isinstance(x, torch.Tensor):
        return tensors[0]
    if isinstance(x, tuple):
        return tuple(tensors)
    return dict(zip(x.keys(), tensors, strict=True))


def _map(x: Batch, fn: Any) -> Batch:
    return _rebuild(x, [fn(t) for _, t in leaves(x)])


def batch_size(x: Batch) -> int:
    """N: the size of dim 0, shared by every leaf (``as_batch`` checked it). A single input may also be a row
    source read on demand (``streaming_operator.RowSource``: ``shape`` and row slicing), sized the same way."""
    return int(leaves(x)[0][1].shape[0] if is_batch(x) else x.shape[0])  # type: ignore[union-attr]


def take(x: Batch, start: int, stop: int) -> Batch:
    """Examples ``start:stop`` of every leaf (views; a row source reads those rows)."""
    return _map(x, lambda t: t[start:stop]) if is_batch(x) else x[start:stop]  # type: ignore[index]


def concat(a: Batch, b: Batch) -> Batch:
    """The examples of ``a`` then those of ``b``, leaf by leaf (same structure: ``check_sides``)."""
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b])  # type: ignore[list-item]
    return _rebuild(a, [torch.cat([s, t]) for (_, s), (_, t) in zip(leaves(a), leaves(b), strict=True)])


def to_device(x: Batch, device: torch.device) -> Batch:
    """Every leaf moved to ``device``."""
    return x.to(device) if isinstance(x, torch.Tensor) else _map(x, lambda t: t.to(device))


def one_example(x: Batch, i: int) -> Batch:
    """Example ``i`` with its batch dim removed, as ``vmap`` passes it to a per-example function."""
    return x[i] if isinstance(x, torch.Tensor) else _map(x, lambda t: t[i])


def unsqueeze(x: Batch) -> Batch:
    """One example (leaves without their batch dim, as under ``vmap``) as a batch of one."""
    return x.unsqueeze(0) if isinstance(x, torch.Tensor) else _map(x, lambda t: t.unsqueeze(0))


def call_module(module: nn.Module, state: tuple[dict[str, torch.Tensor], ...], x: Batch) -> object:
    """``module`` on the batch through ``functional_call`` with ``state`` (params, buffers): a tensor or a tuple
    as positional arguments, a mapping as keyword arguments."""
    if isinstance(x, torch.Tensor):
        return functional_call(module, state, (x,))
    if isinstance(x, tuple):
        return functional_call(module, state, x)
    return functional_call(module, state, (), dict(x))


def template(x: Batch) -> Batch:
    """A batch of one with x's leaf shapes and dtypes, holding none of its data: zeros for floats, ones for
    integers (a valid id of any vocabulary of two or more, a mask that attends)."""
    return _map(x, lambda t: (torch.zeros if t.is_floating_point() else torch.ones)((1, *t.shape[1:]), dtype=t.dtype))


def signature(x: Batch) -> Hashable:
    """What a prepared problem depends on: the structure, per-example shapes and float-or-int of each leaf."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape[1:]), x.is_floating_point())
    kind = "tuple" if isinstance(x, tuple) else "mapping"
    return (kind, tuple((name, tuple(t.shape[1:]), t.is_floating_point()) for name, t in leaves(x)))


def _leaf(x: object, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One leaf as a tensor: floats finite and cast to ``dtype``, integers as int64."""
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ShapeMismatch(
            detail=f"{name} must be a tensor (or array) batched on dim 0, got {type(x).__name__}"
        ) from exc
    if t.ndim == 0:
        raise ShapeMismatch(detail=f"{name} must have a batch dimension (N, ...), got a scalar")
    if t.shape[0] == 0:
        raise EmptyBatch(detail=f"{name} is an empty batch (shape {tuple(t.shape)}); pass at least one example")
    if t.is_floating_point():
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0]) if t.ndim > 1 else 0
            raise NonFiniteInput(detail=f"{name} contains NaN or inf (first in example {bad}); clean the inputs")
        return t.to(dtype)
    if t.is_complex():
        raise ShapeMismatch(detail=f"{name} has dtype {t.dtype}; expected a float or integer tensor")
    return t.to(torch.int64)  # bool masks included: data, as 0/1 ids


def as_batch(x: object, side: str, dtype: torch.dtype, operation: str = "compute_ntk") -> Batch:
    """Validate a tuple or mapping of inputs into a ``Batch`` (plain tensors take ``inputs.validate_inputs``' own path).

    Args:
        x: a tuple/list of tensors (forward's positional arguments) or a mapping str -> tensor (keyword
            arguments); each leaf (N, *input_i), float or integer, anything ``torch.as_tensor`` takes.
        side: "x1" or "x2", for messages.
        dtype: the compute dtype floating leaves are cast to.
        operation: the public call, for messages. Default: "compute_ntk".

    Returns:
        a tuple or dict of tensors, every leaf (N, *input_i).

    Raises:
        ShapeMismatch: no leaves, a non-string name, a scalar leaf, or leaves with different N (each named).
        EmptyBatch, NonFiniteInput: for the leaf named.
    """
    if isinstance(x, Mapping):
        if not x:
            raise ShapeMismatch(f"{operation}: {side} is an empty mapping; pass the model's inputs by name")
        bad = [key for key in x if not isinstance(key, str)]
        if bad:
            raise ShapeMismatch(f"{operation}: {side} has non-string keys {bad[:3]}; name each input by a str")
        with operation_name(operation):
            batch: Batch = {key: _leaf(value, f"{side}[{key!r}]", dtype) for key, value in x.items()}
    else:
        items = list(x)  # type: ignore[call-overload]
        if not items:
            raise ShapeMismatch(f"{operation}: {side} is an empty tuple; pass the model's positional inputs")
        with operation_name(operation):
            batch = tuple(_leaf(value, f"{side}[{i}]", dtype) for i, value in enumerate(items))
    sizes = {name: t.shape[0] for name, t in leaves(batch)}
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{side}{name}: {n}" for name, n in sizes.items())
        raise ShapeMismatch(
            f"{operation}: every input of {side} must have the same number of examples on dim 0, got {shown}; "
            "batch every input with one N"
        )
    return batch


def check_sides(x1: Batch, x2: Batch, operation: str = "compute_ntk") -> Batch:
    """x2 has the structure of x1: the same names (or count), per-example shapes and float-or-int leaves.

    Returns:
        x2, a mapping's names in x1's order (``concat`` pairs leaves by position).

    Raises:
        InvalidInput: a tensor on one side and a tuple/mapping on the other, a missing or extra name.
        ShapeMismatch: a leaf whose per-example shape or kind differs (named).
    """
    if type(x1) is not type(x2):
        raise InvalidInput(
            f"{operation}: x1 is a {type(x1).__name__} but x2 is a {type(x2).__name__}; pass both sides the same "
            "way (both tensors, both tuples or both mappings)"
        )
    if isinstance(x1, dict):
        assert isinstance(x2, dict)
        missing, extra = sorted(x1.keys() - x2.keys()), sorted(x2.keys() - x1.keys())
        if missing or extra:
            raise InvalidInput(
                f"{operation}: x2's input names differ from x1's: missing {missing}, extra {extra}; "
                f"give x2 exactly the names of x1 ({sorted(x1)})"
            )
        x2 = {name: x2[name] for name in x1}  # x1's order
    elif isinstance(x1, tuple) and isinstance(x2, tuple) and len(x1) != len(x2):
        raise InvalidInput(
            f"{operation}: x1 has {len(x1)} positional inputs, x2 has {len(x2)}; give both sides the same inputs"
        )
    for (name, a), (_, b) in zip(leaves(x1), leaves(x2), strict=True):
        if a.shape[1:] != b.shape[1:]:
            raise ShapeMismatch(
                f"{operation}: x2{name} has per-example shape {tuple(b.shape[1:])}, x1{name} has "
                f"{tuple(a.shape[1:])}; both sides must have the same per-example shape"
            )
        if a.is_floating_point() != b.is_floating_point():
            raise ShapeMismatch(
                f"{operation}: x1{name} is {a.dtype} but x2{name} is {b.dtype}; pass both as float or both as int"
            )
    return x2


def is_data_dependent(exc: BaseException) -> bool:
    """Whether ``vmap`` refused the model for data-dependent control flow (``if tensor.all(): ...``): the model
    runs one example at a time instead (NOTE [per-example loop] in jacobian_contraction.py)."""
    return "data-dependent control flow" in str(exc)  # torch.func's message for `if tensor:` under vmap


IdTables = dict[str, tuple[str, int]]
"""Integer leaf name (as ``leaves`` names it) -> (the nn.Embedding module it feeds, its num_embeddings)."""


class EmbeddingFeeds:
    """What ``embedding_feeds`` saw: which leaf reached which nn.Embedding (by storage: the leaf itself or a view)."""

    def __init__(self, x: Batch) -> None:
        self.storages = {t.untyped_storage().data_ptr(): (name, t) for name, t in leaves(x)}
        self.tables: IdTables = {}
        self.floats: list[tuple[str, str, torch.dtype]] = []

    def see(self, module_name: str, module: nn.Embedding, indices: object) -> None:
        if not isinstance(indices, torch.Tensor) or isinstance(indices, torch.nn.Parameter):
            return
        hit = self.storages.get(indices.untyped_storage().data_ptr())
        if hit is None:
            return
        if indices.is_floating_point():
            self.floats.append((hit[0], module_name, indices.dtype))
        else:
            size = self.tables.get(hit[0], ("", module.num_embeddings))[1]
            self.tables[hit[0]] = (module_name, min(size, module.num_embeddings))

    def check_floats(self) -> None:
        """Raises InvalidInput naming a floating leaf that feeds an nn.Embedding (ids must be integers)."""
        if self.floats:
            leaf, module_name, dtype = self.floats[0]
            raise InvalidInput(
                f"compute_ntk: input {leaf} is {dtype} but it feeds the nn.Embedding {module_name!r}, which takes "
                "integer token ids; pass it as an integer tensor (int64)"
            )


@contextlib.contextmanager
def embedding_feeds(module: nn.Module, x: Batch) -> Iterator[EmbeddingFeeds]:
    """Watch a forward pass of ``module`` on ``x``: which leaf of x each nn.Embedding reads (forward pre-hooks,
    removed on exit)."""
    feeds = EmbeddingFeeds(x)
    handles = [
        m.register_forward_pre_hook(lambda m, args, name=name: feeds.see(name, m, args[0] if args else None))
        for name, m in module.named_modules()
        if isinstance(m, nn.Embedding)
    ]
    try:
        yield feeds
    finally:
        for handle in handles:
            handle.remove()


def check_ids(tables: IdTables, x: Batch, side: str, operation: str = "compute_ntk") -> None:
    """Every example's ids in the leaves of ``tables`` lie inside their nn.Embedding's vocabulary.

    Args:
        tables: from the probe (``EmbeddingFeeds.tables``): leaf name -> (module name, num_embeddings).
        x: the whole batch of a side, N examples.
        side: "x1" or "x2", for messages.
        operation: the public call, for messages. Default: "compute_ntk".

    Raises:
        InvalidInput: the leaf, the first offending example, its id and the vocabulary.
    """
    if not tables or isinstance(x, torch.Tensor):
        return
    named = dict(leaves(x))
    for leaf, (module_name, size) in tables.items():
        t = named.get(leaf)
        if t is None or t.is_floating_point():
            continue
        flat = t.reshape(t.shape[0], -1)
        bad = ((flat < 0) | (flat >= size)).any(1)
        if bool(bad.any()):
            example = int(bad.nonzero()[0])
            row = flat[example]
            value = int(row[(row < 0) | (row >= size)][0])
            raise InvalidInput(
                f"{operation}: {side}{leaf} has token id {value} in example {example}, outside the vocabulary of "
                f"nn.Embedding {module_name!r} ({size} ids, 0..{size - 1}); send ids inside the vocabulary"
            )
