"""The ``output=`` selector: which tensor of what forward returns is f, so k = its size per example.

- None: forward returns a tensor (N, *out).
- a key or attribute name, e.g. ``"logits"`` of a dict or a Hugging Face ``ModelOutput``;
- a small path: names joined by ``.``, each optionally followed by indexing in brackets, e.g. ``"logits[:, 0]"``,
  ``"hidden.last"``, ``"[0]"`` (the first element of a returned tuple), ``"logits[:, -1, 2:5]"``.

The path is PARSED by the tiny grammar below, never evaluated:

    path  := step ('.' name step?)* | name step?
    step  := '[' index (',' index)* ']'
    index := int | [int] ':' [int] [':' [int]] | '...'

A name looks up a key of a mapping (``dict``, ``ModelOutput``) and else an attribute. Brackets index a tuple or
list (one int) or a tensor; on a tensor the first index must keep the batch dimension (``:`` or ``...``), since
the path applies to the model's output for the whole batch.

Example::

    >>> path = parse_output("logits[:, 0]")
    >>> select_output({"logits": torch.zeros(4, 7, 3)}, path).shape
    torch.Size([4, 3])
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import EllipsisType
from typing import TypeAlias

import torch

from ntk_service.errors import InvalidInput, operation_name

__all__ = ["OutputPath", "parse_output", "select_output"]

Index: TypeAlias = int | slice | EllipsisType

_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<int>-?\d+)|(?P<dots>\.\.\.)|(?P<punct>[\[\].,:]))")


@dataclass(frozen=True)
class OutputPath:
    """A parsed ``output=`` path: steps applied in order to what forward returns.

    Attributes:
        text: the path as given (for messages and cache keys).
        steps: each a name (str) or an index tuple (ints, slices, Ellipsis).
    """

    text: str
    steps: tuple[str | tuple[Index, ...], ...] = field(compare=False)  # equal and hashed by text (slices do not hash)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise InvalidInput(
                detail=f"output path {text!r} has an unexpected character at position {pos}; expected names, "
                "'.', and brackets of ints, ':' and '...', e.g. 'logits' or 'logits[:, 0]'"
            )
        kind = match.lastgroup or ""
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


def parse_output(path: str | OutputPath | None, operation: str = "compute_ntk") -> OutputPath | None:
    """Parse an ``output=`` path (see the module docstring for the grammar).

    Args:
        path: the path text, an already parsed path, or None (forward returns a tensor).
        operation: the public call, for messages. Default: "compute_ntk".

    Returns:
        The OutputPath, or None for None.

    Raises:
        InvalidInput: not a string, empty, or not in the grammar (the message says where).
    """
    if path is None or isinstance(path, OutputPath):
        return path
    if not isinstance(path, str):
        raise InvalidInput(f"{operation}: output must be a string path like 'logits[:, 0]', got {type(path).__name__}")
    with operation_name(operation):
        tokens = _tokens(path)
    if not tokens:
        raise InvalidInput(f"{operation}: output path is empty; pass None for a model that returns a tensor")

    def fail(what: str) -> InvalidInput:
        return InvalidInput(
            f"{operation}: output path {path!r}: {what}; expected e.g. 'logits', 'logits[:, 0]' or '[0]'"
        )

    steps: list[str | tuple[Index, ...]] = []
    i = 0
    expect_name = tokens[0][1] != "["
    while i < len(tokens):
        kind, value = tokens[i]
        if expect_name:
            if kind != "name":
                raise fail(f"expected a name at {value!r}")
            steps.append(value)
            i += 1
        elif value == "[":
            index, i = _index(tokens, i + 1, fail)
            steps.append(index)
        elif value == ".":
            expect_name = True
            i += 1
            continue
        else:
            raise fail(f"unexpected {value!r}")
        expect_name = False
    if expect_name:
        raise fail("it ends with '.'")
    return OutputPath(path, tuple(steps))


def _index(tokens: list[tuple[str, str]], i: int, fail: object) -> tuple[tuple[Index, ...], int]:
    """Parse ``index (',' index)* ']'`` from tokens[i]; returns the index tuple and the position after ']'."""
    assert callable(fail)
    items: list[Index] = []
    parts: list[int | None] = [None]
    sliced = False
    dots = False
    while True:
        if i >= len(tokens):
            raise fail("a '[' is not closed")
        kind, value = tokens[i]
        if kind == "int":
            if parts[-1] is not None or dots:
                raise fail(f"unexpected {value!r}")
            parts[-1] = int(value)
        elif kind == "dots":
            if sliced or parts[-1] is not None or dots:
                raise fail("'...' must stand alone")
            dots = True
        elif value == ":":
            if dots or len(parts) == 3:
                raise fail("a slice has at most two ':'")
            sliced = True
            parts.append(None)
        elif value in (",", "]"):
            if dots:
                items.append(Ellipsis)
            elif sliced:
                items.append(slice(*parts))
            elif parts[-1] is not None:
                items.append(parts[-1])
            else:
                raise fail("an empty index")
            parts, sliced, dots = [None], False, False
            if value == "]":
                return tuple(items), i + 1
        else:
            raise fail(f"unexpected {value!r} inside brackets")
        i += 1


def select_output(out: object, path: OutputPath | None, operation: str = "compute_ntk") -> torch.Tensor:
    """The tensor ``path`` selects from the model's output ``out`` (the whole batch's).

    Args:
        out: what forward returned: a tensor, a mapping (dict, ``ModelOutput``), an object with attributes, a tuple.
        path: the parsed path, or None for a tensor output.
        operation: the public call, for messages. Default: "compute_ntk".

    Returns:
        The selected tensor (N, *out): the model's own tensor for a name (not a copy), a view for an index.

    Raises:
        InvalidInput: a name that is not there (the message lists what is), an index on the wrong kind of value
            or out of range, an index that drops the batch dimension, or a non-tensor result.
    """
    if path is None:
        if isinstance(out, torch.Tensor):
            return out
        raise InvalidInput(
            f"{operation}: the model returned a {type(out).__name__}{_available(out)}, not a tensor; pass output= "
            "naming the tensor to differentiate, e.g. output='logits'"
        )
    value = out
    for step in path.steps:
        if isinstance(step, str):
            if isinstance(value, Mapping) and step in value:
                value = value[step]
            elif not isinstance(value, Mapping | torch.Tensor | tuple | list) and hasattr(value, step):
                value = getattr(value, step)
            else:
                raise InvalidInput(
                    f"{operation}: output path {path.text!r}: {step!r} is not in the {type(value).__name__} "
                    f"there{_available(value)}; name one of those"
                )
        elif isinstance(value, torch.Tensor):
            if step[0] is not Ellipsis and step[0] != slice(None):
                raise InvalidInput(
                    f"{operation}: output path {path.text!r}: the first index of a tensor must be ':' (or '...'), "
                    "keeping the batch dimension; the path applies to the output of the whole batch"
                )
            try:
                value = value[step]
            except IndexError as exc:
                raise InvalidInput(
                    f"{operation}: output path {path.text!r}: index {_show(step)} does not fit the tensor of shape "
                    f"{tuple(value.shape)} ({exc})"
                ) from exc
        elif isinstance(value, tuple | list) and len(step) == 1 and isinstance(step[0], int):
            if not -len(value) <= step[0] < len(value):
                raise InvalidInput(
                    f"{operation}: output path {path.text!r}: index {step[0]} is out of range for a "
                    f"{type(value).__name__} of {len(value)}"
                )
            value = value[step[0]]
        else:
            raise InvalidInput(
                f"{operation}: output path {path.text!r}: cannot index a {type(value).__name__} with {_show(step)}"
            )
    if not isinstance(value, torch.Tensor):
        raise InvalidInput(
            f"{operation}: output path {path.text!r} selects a {type(value).__name__}{_available(value)}, not a "
            "tensor; extend the path to a tensor"
        )
    return value


def _available(value: object) -> str:
    if isinstance(value, Mapping):
        return f" (keys: {', '.join(repr(k) for k in value)})"
    if isinstance(value, tuple | list):
        return f" of {len(value)} elements"
    return ""


def _show(index: tuple[Index, ...]) -> str:
    def one(item: Index) -> str:
        if item is Ellipsis:
            return "..."
        if isinstance(item, slice):
            parts = ["" if p is None else str(p) for p in (item.start, item.stop, item.step)]
            return ":".join(parts[:2] if item.step is None else parts)
        return str(item)

    return "[" + ", ".join(one(i) for i in index) + "]"
