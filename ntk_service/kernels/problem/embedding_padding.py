"""Embedding lookups of ``padding_idx`` held constant in forward mode too, for this thread, inside a ``with`` block.

``nn.Embedding(padding_idx=p)`` is torch's convention that row p gets no gradient: the reverse-mode formula
(``embedding_dense_backward``) drops the lookups of p. The forward-mode formula does not (embedding is linear in
the weight, so its tangent is the tangent's rows at the ids, p's included), so a JVP differentiates lookups that
a VJP treats as constants. Where row p also has a gradient from elsewhere (input and output embeddings tied, as in
BERT and GPT-2) the two modes then give different kernels: a tiny Hugging Face BERT (pad_token_id 0) on ids that
contain 0 gave NTK-vector products 3.75 away from the float64 per-example reference, the Jacobian contraction 9e-14.

``padding_as_constant()`` is a ``TorchFunctionMode`` (thread-local, like ``math_attention``) that returns
``torch.where(ids == p, out.detach(), out)`` for ``F.embedding`` and ``aten.embedding`` (what exported programs
call) with a padding index: the reverse-mode convention in every mode. Reverse mode is unchanged by it (the
detached lookups are those its formula drops).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["padding_as_constant"]


def _padding_index(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, int] | None:
    """(ids, p) of an embedding call with a padding index p >= 0, else None."""
    if func is F.embedding:
        ids, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        padding = args[2] if len(args) > 2 else kwargs.get("padding_idx")
        if padding is None:
            return None
        return ids, int(padding) + (weight.shape[0] if padding < 0 else 0)
    weight, ids = args[0], args[1] if len(args) > 1 else kwargs["indices"]  # aten.embedding(weight, indices, p)
    padding = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    return None if padding < 0 else (ids, int(padding))


class padding_as_constant(TorchFunctionMode):  # noqa: N801 - used like a function: ``with padding_as_constant():``
    """Hold the lookups of an embedding's ``padding_idx`` constant inside the ``with`` block (module docstring)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not F.embedding and func is not torch.ops.aten.embedding.default:
            return out
        found = _padding_index(func, args, kwargs)
        if found is None:
            return out
        ids, padding = found
        return torch.where((ids == padding).unsqueeze(-1), out.detach(), out)
