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

__all__ = ["EXPORT_BATCH", "InputDtype", "InputShape", "export_module", "multipart_body"]

EXPORT_BATCH = 2
"""Examples in the example batch: torch.export specializes a dimension of size 0 or 1 to that constant, so the
dynamic batch dimension needs an example of at least 2."""


InputShape = Sequence[int] | Mapping[str, Sequence[int]]
"""One example's shape, or a shape per input name (forward's keyword arguments)."""
InputDtype = str | Mapping[str, str]
"""One dtype, or a dtype per input name (names missing from the mapping are "float32")."""


def _example(torch: Any, shape: Sequence[int], dtype_name: str, name: str, seed: int) -> Any:
    dtype = {"float32": torch.float32, "int64": torch.int64}.get(dtype_name)
    if dtype is None:
        raise InvalidInput(f"register_module: input_dtype{name} must be 'float32' or 'int64', got {dtype_name!r}")
    full = (EXPORT_BATCH, *(int(n) for n in shape))
    generator = torch.Generator().manual_seed(seed)
    # int64 examples are ones, not zeros: a mask of zeros would take a fully-masked branch
    return torch.randn(full, generator=generator) if dtype == torch.float32 else torch.ones(full, dtype=dtype)


def _mapping_output(torch: Any, module: Any) -> Any:
    """``module`` as a shallow copy (the same parameters and names) whose forward returns a plain ``dict`` of the
    tensors when it returns a mapping (a Hugging Face ``ModelOutput``): the server accepts plain containers only,
    and drops non-tensor entries (a KV cache)."""
    import copy
    import functools

    base = type(module)

    class _DictOutput(base):  # type: ignore[misc, valid-type]
        @functools.wraps(base.forward)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = base.forward(self, *args, **kwargs)
            if isinstance(out, Mapping):
                return {str(k): v for k, v in out.items() if isinstance(v, torch.Tensor)}
            return out

    _DictOutput.__name__ = _DictOutput.__qualname__ = base.__name__
    wrapped = copy.copy(module)
    wrapped.__class__ = _DictOutput
    return wrapped


def export_module(module: Any, *, input_shape: InputShape, input_dtype: InputDtype) -> bytes:
    """``torch.export.export(module.eval(), ...)`` with a dynamic batch dimension, written by ``torch.export.save``.

    With one ``input_shape`` forward takes one tensor x (N, *input_shape). With a mapping, forward takes keyword
    arguments, one (N, *shape) tensor per name (``{"input_ids": (T,), "attention_mask": (T,)}``), all sharing one
    dynamic N. A forward returning a mapping (a Hugging Face ``ModelOutput``) is exported returning a plain dict
    of its tensors; requests select one with ``output``. The module is put in eval mode for the export (the
    service computes kernels in eval mode) and its previous mode restored afterwards.

    Args:
        module (nn.Module): the model.
        input_shape (Sequence[int] | Mapping[str, Sequence[int]]): one example's shape, or one per input name.
        input_dtype (str | Mapping[str, str]): "float32" or "int64", or one per input name ("float32" for names
            it omits).

    Returns:
        The archive's bytes.

    Raises:
        InvalidInput: a dtype other than float32/int64, dtype names that are not inputs, a mapping dtype with
            one shape, or torch.export failing to capture the forward (torch's message, then what to do).
    """
    import torch  # the client runs without torch; a caller holding an nn.Module has it

    batch = torch.export.Dim("batch")
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    if isinstance(input_shape, Mapping):
        dtypes = dict(input_dtype) if isinstance(input_dtype, Mapping) else dict.fromkeys(input_shape, input_dtype)
        extra = sorted(set(dtypes) - set(input_shape))
        if extra or not input_shape:
            raise InvalidInput(
                f"register_module: input_dtype names {extra} that input_shape lacks ({sorted(input_shape)}); key "
                "both mappings by forward's keyword arguments"
                if extra
                else "register_module: input_shape is an empty mapping; give one shape per forward argument"
            )
        kwargs = {
            name: _example(torch, shape, dtypes.get(name, "float32"), f"[{name!r}]", seed)
            for seed, (name, shape) in enumerate(input_shape.items())
        }
        dynamic: Any = {name: {0: batch} for name in kwargs}
        shapes: Any = {name: tuple(x.shape) for name, x in kwargs.items()}
    else:
        if isinstance(input_dtype, Mapping):
            raise InvalidInput(
                "register_module: input_dtype is a mapping but input_shape is one shape; give input_shape as a "
                "mapping keyed like input_dtype (one shape per forward argument)"
            )
        args = (_example(torch, input_shape, input_dtype, "", 0),)
        dynamic, shapes = ({0: batch},), tuple(args[0].shape)
    was_training = module.training
    module.eval()
    try:
        program = torch.export.export(_mapping_output(torch, module), args, kwargs or None, dynamic_shapes=dynamic)
    except Exception as exc:  # torch's own diagnosis is the useful part: pass it on, with what to do
        detail = str(exc).strip()
        raise InvalidInput(
            f"register_module: torch.export.export could not capture {type(module).__name__}.forward on an "
            f"input of shape {shapes} ({type(exc).__name__}: {detail[:1500]}). What to do: make forward a function "
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
