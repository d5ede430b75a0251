"""The input contract of a registered model version: what its record says it takes and returns, checked before
anything is computed.

A model record states one example's shape and dtype (``input_shape``, ``input_dtype``), its named inputs
(``inputs``), the vocabulary of its token ids, and for an exported program the entries of a dict output
(``architecture["outputs"]``). The server checks every side against it once, when the side is loaded, so a bad
request is a 422 naming the side and what the model expects, never a failure deep in a forward pass; a job checks
its rows the same way.

    >>> with operation_name("ntk of model 'm'"):        # errors here start with it (NOTE [operation names])
    ...     check_input(np.zeros((2, 784), np.float32), record, side="x1")                  # doctest: +SKIP
    ...     check_output("logits[:, 0]", record)                                           # doctest: +SKIP
    >>> output_size(parse_output("logits[:, 0]"), record)                                  # k, before computing
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.problem.outputs import OutputPath, select_output
from ntk_service.registry.records import ModelRecord

__all__ = ["NamedArrays", "check_input", "check_output", "output_size", "vocabulary"]

NamedArrays = dict[str, np.ndarray]
"""One side of a model taking several tensors: forward's argument name -> (N, *shape)."""


def vocabulary(architecture: dict[str, Any]) -> int | None:
    """How many token ids the model's input embedding takes: a transformer's ``vocab_size``, or the
    ``num_embeddings`` of the Embedding an int64 ``sequential`` model starts with, an int64 ``exported`` model's
    ``vocab_size`` (its embedding's rows); None when not known (float inputs, factory models)."""
    if architecture.get("family") in ("transformer", "exported") and "vocab_size" in architecture:
        return int(architecture["vocab_size"])
    layers = architecture.get("layers") if architecture.get("family") == "sequential" else None
    if architecture.get("input_dtype") == "int64" and layers and layers[0].get("type") == "Embedding":
        return int(layers[0]["num_embeddings"])
    return None


def check_input(array: np.ndarray | NamedArrays, record: ModelRecord, *, side: str) -> None:
    """Refuse inputs the model cannot take, before computing: per-example shape, dtype, token range; for a model
    with named inputs (``record.inputs``) the names, one N for every leaf, and each leaf's shape, dtype and ids.
    Integer leaves of a named int64 input are converted to int64 in place (the graph's embeddings take int64).

    Args:
        array (ndarray or dict of ndarray): one side, (N, *input) or named arrays name -> (N, *shape).
        record (ModelRecord): the model version.
        side (str): the side's name in messages, e.g. "x1".

    Raises:
        ShapeMismatch: not a batch (N, *input_shape), token ids (N, T) longer than the model's ``max_len``, or
            named leaves with different N.
        InvalidInput: floats for a token model or integers for a float model; token ids outside the vocabulary;
            named arrays for a model taking one tensor or the reverse; a missing or extra name.
    """
    if record.inputs is not None or isinstance(array, dict):
        _check_named(array, record, side=side)
        return
    expected = tuple(record.input_shape)
    got = tuple(array.shape[1:])
    architecture = record.architecture
    is_sequence = architecture.get("family") == "transformer"
    if array.ndim < 1:
        raise ShapeMismatch(detail=f"{side} must be a batch (N, {', '.join(map(str, expected))}), got a scalar")
    if is_sequence:
        max_len = int(architecture["max_len"])
        if len(got) != 1 or not 1 <= got[0] <= max_len:
            raise ShapeMismatch(
                detail=f"{side} has per-example shape {got}, model {record.name!r} "
                f"expects token ids (T,) with 1 <= T <= {max_len}; send a batch (N, T)"
            )
    elif got != expected:
        raise ShapeMismatch(
            detail=f"{side} has per-example shape {got}, model {record.name!r} expects {expected}; "
            f"send a batch of shape (N, {', '.join(map(str, expected))})"
        )
    _check_leaf(array, record.input_dtype, vocabulary(architecture), record, side=side)


def _check_leaf(array: np.ndarray, dtype: str, vocab: int | None, record: ModelRecord, *, side: str) -> None:
    """One tensor's dtype against the model's, and its ids (every example) against the vocabulary."""
    is_integer_model = dtype == "int64"
    wanted = "integer token ids" if is_integer_model else "float32 or float64 values"
    if is_integer_model != (array.dtype.kind in "iu"):
        raise InvalidInput(
            detail=f"{side} has dtype {array.dtype}, model {record.name!r} expects {dtype}; send {wanted}"
        )
    if vocab is not None and array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= vocab:
            raise InvalidInput(
                detail=f"{side} has token ids in [{low}, {high}], model {record.name!r} "
                f"has a vocabulary of {vocab} (ids 0..{vocab - 1})"
            )


def _check_named(array: np.ndarray | NamedArrays, record: ModelRecord, *, side: str) -> None:
    spec = record.inputs
    if spec is None:
        raise InvalidInput(
            detail=f"{side} is named arrays {sorted(array)[:8]}, model {record.name!r} takes one tensor x of "
            f"per-example shape {tuple(record.input_shape)}; send {side} as one tensor"
        )
    names = list(spec.names)
    example = "{" + ", ".join(f'"{n}": ...' for n in names) + "}"
    if not isinstance(array, dict):
        raise InvalidInput(
            detail=f"{side} is one tensor, model {record.name!r} takes the named inputs {names}; send {side} "
            f"as an object of named tensors {example}"
        )
    missing, extra = [n for n in names if n not in array], sorted(set(array) - set(names))
    if missing or extra:
        raise InvalidInput(
            detail=f"{side} has the inputs {sorted(array)}, model {record.name!r} takes {names}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    n = None
    for leaf in spec.leaves:
        value = array[leaf.name]
        where = f"{side}[{leaf.name!r}]"
        if value.ndim < 1:
            raise ShapeMismatch(detail=f"{where} must be a batch (N, *{leaf.shape}), got a scalar")
        if n is not None and value.shape[0] != n:
            raise ShapeMismatch(
                detail=f"{where} has {value.shape[0]} examples, {side}[{names[0]!r}] has {n}; every input "
                "of a side needs the same N (dimension 0)"
            )
        n = value.shape[0]
        if tuple(value.shape[1:]) != leaf.shape:
            raise ShapeMismatch(
                detail=f"{where} has per-example shape {tuple(value.shape[1:])}, model {record.name!r} "
                f"expects {leaf.shape}; send a batch of shape (N, {', '.join(map(str, leaf.shape))})"
            )
        _check_leaf(value, leaf.dtype, leaf.vocab_size, record, side=where)
        if leaf.dtype == "int64" and value.dtype != np.int64:
            array[leaf.name] = value.astype(np.int64)  # the graph's embedding and masks take int64


def check_output(output: str | None, record: ModelRecord) -> None:
    """Refuse ``output`` for a model whose forward returns a tensor (the ``exported`` architecture lists the
    entries of a dict output in ``outputs``; factory models may return anything, so the engine decides).

    Raises:
        InvalidInput: ``output`` given for a model returning one tensor.
    """
    architecture = record.architecture
    if output is None or architecture.get("family") == "factory" or "outputs" in architecture:
        return
    raise InvalidInput(
        detail=f"output={output!r} was given, but model {record.name!r} returns one tensor; drop output "
        "(it selects from a model returning a dict, e.g. a Hugging Face ModelOutput)"
    )


def output_size(path: OutputPath | None, record: ModelRecord) -> int:
    """k of the kernel the parsed ``output`` path selects, known before any compute (the path passed
    :func:`check_output` already): the record's ``output_dim`` for a tensor output; for a dict output, the selection
    applied to empty (meta) tensors of the per-example shapes the exported architecture lists in ``outputs``. A
    factory model's output is only known to the engine: its ``output_dim``.

    Raises:
        InvalidInput: a path that does not select from the listed outputs (the message names what is there).
    """
    outputs = record.architecture.get("outputs")
    if path is None or not isinstance(outputs, dict):
        return record.output_dim
    shapes = {key: torch.empty((1, *shape), device="meta") for key, shape in outputs.items()}
    try:
        return int(select_output(shapes, path, "").numel())
    except InvalidInput as exc:  # select_output starts with the name it is given: the caller's boundary names it
        raise exc.leave_operation(drop=": ") from None
