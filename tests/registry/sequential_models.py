"""Models a user builds locally as ``nn.Sequential`` (shared by the registry, client and end-to-end tests)."""

from __future__ import annotations

import torch
from torch import nn

from ntk_service.layers import MeanPool, PositionEmbedding, Residual

RESNET_INPUT = (3, 8, 8)
TRANSFORMER_VOCAB, TRANSFORMER_LEN = 11, 6


def basic_block(c_in: int, c_out: int, stride: int) -> Residual:
    """conv3x3-BN-ReLU-conv3x3-BN, plus a 1x1 conv + BN shortcut."""
    body = nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
    )
    shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
    return Residual(body, shortcut)


def small_resnet(width: int = 4, classes: int = 3) -> nn.Sequential:
    """CIFAR-style: stem conv + BN + ReLU, three basic blocks with 1x1 shortcuts, global average pool, Linear."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        basic_block(width, width, 1),
        nn.ReLU(),
        basic_block(width, 2 * width, 2),
        nn.ReLU(),
        basic_block(2 * width, 4 * width, 2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )


def nested_resnet(width: int = 4, classes: int = 3) -> nn.Sequential:
    """A ResNet written the usual way: stages are ``nn.Sequential``s of blocks, so names are ``1.0.body.0.weight``.

    stem = Sequential(conv, BN, ReLU); stage i = Sequential(Residual block, ReLU[, block, ReLU]); head = Sequential(
    pool, flatten, Linear); the whole is Sequential(stem, stage1, stage2, head), three levels deep at the convs.
    """
    stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
    stage1 = nn.Sequential(basic_block(width, width, 1), nn.ReLU())
    stage2 = nn.Sequential(basic_block(width, 2 * width, 2), nn.ReLU(), nn.Sequential(nn.Identity()))
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes))
    return nn.Sequential(stem, stage1, stage2, head)


def small_transformer(d: int = 8, classes: int = 2) -> nn.Sequential:
    """Token + learned position embeddings, two pre-norm encoder layers, final LayerNorm, mean over tokens, Linear."""

    def layer() -> nn.TransformerEncoderLayer:
        return nn.TransformerEncoderLayer(
            d, 2, 2 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )

    return nn.Sequential(
        nn.Embedding(TRANSFORMER_VOCAB, d),
        PositionEmbedding(TRANSFORMER_LEN, d),
        layer(),
        layer(),
        nn.LayerNorm(d),
        MeanPool(1),
        nn.Linear(d, classes),
    )


def train_steps(model: nn.Sequential, x: torch.Tensor, steps: int, *, seed: int = 0) -> None:
    """A few SGD steps in train mode on random targets (BatchNorm running statistics move), then eval mode."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for _ in range(steps):
        out = model(x)
        target = torch.randn(out.shape, generator=generator)
        loss = ((out - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
