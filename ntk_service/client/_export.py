"""Any ``nn.Module`` -> the bytes of its ``torch.export`` archive, for ``Client.register_module``.

    >>> data = export_module(model, input_shape=(3, 32, 32), input_dtype="float32")   # torch.export.save's bytes

The client imports without torch; this module imports it when called, since a user who passes a module has it.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ntk_service.errors import InvalidInput

__all__ = ["EXPORT_BATCH", "export_module", "multipart_body"]

EXPORT_BATCH = 2
"""Examples in the example batch: torch.export specializes a dimension of size 0 or 1 to that constant, so the
dynamic batch dimension needs an example of at least 2."""


def export_module(module: Any, *, input_shape: Sequence[int], input_dtype: str) -> bytes:
    """``torch.export.export(module.eval(), (x,), dynamic_shapes=<batch dynamic>)`` written by ``torch.export.save``.

    The module is put in eval mode for the export (the service computes kernels in eval mode) and its previous
    mode restored afterwards.

    Args:
        module (nn.Module): the model; forward(x) with x of shape (N, *input_shape) returns a tensor (N, *out).
        input_shape (Sequence[int]): one example's shape.
        input_dtype (str): "float32" or "int64".

    Returns:
        The archive's bytes.

    Raises:
        InvalidInput: torch.export cannot capture the forward (torch's message, then what to do).
    """
    import torch  # the client runs without torch; a caller holding an nn.Module has it

    dtype = {"float32": torch.float32, "int64": torch.int64}.get(input_dtype)
    if dtype is None:
        raise InvalidInput(f"register_module: input_dtype must be 'float32' or 'int64', got {input_dtype!r}")
    shape = (EXPORT_BATCH, *(int(n) for n in input_shape))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) if dtype == torch.float32 else torch.zeros(shape, dtype=dtype)
    was_training = module.training
    module.eval()
    try:
        program = torch.export.export(module, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    except Exception as exc:  # torch's own diagnosis is the useful part: pass it on, with what to do
        detail = str(exc).strip()
        raise InvalidInput(
            f"register_module: torch.export.export could not capture {type(module).__name__}.forward on an "
            f"input of shape {shape} ({type(exc).__name__}: {detail[:1500]}). What to do: make forward a function "
            "of tensors without Python branches on tensor values (torch.where instead of if), without .item() or "
            "data-dependent shapes, and treating the batch dimension like any other (no code that needs N == 2); "
            "see https://pytorch.org/docs/stable/export.html"
        ) from exc
    finally:
        module.train(was_training)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def multipart_body(fields: Mapping[str, str | None], files: Mapping[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body of text fields (None skipped) and files (name -> (filename, bytes)).

    Returns:
        (body, content type with its boundary).
    """
    boundary = uuid.uuid4().hex
    parts: list[bytes] = []
    for key, value in fields.items():
        if value is not None:
            head = f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n'
            parts.append(head.encode() + value.encode() + b"\r\n")
    for key, (filename, data) in files.items():
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"; filename="{filename}"\r\n'
            "Content-Type: application/zip\r\n\r\n"
        )
        parts.append(head.encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"
