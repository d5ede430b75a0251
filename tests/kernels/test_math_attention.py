"""math_attention against attention written out by hand (softmax(q kᵀ / √d + mask) v)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ntk_service.kernels.problem.math_attention import math_attention


def _by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_a_boolean_mask_means_attend_where_true() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    keep[0, :, :, 3:] = False  # example 0's last two keys are padding, as a Hugging Face sdpa mask
    with math_attention():
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(got, _by_hand(q, k, v, keep), rtol=1e-12, atol=1e-12)
