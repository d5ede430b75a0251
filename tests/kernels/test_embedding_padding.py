"""``padding_as_constant`` (problem/embedding_padding.py): an embedding's padding lookups are constants in forward
mode as in reverse mode, so NTK-vector products and the operator agree with the per-example reverse-mode reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ntk_service.kernels import compute_ntk, feature_kernel, ntk_features, ntk_operator
from tests.reference import assert_matches, reference_ntk


class _TiedBag(nn.Module):
    """Token embeddings (padding row 0, or a negative index as F.embedding allows) tied with the output layer: the
    padding row has a gradient from the output layer only."""

    def __init__(self, padding_idx: int, functional: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 3, padding_idx=padding_idx)
        self.hidden = nn.Linear(3, 3)
        self.padding_idx, self.functional = padding_idx, functional

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.functional:
            h = F.embedding(ids, self.embed.weight, self.padding_idx)
        else:
            h = self.embed(ids)
        h = torch.tanh(self.hidden(h)).mean(dim=1)
        return h @ self.embed.weight.T  # tied: (N, 7) logits over the vocabulary


@pytest.mark.parametrize(("padding_idx", "functional"), [(0, False), (-1, True)])
def test_padding_lookups_are_constants_in_every_implementation_and_the_operator(
    padding_idx: int, functional: bool
) -> None:
    torch.manual_seed(0)
    model = _TiedBag(padding_idx, functional).double()
    pad = padding_idx % 7
    x = torch.tensor([[1, 2, pad, pad], [3, pad, 4, 5], [6, 1, 2, 3]])  # rows 0 and 1 padded
    expected = reference_ntk(model, x)
    for implementation in ("jacobian_contraction", "ntk_vector_products", "structured"):
        assert_matches(compute_ntk(model, x, implementation=implementation).theta, expected)
    v = torch.randn(3, 7, dtype=torch.float64)
    assert_matches(ntk_operator(model, x).matvec(v), torch.einsum("nmab,mb->na", expected, v))


def test_sketched_features_of_padded_ids_are_unbiased_for_the_reverse_mode_kernel() -> None:
    torch.manual_seed(0)
    model = _TiedBag(0, False).double()
    x = torch.tensor([[1, 2, 0, 0], [3, 0, 4, 5]])
    exact = reference_ntk(model, x).numpy()
    draws = np.stack([feature_kernel(ntk_features(model, x, dim=8, seed=s)).numpy() for s in range(200)])
    mean, sem = draws.mean(0), draws.std(0, ddof=1) / np.sqrt(draws.shape[0])
    # 196 entries: P(max |z| > 5) < 196 · 6e-7 for an unbiased estimate (CLT at 200 draws, deterministic seeds)
    assert float((np.abs(mean - exact) / (sem + 1e-12)).max()) < 5.0
