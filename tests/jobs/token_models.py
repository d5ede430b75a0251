"""A tiny model over named token inputs: ``forward(input_ids, attention_mask=None)``, an nn.Embedding of 11 ids,
the mask multiplied into the embeddings, a masked mean and a linear head; for the job tests over named data sets.

Registered as a factory (``TOKEN_FACTORY``): the registry probes it on one (1, T) int64 example without a mask, so
it returns a tensor unless built with ``mapping_output=True`` (then ``{"logits": (N, k), "hidden": (N, T, d)}``,
which the registry's one-tensor probe refuses; the jobs test hands that one to the manager directly).
"""

from __future__ import annotations

import torch
from torch import nn

TOKEN_FACTORY = "tests.jobs.token_models:build"

VOCAB = 11
"""nn.Embedding size: ids 0..10."""


class TokenClassifier(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 4, k: int = 2, mapping_output: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, k)
        self.mapping_output = mapping_output

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> object:
        h = torch.tanh(self.embed(input_ids))
        if attention_mask is None:
            pooled = h.mean(1)
        else:
            mask = attention_mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        logits = self.head(pooled)
        if self.mapping_output:
            return {"logits": logits, "hidden": h}
        return logits


def build(vocab: int = VOCAB, dim: int = 4, k: int = 2, mapping_output: bool = False) -> nn.Module:
    """The factory: the registry seeds the parameters itself."""
    return TokenClassifier(vocab, dim, k, mapping_output)


def token_inputs(n: int, t: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """n examples of ``input_ids`` (n, t) in the vocabulary and an ``attention_mask`` (n, t) with padded tails."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, t), generator=g)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.int64)
    return {"input_ids": ids, "attention_mask": mask}
