"""Reading the CLI's array inputs: ``.npy`` files, ``.safetensors`` / ``.npz`` files of named arrays (a model taking
several inputs: ``input_ids``, ``attention_mask``, ...), and ``dataset:<id>[start:stop]`` references."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ntk_service.cli._app import UsageError
from ntk_service.errors import NtkServiceError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["read_named", "read_npy", "read_side", "read_span"]

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


def read_span(value: str | None, *, option: str) -> tuple[int, int] | None:
    """``a:b`` as (a, b); None stays None.

    Raises:
        UsageError: not two integers around a colon.
    """
    if value is None:
        return None
    start, _, stop = value.partition(":")
    try:
        return int(start), int(stop)
    except ValueError:
        raise UsageError(f"{option}: expected a:b (two integers), got {value!r}") from None


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def read_named(path: Path, *, option: str) -> dict[str, np.ndarray]:
    """The named arrays of a ``.safetensors`` or ``.npz`` file (one per forward argument), in the file's order.

    The ``.npz`` is read with ``allow_pickle=False`` (an object array is refused, never unpickled); safetensors
    holds raw tensors only.

    Raises:
        UsageError: the file cannot be read, holds no arrays, an object array, or a name that is not an identifier.
    """
    import numpy as np

    from ntk_service import wire

    try:
        body = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{option}: cannot read {str(path)!r} ({exc.strerror or exc})") from exc
    where = f"{option} {str(path)!r}"
    if path.suffix == ".safetensors":
        try:
            arrays = wire.decode_safetensors(body, name=where)[0]
        except NtkServiceError as exc:
            raise UsageError(f"{exc.message}; save named arrays with safetensors.numpy.save_file") from exc
    else:
        import io
        import zipfile

        try:
            with np.load(io.BytesIO(body), allow_pickle=False) as npz:
                arrays = {key: npz[key] for key in npz.files}
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
            raise UsageError(
                f"{where}: not a .npz of plain numeric arrays ({exc}); save them with numpy.savez(path, "
                "input_ids=ids, attention_mask=mask)"
            ) from exc
    if not arrays:
        raise UsageError(f"{where}: the file holds no arrays; save one per forward argument")
    for key, array in arrays.items():
        if not _NAME.match(key):
            raise UsageError(f"{where}: array name {key[:80]!r} is not an identifier (letters, digits, _)")
        if array.dtype.kind not in "biuf":
            raise UsageError(f"{where}: array {key!r} has dtype {array.dtype}; expected numbers")
    return arrays


def read_side(value: str, *, option: str) -> Any:
    """``--x1`` / ``--x2``: a .npy path, a .safetensors or .npz path of named arrays, or ``dataset:<id>`` /
    ``dataset:<id>[start:stop]`` (rows of a data set).

    Returns:
        The array, the named arrays (name -> array), or the data set slice ``{"dataset": id, "start": i,
        "stop": j}`` the client sends as is.
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
    if Path(value).suffix in (".safetensors", ".npz"):
        return read_named(Path(value), option=option)
    return read_npy(Path(value), option=option)
