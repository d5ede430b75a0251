"""``F.multi_head_attention_forward`` as the ops it is made of, so the structured engine sees its projections.

``nn.MultiheadAttention`` (and ``nn.TransformerEncoderLayer`` through it) hands its packed input projection and its
output projection to ``F.multi_head_attention_forward``, a Python function that a ``TorchFunctionMode`` sees as
one call: the projections' ``linear`` calls happen inside it, where the mode is not active. ``decomposition``
returns that function's body for the engine's modes to run *with the mode active*: the same computation (torch's
own helpers for the projections and masks, then ``F.scaled_dot_product_attention`` or the explicit weights), so
every ``linear`` is a call the Linear rule covers and only attention's own product is differentiated through.

Covered: everything ``nn.MultiheadAttention`` does in eval mode without ``bias_k``/``bias_v``, ``add_zero_attn`` or
static keys (packed or separate projection weights, key padding and attention masks, ``is_causal``,
``need_weights`` with averaged or per-head weights). Anything else returns None: the call runs as it is and its
parameters take the Jacobian path. The helpers (``F._in_projection_packed``, ``F._canonical_mask``, ...) are
torch 2.13's private functions, the ones ``F.multi_head_attention_forward`` itself calls.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DECOMPOSED", "decomposition"]

DECOMPOSED = F.multi_head_attention_forward
"""The function ``decomposition`` runs as its ops (a mode compares ``func is DECOMPOSED`` before anything else)."""

_NAMES = tuple(inspect.signature(F.multi_head_attention_forward).parameters)
_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(F.multi_head_attention_forward).parameters.items()
    if p.default is not inspect.Parameter.empty
}


def decomposition(func: object, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Callable[[], Any] | None:
    """The body of ``func(*args, **kwargs)`` as a thunk to run under the caller's mode, or None when ``func`` is
    not ``F.multi_head_attention_forward`` or the call uses what is not covered (see the module docstring)."""
    if func is not F.multi_head_attention_forward:
        return None
    bound = {**_DEFAULTS, **dict(zip(_NAMES, args, strict=False)), **kwargs}
    uncovered = (
        bound["bias_k"] is not None
        or bound["bias_v"] is not None
        or bound["add_zero_attn"]
        or bound["static_k"] is not None
        or bound["static_v"] is not None
        or (bound["training"] and bound["dropout_p"] > 0.0)
    )
    return None if uncovered else (lambda: _multi_head_attention(bound))


def _multi_head_attention(b: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.multi_head_attention_forward`` without bias_k/bias_v, zero attention, static keys or dropout."""
    query, key, value, num_heads = b["query"], b["key"], b["value"], b["num_heads"]
    key_padding_mask, attn_mask, need_weights, is_causal = (
        b["key_padding_mask"],
        b["attn_mask"],
        b["need_weights"],
        b["is_causal"],
    )
    # torch's private helpers, those F.multi_head_attention_forward calls
    is_batched = F._mha_shape_check(  # type: ignore[attr-defined]
        query, key, value, key_padding_mask, attn_mask, num_heads
    )
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError("multi_head_attention_forward: is_causal needs attn_mask")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
            check_other=False,
        )  # fmt: skip
        if key_padding_mask is not None:
            is_causal = False
    head_dim = embed_dim // num_heads
    if not b["use_separate_proj_weight"]:
        q, k, v = F._in_projection_packed(  # type: ignore[attr-defined]
            query, key, value, b["in_proj_weight"], b["in_proj_bias"]
        )
    else:
        biases = (None, None, None) if b["in_proj_bias"] is None else b["in_proj_bias"].chunk(3)
        q, k, v = F._in_projection(  # type: ignore[attr-defined]
            query, key, value, b["q_proj_weight"], b["k_proj_weight"], b["v_proj_weight"], *biases
        )
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    src_len = k.size(1)
    if key_padding_mask is not None:
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    out_w, out_b = b["out_proj_weight"], b["out_proj_bias"]
    if need_weights:
        q_scaled = q * math.sqrt(1.0 / float(q.shape[-1]))
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        out = F.linear(out, out_w, out_b).view(tgt_len, bsz, -1)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if b["average_attn_weights"]:
            weights = weights.mean(dim=1)
        if not is_batched:
            return out.squeeze(1), weights.squeeze(0)
        return out, weights
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal)
    out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = F.linear(out, out_w, out_b).view(tgt_len, bsz, -1)
    return (out if is_batched else out.squeeze(1)), None
