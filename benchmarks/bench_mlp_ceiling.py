"""How close ``compute_ntk`` gets to the matmuls it cannot avoid, on the benchmark MLP (784-512-512-10, ReLU).

A hand-written PyTorch program of exactly the structured-derivative products for this one architecture — one
forward of x1 and x2 together, δ of both hidden layers from the rows of the output weight (no autograd, no hooks,
no input checks, shapes hard-coded), the two δ Grams, the input Grams and theta's layout — is timed alternating
with ``compute_ntk`` (auto) and neural-tangents' STRUCTURED_DERIVATIVES, each run right after one of the peer's.
Its theta is checked against ours first. NT / hand-written is about the best any general engine could show here;
the gap to NT / ours is the general machinery's cost.

    .venv/bin/python benchmarks/bench_mlp_ceiling.py --n 64 --rounds 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_structured.py (NOTE [OpenMP wait policy] there)

import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from _models import MODELS, make_inputs  # noqa: E402
from _peer import PeerSession  # noqa: E402

from ntk_service.kernels import compute_ntk, retain_freed_memory  # noqa: E402
from ntk_service.kernels.runtime.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES  # noqa: E402


@torch.no_grad()
def hand_written_ntk(model: nn.Sequential, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """theta (n, m, k, k) of Linear-ReLU-Linear-ReLU-Linear by its structured derivatives, written out."""
    first, second, head = model[0], model[2], model[4]
    n, m, k = x1.shape[0], x2.shape[0], head.out_features
    x = torch.cat([x1, x2])
    z1 = torch.addmm(first.bias, x, first.weight.T)
    h1 = z1.relu()
    z2 = torch.addmm(second.bias, h1, second.weight.T)
    h2 = z2.relu()
    d2 = head.weight[:, None, :] * (z2 > 0).to(x.dtype)  # (k, n + m, 512): δ at the second layer's output
    d1 = (d2.reshape(-1, d2.shape[-1]) @ second.weight).view(k, n + m, -1) * (z1 > 0).to(x.dtype)
    one = torch.ones((), dtype=x.dtype)
    g1 = torch.addmm(one, x[:n], x[n:].T)  # a1·a2 + 1 (the bias)
    g2 = torch.addmm(one, h1[:n], h1[n:].T)
    g3 = torch.addmm(one, h2[:n], h2[n:].T)
    gram1 = d1[:, :n].reshape(k * n, -1) @ d1[:, n:].reshape(k * m, -1).T  # (k·n, k·m)
    acc = torch.mul(gram1.view(k, n, k, m), g1.view(1, n, 1, m))
    gram2 = d2[:, :n].reshape(k * n, -1) @ d2[:, n:].reshape(k * m, -1).T
    acc.addcmul_(gram2.view(k, n, k, m), g2.view(1, n, 1, m))
    theta = torch.empty(n, m, k, k, dtype=x.dtype)  # the output layer: δ = e_c, its term is I ⊗ g3
    eye = torch.eye(k, dtype=x.dtype).view(1, 1, k, k)
    return torch.addcmul(acc.permute(1, 3, 0, 2), eye, g3.view(n, m, 1, 1), out=theta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(2)
    retain_freed_memory()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)  # the peer process inherits these
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(TRIM_THRESHOLD_BYTES)
    model = MODELS["mlp"]()
    x1, x2 = make_inputs("mlp", args.n), make_inputs("mlp", args.n, seed=2)
    ours = compute_ntk(model, x1, x2).theta
    hand = hand_written_ntk(model, x1, x2)
    scale = ours.abs().max().item()
    assert (hand - ours).abs().max().item() <= 1e-4 * scale, "the hand-written kernel disagrees with compute_ntk"
    calls = {"ours": lambda: compute_ntk(model, x1, x2), "hand": lambda: hand_written_ntk(model, x1, x2)}
    times: dict[str, list[float]] = {"ours": [], "hand": [], "peer": []}
    with PeerSession() as peer:
        peer.time_once("mlp", args.n, "structured_derivatives")  # compiles
        for _ in range(args.rounds):
            for name, call in calls.items():
                times["peer"].append(peer.time_once("mlp", args.n, "structured_derivatives"))
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"mlp N = M = {args.n}, {args.rounds} rounds, each run right after one of the peer's (medians)")
    print(f"  neural-tangents SD {med['peer'] * 1e3:.2f} ms")
    for name in ("ours", "hand"):
        print(f"  {name:4s} {med[name] * 1e3:.2f} ms, NT / {name} {med['peer'] / med[name]:.3f}x")


if __name__ == "__main__":
    main()
