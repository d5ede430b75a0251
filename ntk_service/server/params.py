"""Bounds for every integer and string a client can send, shared by path, query and body declarations.

Python integers have no size, but everything below the edge does: SQLite's INTEGER and numpy's int64 overflow
past 2⁶³ − 1 (``OverflowError: Python int too large to convert to SQLite INTEGER`` became a 500), and an unbounded
string is an unbounded allocation. Declaring the bound here, once, makes the edge answer 422 with the usual error
body and documents the limit in OpenAPI.

    >>> VersionPath = Annotated[int, Path(ge=1, le=INT64_MAX)]  # doctest: +SKIP
    >>> version: int | None = Field(None, ge=1, le=INT64_MAX)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path
from pydantic import Field

__all__ = [
    "ID_MAX_LENGTH",
    "INT64_MAX",
    "MAX_GLOBS",
    "MAX_JSON_TENSOR_VALUES",
    "Glob",
    "IdPath",
    "Int64",
    "NamePath",
    "NonNegativeInt64",
    "QUERY_MAX_LENGTH",
    "VersionPath",
    "VersionInt",
]

INT64_MAX = 2**63 - 1
"""The largest integer SQLite, numpy's int64 and torch's seeds all hold: every integer input is bounded by it."""

ID_MAX_LENGTH = 128
"""Longest id or name accepted in a path: every id the server issues (a 32-hex uuid, a 64-character name) fits."""

QUERY_MAX_LENGTH = 256
"""Longest free-form query value (a row range, a glob, a display name)."""

Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
"""Any integer that fits int64."""

NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A seed, a row index: 0 ≤ value ≤ 2⁶³ − 1."""

VersionInt = Annotated[int, Field(ge=1, le=INT64_MAX, description="A model version (1 = the initial weights).")]
"""A model version: 1 ≤ value ≤ 2⁶³ − 1."""

MAX_JSON_TENSOR_VALUES = 2**31 - 1
"""Most values a JSON tensor can hold: in practice the body limit (NTK_MAX_BODY_BYTES, at least 2 bytes a value)
refuses far fewer first; this is the bound OpenAPI states."""

MAX_GLOBS = 256
"""Most parameter globs one request may name (a model with more parameter tensors can select by prefix)."""

Glob = Annotated[str, Field(min_length=1, max_length=QUERY_MAX_LENGTH)]
"""One glob over parameter names (``fnmatch``), e.g. ``"layers.0.*"``."""

IdPath = Annotated[str, Path(min_length=1, max_length=ID_MAX_LENGTH, description="An id the server issued.")]
"""A resource id in the path (data sets, jobs)."""

NamePath = Annotated[str, Path(min_length=1, max_length=ID_MAX_LENGTH, description="The model's registered name.")]
"""A model name in the path."""

VersionPath = Annotated[
    int, Path(ge=1, le=INT64_MAX, description="A version number (1 = the registered initial weights).")
]
"""A model version in the path."""
