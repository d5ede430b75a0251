"""Structured derivatives side by side with neural-tangents' STRUCTURED_DERIVATIVES, and the MLP scaling table.

Part 1 (``--peer``, default on): for each model × N (= M, x2 ≠ x1), the full kernel (N, M, k, k) in float32 by
our ``structured`` and ``auto`` and, in the same run, neural-tangents' jitted ``STRUCTURED_DERIVATIVES`` in
``.peer-venv`` (``make peer-venv``). Our runs come before and after the peer's, per case, so both see the same
machine load. Prints medians and the ratio peer / ours (> 1: we are faster).

Part 2 (``--scaling``): the MLP (ReLU, biases, 784 inputs, two hidden layers of ``width``, 10 outputs) full
kernel, time vs N at width 512 and vs width at N = 256, for each implementation; a case whose estimated FLOPs
(the engine's own cost model) would take longer than ``--max-seconds`` at ``ASSUMED_FLOPS`` is skipped.

    .venv/bin/python benchmarks/bench_structured.py                          # part 1, mlp and cnn, N = 64, 256
    .venv/bin/python benchmarks/bench_structured.py --no-peer --scaling      # part 2 only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# NOTE [OpenMP wait policy]: on a shared machine (more runnable threads than cores) libgomp's default spin-waiting
# makes every parallel torch op wait a scheduler slice for its descheduled partner thread: the MLP kernel at
# N = 64 took ~1 s instead of ~0.1 s at load 8. On a lightly loaded machine (load ~1.5) PASSIVE and the default
# were within run-to-run noise of each other (MLP N = 64: 26-32 ms both). Set before torch loads libgomp; an
# explicit setting in the environment wins. The peer (XLA's own thread pool) is unaffected.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch import nn

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from _models import MODELS, make_inputs  # noqa: E402
from _peer import PeerUnavailableError, run_peer  # noqa: E402

from ntk_service.kernels import compute_ntk  # noqa: E402
from ntk_service.kernels.api import _ALGORITHMS  # noqa: E402
from ntk_service.kernels.functional import eval_semantics, prepare_problem  # noqa: E402
from ntk_service.kernels.modes import KernelMode  # noqa: E402

THREADS = 2
"""Intra-op threads for our side: the machine's cores (the peer's XLA uses all cores too)."""

ASSUMED_FLOPS = 50e9
"""FLOP/s assumed when deciding to skip a scaling case as too slow (a cautious figure for 2 cores)."""

SCALING_IMPLEMENTATIONS = ["structured", "jacobian_contraction", "ntk_vector_products", "auto"]


def _timed_runs(call: Callable[[], object], repeats: int, max_seconds: float) -> list[float]:
    """Up to ``repeats`` timed runs after one warm-up, stopping once they add up to ``max_seconds``."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    if first > max_seconds / 2:
        return [first]
    times: list[float] = []
    while len(times) < repeats and sum(times) < max_seconds:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _median_seconds(call: Callable[[], object], repeats: int, max_seconds: float) -> tuple[float, int]:
    """Median of ``_timed_runs`` and how many there were."""
    times = _timed_runs(call, repeats, max_seconds)
    return statistics.median(times), len(times)


def _ours(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, implementation: str) -> Callable[[], str]:
    def call() -> str:
        return compute_ntk(model, x1, x2, implementation=implementation).implementation.value

    return call


def peer_table(models: list[str], sizes: list[int], repeats: int, max_seconds: float) -> None:
    print("| model | N = M | neural-tangents SD (s) | ours structured (s) | ours auto (s) | NT / structured |")
    print("|---|---|---|---|---|---|")
    for name in models:
        model = MODELS[name]()
        for n in sizes:
            x1, x2 = make_inputs(name, n), make_inputs(name, n, seed=2)
            # ours before and after the peer (whose large, short-lived process leaves the machine slower for a
            # while: fresh page faults), so neither side alone gets the quiet or the disturbed moments
            structured_runs = _timed_runs(_ours(model, x1, x2, "structured"), repeats, max_seconds)
            peer_s: float | None
            try:
                row = run_peer([name], [n], ["structured_derivatives"], repeats=repeats, max_seconds=max_seconds)
                peer_s = row[0]["seconds"]
            except PeerUnavailableError as exc:
                print(f"(peer unavailable: {str(exc).splitlines()[0]})", file=sys.stderr)
                peer_s = None
            structured_runs += _timed_runs(_ours(model, x1, x2, "structured"), repeats, max_seconds)
            structured_s = statistics.median(structured_runs)
            auto_call = _ours(model, x1, x2, "auto")
            auto_s, _ = _median_seconds(auto_call, repeats, max_seconds)
            chosen = auto_call()
            ratio = f"{peer_s / structured_s:.2f}x" if peer_s else "n/a"
            peer_text = f"{peer_s:.4f}" if peer_s else "n/a"
            print(
                f"| {name} | {n} | {peer_text} | {structured_s:.4f} | {auto_s:.4f} ({chosen}) | {ratio} |",
                flush=True,
            )


def _mlp(width: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        ).eval()


def _estimated_seconds(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, implementation: str) -> float:
    if implementation == "auto":
        return 0.0
    alg = next(a for i, a in _ALGORITHMS.items() if i.value == implementation)
    with eval_semantics(model):
        problem, _, _ = prepare_problem(model, x1, x2, params=None, dtype=None)
        return alg.flops(problem, x1.shape[0], x2.shape[0], KernelMode.FULL) / ASSUMED_FLOPS


def scaling_table(sizes: list[int], widths: list[int], repeats: int, max_seconds: float) -> None:
    cases = [(n, 512) for n in sizes] + [(256, w) for w in widths if w != 512]
    print("| N = M | width | " + " | ".join(SCALING_IMPLEMENTATIONS) + " |")
    print("|---|---|" + "---|" * len(SCALING_IMPLEMENTATIONS))
    for n, width in cases:
        model = _mlp(width)
        x1, x2 = make_inputs("mlp", n), make_inputs("mlp", n, seed=2)
        cells = []
        for implementation in SCALING_IMPLEMENTATIONS:
            estimate = _estimated_seconds(model, x1, x2, implementation)
            if estimate > max_seconds:
                cells.append(f"skipped (~{estimate:.0f} s est.)")
                continue
            try:
                seconds, runs = _median_seconds(_ours(model, x1, x2, implementation), repeats, max_seconds)
            except Exception as exc:  # e.g. MemoryEstimateExceeded: report it in the table
                cells.append(type(exc).__name__)
                continue
            cells.append(f"{seconds:.3f}" + ("" if runs > 1 else " (1 run)"))
        print(f"| {n} | {width} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=sorted(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--scaling", action="store_true")
    parser.add_argument("--scaling-sizes", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
    parser.add_argument("--scaling-widths", nargs="+", type=int, default=[256, 512, 1024, 2048])
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    print(f"torch threads {THREADS}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, load {os.getloadavg()[0]:.1f}")
    if args.peer:
        peer_table(args.models, args.sizes, args.repeats, args.max_seconds)
    if args.scaling:
        scaling_table(args.scaling_sizes, args.scaling_widths, args.repeats, args.max_seconds)


if __name__ == "__main__":
    main()
