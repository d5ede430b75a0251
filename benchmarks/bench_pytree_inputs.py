"""A tiny BERT masked LM through ``compute_ntk`` with mapping inputs: kernel time per implementation (AUTO's pick
named), and the overhead of the mapping path against the plain-tensor path on the same model.

1. Per implementation, the FULL kernel of the label-word logits at one position (``output="logits[:, 2, :4]"``,
   k = 4) of N x1 against M x2 examples, with ``attention_mask`` (the model then refuses ``vmap``: AUTO and the
   Jacobian contraction take the per-example loop, the others are refused and reported so) and without it (every
   implementation runs batched).
2. The same model and examples, alternating in one process: ``compute_ntk(bert, {"input_ids": ids},
   output="logits[:, 2, :4]")`` (the mapping path: ``problem/batch.py`` leaves, ``problem/outputs.py``
   selection) against ``compute_ntk(Plain(bert), ids)`` (a wrapper whose forward takes the tensor and returns the
   same logits: the plain-tensor path). The ratio of medians is the mapping path's overhead (target <= 1.05).

    .venv/bin/python benchmarks/bench_pytree_inputs.py                       # N = 32, M = 16, 10 rounds
    .venv/bin/python benchmarks/bench_pytree_inputs.py --n 4 --m 2 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ntk_service.errors import UnsupportedModel  # noqa: E402
from ntk_service.kernels import compute_ntk  # noqa: E402

IMPLEMENTATIONS = ("auto", "jacobian_contraction", "ntk_vector_products", "structured")
OUTPUT = "logits[:, 2, :4]"
VOCAB, T = 30, 8


def tiny_bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=T,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.BertForMaskedLM(config).eval()


class Plain(nn.Module):
    """The same function as the mapping path, on a plain tensor of ids: (n, T) -> (n, 4)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm(input_ids=ids).logits[:, 2, :4]
        return out


def inputs(n: int, seed: int, *, masked: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = {"input_ids": torch.randint(0, VOCAB, (n, T), generator=g)}
    if masked:
        mask = torch.ones(n, T, dtype=torch.int64)
        mask[::2, T - 2 :] = 0
        x["attention_mask"] = mask
    return x


def timed(fn, rounds: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    result = fn()  # warm: the prepared problem is kept from here on
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def per_implementation(bert: nn.Module, n: int, m: int, rounds: int) -> None:
    for masked in (True, False):
        x1, x2 = inputs(n, 1, masked=masked), inputs(m, 2, masked=masked)
        print(f"\ntiny BERT, N={n}, M={m}, full, k=4, {'with' if masked else 'without'} attention_mask")
        for impl in IMPLEMENTATIONS:
            try:
                t, result = timed(
                    lambda impl=impl, x1=x1, x2=x2: compute_ntk(bert, x1, x2, output=OUTPUT, implementation=impl),
                    rounds,
                )
            except UnsupportedModel as exc:
                print(f"  {impl:22s} refused: {str(exc)[:90]}...")
                continue
            ran = result.implementation.value  # type: ignore[attr-defined]
            loop = " (per-example loop)" if result.per_example_loop else ""  # type: ignore[attr-defined]
            print(f"  {impl:22s} {t * 1e3:8.1f} ms   ran {ran}{loop}")


def overhead(bert: nn.Module, n: int, m: int, rounds: int) -> None:
    x1, x2 = inputs(n, 3, masked=False), inputs(m, 4, masked=False)
    plain = Plain(bert)
    mapping_call = lambda: compute_ntk(bert, x1, x2, output=OUTPUT, implementation="jacobian_contraction")  # noqa: E731
    plain_call = lambda: compute_ntk(plain, x1["input_ids"], x2["input_ids"], implementation="jacobian_contraction")  # noqa: E731
    a, b = mapping_call(), plain_call()
    assert torch.allclose(a.theta, b.theta, rtol=1e-4, atol=1e-6), "the two paths must compute the same kernel"
    mapping_times, plain_times = [], []
    for _ in range(rounds):  # alternating, one process
        for fn, times in ((mapping_call, mapping_times), (plain_call, plain_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    tm, tp = statistics.median(mapping_times), statistics.median(plain_times)
    print(f"\nmapping vs plain tensor, jacobian_contraction, N={n}, M={m}, {rounds} rounds alternating")
    print(f"  mapping {tm * 1e3:.1f} ms   plain {tp * 1e3:.1f} ms   ratio {tm / tp:.3f} (target <= 1.05)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    bert = tiny_bert()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    per_implementation(bert, args.n, args.m, args.rounds)
    overhead(bert, args.n, args.m, args.rounds)


if __name__ == "__main__":
    main()
