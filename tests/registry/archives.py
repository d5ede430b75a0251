"""torch.export archives for tests: a real one of a small model, and hostile variants of it (shared with HTTP tests)."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn


def export_archive(module: nn.Module, example: torch.Tensor) -> bytes:
    """``torch.export.save`` of ``module.eval()`` exported with a dynamic batch dimension, as bytes."""
    program = torch.export.export(module.eval(), (example,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


class MkdirPayload:
    """Unpickling it creates the directory ``path`` (``os.mkdir(path)``): the proof that something ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (os.mkdir, (self.path,))


def mkdir_payload(path: Path) -> bytes:
    """What ``torch.load(weights_only=False)`` and ``pickle.loads`` both run: a pickle of ``MkdirPayload(path)``."""
    return pickle.dumps(MkdirPayload(path))


def torch_load_runs_it(data: bytes, marker: Path, *, call_with: torch.Tensor | None = None) -> None:
    """The control: ``torch.export.load`` of the archive (and a call of its ``.module()`` on ``call_with``) does run
    its payload, so the archive really is hostile; the marker directory is removed again."""
    try:
        program = torch.export.load(io.BytesIO(data))
        if call_with is not None:
            program.module()(call_with)
    except Exception:  # the payload ran before torch noticed that its result is not a tensor
        pass
    assert marker.exists(), "the hostile archive did not run its payload under torch.export.load"
    marker.rmdir()


def rewrite(
    archive: bytes,
    replace: Mapping[str, bytes] | None = None,
    *,
    edit_json: Mapping[str, Callable[[Any], None]] | None = None,
    add: Mapping[str, bytes] | None = None,
    compression: int = zipfile.ZIP_STORED,
) -> bytes:
    """A copy of ``archive`` with entries (names relative to its root ``archive/``) replaced, JSON entries edited
    in place by a function, and entries added under exactly the names given (not under the root)."""
    replace, edit_json, add = dict(replace or {}), dict(edit_json or {}), dict(add or {})
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=compression) as target:
        for info in source.infolist():
            name = info.filename.split("/", 1)[1]
            data = replace.pop(name, None)
            if data is None:
                data = source.read(info)
            if name in edit_json:
                tree = json.loads(data)
                edit_json[name](tree)
                data = json.dumps(tree).encode()
            target.writestr(info.filename, data)
        for name, data in add.items():
            target.writestr(name, data)
    assert not replace, f"no such entries: {sorted(replace)}"
    return out.getvalue()


def nodes(program: Any) -> list[dict[str, Any]]:
    """The top graph's nodes of a parsed models/model.json."""
    result: list[dict[str, Any]] = program["graph_module"]["graph"]["nodes"]
    return result


def patch_declared_size(archive: bytes, name: str, size: int) -> bytes:
    """A copy of ``archive`` whose central directory declares ``size`` uncompressed bytes for entry ``name`` (its
    path under the root ``archive/``), the bytes themselves unchanged: a header that lies."""
    filename = f"archive/{name}".encode()
    info = next(i for i in zipfile.ZipFile(io.BytesIO(archive)).infolist() if i.filename.encode() == filename)
    data = bytearray(archive)
    start = data.find(b"PK\x01\x02", len(data) - 1_000_000 if len(data) > 1_000_000 else 0)
    while start != -1:
        name_length = int.from_bytes(data[start + 28 : start + 30], "little")
        if bytes(data[start + 46 : start + 46 + name_length]) == filename:
            data[start + 24 : start + 28] = size.to_bytes(4, "little")
            assert info.file_size != size
            return bytes(data)
        start = data.find(b"PK\x01\x02", start + 4)
    raise KeyError(name)
