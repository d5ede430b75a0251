"""Weights as safetensors only: the canonical tensors of a module, strict checks of uploads, loading.

Never ``torch.load`` or pickle: uploads are parsed by ``safetensors.torch.load`` (a JSON header and raw buffers).

NOTE [tied weights]
The stored tensors are the module's ``state_dict()`` (parameters and persistent buffers) with aliases removed,
exactly as ``safetensors.torch.save_model`` removes them, since safetensors refuses shared storage: when several names
share one storage (tied weights, e.g. an output layer reusing the embedding matrix), only the alphabetically first
name whose tensor covers the whole storage is stored. So for any model, ``save_model(model, path)`` writes exactly the
upload ``add_version`` expects (and ``save_file(model.state_dict(), path)`` does too when nothing is tied). Loading
copies into the module's existing tensors (``load_state_dict`` without ``assign``), so a tied storage is filled once,
through its stored name, and the tie is kept.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ntk_service.errors import InvalidInput, MalformedRequest, NonFiniteInput, operation_name

__all__ = [
    "TensorLayout",
    "canonical_tensors",
    "check_tensors",
    "layout_of",
    "load_tensors",
    "parse_safetensors",
    "safetensors_architecture",
    "serialize",
]

_MAX_HEADER_BYTES = 100_000_000
"""safetensors' own cap on the JSON header (a ResNet's header is a few KB)."""

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class TensorLayout:
    """What one stored tensor must look like."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        return f"{list(self.shape)} {_dtype_name(self.dtype)}"


def canonical_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors to store: ``state_dict()`` without aliases, as ``safetensors.torch.save_model`` writes them.

    See NOTE [tied weights]: of the names sharing one storage, the alphabetically first name whose tensor covers the
    whole storage is kept (safetensors' own rule), the others are dropped. Order: ``state_dict()`` order.

    Raises:
        InvalidInput: names share a storage that none of them covers entirely.
    """
    state = module.state_dict()
    groups: dict[tuple[torch.device, int, int], list[str]] = {}
    for name, tensor in state.items():
        storage = tensor.untyped_storage()
        if tensor.device.type != "meta" and storage.data_ptr() != 0 and storage.nbytes() != 0:
            groups.setdefault((tensor.device, storage.data_ptr(), storage.nbytes()), []).append(name)
    dropped: set[str] = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        complete = sorted(n for n in names if _covers_storage(state[n]))
        if not complete:
            raise InvalidInput(
                detail=f"tensors {sorted(names)} share memory but none covers all of it; safetensors cannot "
                "store that, so the model must own them separately"
            )
        dropped.update(n for n in names if n != complete[0])
    return {n: t.detach().contiguous() for n, t in state.items() if n not in dropped}


def _covers_storage(tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    return tensor.data_ptr() == storage.data_ptr() and tensor.numel() * tensor.element_size() == storage.nbytes()


def serialize(tensors: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    """safetensors bytes (no metadata, so the same tensors always give the same bytes) and their hex sha256."""
    data = safetensors.torch.save(tensors)
    return data, hashlib.sha256(data).hexdigest()


def parse_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """Parse an upload.

    Raises:
        MalformedRequest: the bytes are not a safetensors file.
    """
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) < 8:
        raise MalformedRequest(detail=f"the body is not a safetensors file (got {len(data)} bytes)")
    try:
        return safetensors.torch.load(bytes(data))
    except Exception as exc:  # SafetensorError and friends: any parse failure is the client's malformed body
        raise MalformedRequest(
            detail=f"the body is not a valid safetensors file ({exc}); write it with "
            "safetensors.torch.save_file(model.state_dict(), path)"
        ) from exc


def check_tensors(expected: dict[str, TensorLayout], got: dict[str, torch.Tensor]) -> None:
    """Strict comparison of uploaded tensors with the architecture's: same names, shapes and dtypes, finite values.

    Raises:
        InvalidInput: naming every missing, unexpected and mismatched tensor.
        NonFiniteInput: a floating tensor holds NaN or inf.
    """
    missing = [n for n in expected if n not in got]
    unexpected = sorted(n for n in got if n not in expected)
    mismatched = [
        f"{n} (expected {layout.describe()}, got {list(got[n].shape)} {_dtype_name(got[n].dtype)})"
        for n, layout in expected.items()
        if n in got and (tuple(got[n].shape) != layout.shape or got[n].dtype != layout.dtype)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"mismatched tensors: {'; '.join(mismatched)}")
    if problems:
        raise InvalidInput(
            detail=f"the weights do not match the architecture: {' | '.join(problems)}; expected exactly "
            f"{len(expected)} tensors named as in the model's state_dict() (GET the model for its parameters)"
        )
    bad = [n for n, t in got.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteInput(detail=f"tensors {', '.join(bad)} contain NaN or inf; upload finite weights")


def layout_of(tensors: dict[str, torch.Tensor]) -> dict[str, TensorLayout]:
    """Name -> (shape, dtype) of each tensor, in order."""
    return {n: TensorLayout(tuple(t.shape), t.dtype) for n, t in tensors.items()}


def load_tensors(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy stored tensors into ``module`` in place (ties kept; see NOTE [tied weights]).

    Raises:
        InvalidInput: names do not fit the module (a stored file that no longer matches its architecture).
    """
    canonical = canonical_tensors(module)
    check_tensors(layout_of(canonical), tensors)
    result = module.load_state_dict(tensors, strict=False)
    aliases = set(module.state_dict()) - set(canonical)
    if result.unexpected_keys or set(result.missing_keys) - aliases:
        raise InvalidInput(
            detail=f"weights do not fit the model: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )


def safetensors_architecture(data: bytes, *, operation: str) -> dict[str, Any]:
    """The architecture a weights upload carries as JSON in its safetensors ``__metadata__["architecture"]``.

    Raises:
        MalformedRequest: the bytes are not safetensors (bad header).
        InvalidInput: no ``architecture`` entry, or one that is not a JSON object.
    """
    with operation_name(operation):
        if len(data) < 8:
            raise MalformedRequest(detail=f"the body is not a safetensors file (got {len(data)} bytes)")
        (size,) = struct.unpack("<Q", bytes(data[:8]))
        if size > min(len(data) - 8, _MAX_HEADER_BYTES):
            raise MalformedRequest(detail=f"the body is not a safetensors file (its header claims {size} bytes)")
        try:
            header = json.loads(bytes(data[8 : 8 + size]))
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedRequest(detail=f"the body is not a safetensors file (header: {exc})") from exc
        metadata = header.get("__metadata__") if isinstance(header, dict) else None
        raw = metadata.get("architecture") if isinstance(metadata, dict) else None
        if not isinstance(raw, str):
            raise InvalidInput(
                detail="the safetensors file has no __metadata__['architecture']; put the architecture there as "
                "JSON (Client.register_module does), or register with a JSON body and upload the weights as version 2"
            )
        try:
            architecture = json.loads(raw)
        except ValueError as exc:
            raise InvalidInput(detail=f"__metadata__['architecture'] is not valid JSON ({exc})") from exc
        if not isinstance(architecture, dict):
            raise InvalidInput(detail="__metadata__['architecture'] must be a JSON object with a 'family' key")
        return architecture
