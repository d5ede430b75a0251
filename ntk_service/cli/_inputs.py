"""Reading the CLI's array inputs: ``.npy`` files, and ``dataset:<id>[start:stop]`` references."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ntk_service.cli._app import UsageError
from ntk_service.errors import NtkServiceError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["read_npy", "read_side"]

_DATASET_REF = re.compile(r"^dataset:(?P<id>[^\[\]]+)(?:\[(?P<start>\d*):(?P<stop>\d*)\])?$")


def read_npy(path: Path, *, option: str) -> np.ndarray:
    """The array in a .npy file (never unpickled).

    Raises:
        UsageError: the file cannot be read or is not a plain numeric .npy array.
    """
    from ntk_service import wire

    try:
        body = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {str(path)!r} ({exc.strerror or exc})") from exc
    try:
        return wire.decode_npy(body, name=f"{option} {str(path)!r}")
    except NtkServiceError as exc:
        raise UsageError(f"{exc.message}; save arrays with numpy.save") from exc


def read_side(value: str, *, option: str) -> Any:
    """``--x1`` / ``--x2``: a .npy path, or ``dataset:<id>`` / ``dataset:<id>[start:stop]`` (rows of a data set).

    Returns:
        The array, or the data set slice ``{"dataset": id, "start": i, "stop": j}`` the client sends as is.
    """
    if value.startswith("dataset:"):
        match = _DATASET_REF.match(value)
        if match is None:
            raise UsageError(
                f"{option}: {value!r} is not a data set reference; write dataset:<id> or dataset:<id>[start:stop], "
                "e.g. dataset:3f2a[0:100]"
            )
        ref: dict[str, Any] = {"dataset": match["id"]}
        if match["start"]:
            ref["start"] = int(match["start"])
        if match["stop"]:
            ref["stop"] = int(match["stop"])
        return ref
    return read_npy(Path(value), option=option)
