"""Attention on its math path (matmul, softmax, matmul) for the duration of a block, in this thread only.

``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` in eval mode take fused kernels
(``aten::_native_multi_head_attention``, ``aten::_transformer_encoder_layer_fwd``) and, off that path,
``F.scaled_dot_product_attention`` picks a CPU flash kernel. None of the three has a forward-mode AD formula (so
``jvp`` fails) and the flash kernel has no vmap batching rule (so ``vmap`` runs it example by example). The math
path computes the same function from differentiable primitives.

``math_attention()`` is a ``TorchFunctionMode``, explicit and scoped: torch's mode stack is thread-local, so
nothing outside the ``with`` block (another thread, the caller's own code afterwards) sees it, unlike
``torch.backends.mha.set_fastpath_enabled`` or ``sdpa_kernel``, which flip process-wide flags. While it is active:

- every fused-path check sees a torch-function override (``has_torch_function`` is true under any mode), so
  the modules run their composite forwards;
- ``F.multi_head_attention_forward`` is called with ``need_weights=True``, its explicit bmm-softmax-bmm branch
  (the weights are dropped again when the caller did not ask for them);
- a direct ``F.scaled_dot_product_attention`` call runs ``torch._scaled_dot_product_attention_math``, torch's
  own composite reference of that function.

Measured (DESIGN §6): the math path gives forward AD on MultiheadAttention with float64 error 2.6e-16. Under
``vmap`` it is also the faster one: the per-example ``vmap(jacrev)`` of the benchmark transformer (N = M = 32)
took 4.0 s of CPU against 6.2 s on the flash kernel's per-example fallback (one process, alternating).

``attention_scope(module)`` is the mode for a model with attention modules and a no-op for the rest (the mode
costs a Python call per torch operation: nothing on a vmapped pass, traced once, but a share of a small batched
one).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["ATTENTION_MODULES", "attention_scope", "has_attention", "math_attention"]

ATTENTION_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
"""Modules whose eval forward may take a fused attention kernel."""


def _sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` by torch's composite math kernel: (..., L, Ev).

    A boolean ``attn_mask`` (True: attend, as Hugging Face's sdpa masks) is turned into the additive float mask
    the math kernel expects, as the public ``F.scaled_dot_product_attention`` does before it dispatches: the math
    kernel itself would add the booleans as 0/1.
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf")
        )
    out: torch.Tensor = torch._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]
    return out


class math_attention(TorchFunctionMode):  # noqa: N801 - used like a function: ``with math_attention():``
    """Run attention on its math path inside the ``with`` block (see the module docstring).

    Attributes:
        rerouted: whether an attention call went through this mode (the probe learns from it that a model calls
            ``F.scaled_dot_product_attention`` itself, as Hugging Face models do: ``NtkProblem.calls_attention``).
    """

    rerouted = False

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            self.rerouted = True
            wanted = kwargs.get("need_weights", args[15] if len(args) > 15 else True)
            if len(args) > 15:
                args = (*args[:15], True, *args[16:])
            else:
                kwargs = {**kwargs, "need_weights": True}
            output, weights = func(*args, **kwargs)
            return output, weights if wanted else None
        if func is F.scaled_dot_product_attention:
            self.rerouted = True
            return _sdpa_math(*args, **kwargs)
        return func(*args, **kwargs)


def has_attention(module: nn.Module) -> bool:
    """Whether ``module`` contains one of ``ATTENTION_MODULES``."""
    return any(isinstance(m, ATTENTION_MODULES) for m in module.modules())


def attention_scope(module: nn.Module, calls_attention: bool = False) -> contextlib.AbstractContextManager[object]:
    """``math_attention()`` when ``module`` has attention modules or ``calls_attention`` (the probe saw it call
    attention functions itself), else a no-op context."""
    return math_attention() if calls_attention or has_attention(module) else contextlib.nullcontext()
