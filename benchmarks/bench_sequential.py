"""Side by side, one process: (1) validating a ResNet-18-sized ``sequential`` spec on the meta device vs building
it; (2) the kernel of a user's stock ``nn.TransformerEncoderLayer`` model vs the same weights in the registry's
``ExplicitTransformerEncoderLayer`` (jacobian_contraction, trace). Prints medians and ratios.

    .venv/bin/python benchmarks/bench_sequential.py
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from torch import nn

from ntk_service.client import describe_module
from ntk_service.kernels.api import compute_ntk
from ntk_service.layers import MeanPool, PositionEmbedding, Residual
from ntk_service.registry import build_model
from ntk_service.registry.architectures import parse_architecture
from ntk_service.registry.sequential import plan_sequential
from ntk_service.registry.zoo import MAX_PARAMS


def _block(c_in: int, c_out: int, stride: int) -> Residual:
    body = nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
        nn.BatchNorm2d(c_out),
    )
    shortcut = None if stride == 1 and c_in == c_out else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False))
    return Residual(body, shortcut)


def resnet18() -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    c = 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_block(c, width, stride), nn.ReLU(), _block(width, width, 1), nn.ReLU()]
        c = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))


def _median(fn: object, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    spec = describe_module(resnet18(), input_shape=(3, 32, 32))
    config = parse_architecture(spec)
    plan_sequential(config, operation="warm", max_params=MAX_PARAMS)
    validate = _median(lambda: plan_sequential(config, operation="bench", max_params=MAX_PARAMS), 5)
    build = _median(lambda: build_model(spec, seed=0), 3)
    print(f"resnet18 spec ({len(spec['layers'])} top-level layers): validate on meta {validate * 1e3:.1f} ms")
    print(f"  build + seeded init {build * 1e3:.1f} ms; validation / build = {validate / build:.3f}")

    d, t = 32, 16
    torch.manual_seed(0)
    stock = nn.Sequential(
        nn.Embedding(50, d),
        PositionEmbedding(t, d),
        nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True),
        nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True),
        nn.LayerNorm(d),
        MeanPool(1),
        nn.Linear(d, 4),
    ).eval()
    explicit, _ = build_model(describe_module(stock, input_shape=(t,), input_dtype="int64"), seed=0)
    explicit.load_state_dict(stock.state_dict())
    x = torch.randint(0, 50, (16, t))
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stock layer's SDPA has no vmap batching rule: torch warns per call
        for model in (stock, explicit):
            compute_ntk(model, x, mode="trace", implementation="jacobian_contraction")
        for _ in range(3):  # alternate, so contention hits both alike
            for name, model in (("stock", stock), ("explicit", explicit)):
                run = lambda m=model: compute_ntk(m, x, mode="trace", implementation="jacobian_contraction")  # noqa: E731
                results.setdefault(name, []).append(_median(run, 1))
    s, e = statistics.median(results["stock"]), statistics.median(results["explicit"])
    print(
        f"transformer d={d} T={t} N=M=16 trace jacobian_contraction: stock {s * 1e3:.0f} ms, explicit {e * 1e3:.0f} ms,"
    )
    print(f"  stock / explicit = {s / e:.2f}")


if __name__ == "__main__":
    main()
