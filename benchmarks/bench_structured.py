"""Structured derivatives side by side with neural-tangents' STRUCTURED_DERIVATIVES, and the MLP scaling table.

Part 1 (``--peer``, default on): for each model × N (= M, x2 ≠ x1), the full kernel (N, M, k, k) in float32 by
our ``structured`` and ``auto`` and, in the same run, neural-tangents' jitted ``STRUCTURED_DERIVATIVES`` in
``.peer-venv`` (``make peer-venv``), kept running as a server process (``_peer.PeerSession``). After one warm-up
each (the peer compiles), single runs alternate — ours structured, the peer's, ours auto, the peer's — for
``--rounds`` rounds or ``--max-seconds``, so all three see the same moments of a noisy shared machine, and every
run follows one of the other library (a run right after one of its own finds its weights and code in the caches:
~5 % faster for ours on the MLP at N = 64). Prints medians and the ratios peer / ours (> 1: we are faster).

Part 2 (``--scaling``): the MLP (ReLU, biases, 784 inputs, two hidden layers of ``width``, 10 outputs) full
kernel, time vs N at width 512 and vs width at N = 256, for each implementation; a case whose estimated FLOPs
(the engine's own cost model) would take longer than ``--max-seconds`` at ``ASSUMED_FLOPS`` is skipped.

    .venv/bin/python benchmarks/bench_structured.py                          # part 1, mlp and cnn, N = 64, 256
    .venv/bin/python benchmarks/bench_structured.py --no-peer --scaling      # part 2 only
"""

from __future__ import annotations

import argparse
import functools
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
from _peer import PeerSession, PeerUnavailableError  # noqa: E402

from ntk_service.kernels import compute_ntk, retain_freed_memory  # noqa: E402
from ntk_service.kernels.choice import ALGORITHMS  # noqa: E402
from ntk_service.kernels.modes import KernelMode  # noqa: E402
from ntk_service.kernels.problem.preparation import prepare_problem  # noqa: E402
from ntk_service.kernels.problem.private_module import eval_semantics  # noqa: E402
from ntk_service.kernels.runtime.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES  # noqa: E402

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


def peer_table(models: list[str], sizes: list[int], rounds: int, max_seconds: float) -> None:
    """Alternate single runs: ours structured, the peer's, ours auto, the peer's, ``rounds`` times per case (see
    module doc)."""
    try:
        peer: PeerSession | None = PeerSession()
    except PeerUnavailableError as exc:
        print(f"(peer unavailable: {str(exc).splitlines()[0]})", file=sys.stderr)
        peer = None
    print(
        "| model | N = M | neural-tangents SD (s) | ours structured (s) | ours auto (s) | NT / structured "
        "| NT / auto | runs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    try:
        for name in models:
            model = MODELS[name]()
            for n in sizes:
                x1, x2 = make_inputs(name, n), make_inputs(name, n, seed=2)
                calls: dict[str, Callable[[], object]] = {
                    "structured": _ours(model, x1, x2, "structured"),
                    "auto": _ours(model, x1, x2, "auto"),
                }
                if peer is not None:
                    calls["peer"] = functools.partial(peer.time_once, name, n, "structured_derivatives")
                for call in calls.values():  # warm-up (the peer compiles here)
                    call()
                times: dict[str, list[float]] = {key: [] for key in calls}
                order = ["structured", "peer", "auto", "peer"] if peer is not None else ["structured", "auto"]
                while len(times["auto"]) < rounds and sum(map(sum, times.values())) < max_seconds:
                    for key in order:
                        start = time.perf_counter()
                        reported = calls[key]()
                        elapsed = time.perf_counter() - start
                        # the peer reports its own run time (without the pipe round trip)
                        times[key].append(float(reported) if key == "peer" else elapsed)  # type: ignore[arg-type]
                med = {key: statistics.median(values) for key, values in times.items()}
                chosen = calls["auto"]()
                peer_text = f"{med['peer']:.4f}" if "peer" in med else "n/a"
                ratios = (
                    (f"{med['peer'] / med['structured']:.2f}x", f"{med['peer'] / med['auto']:.2f}x")
                    if "peer" in med
                    else ("n/a", "n/a")
                )
                print(
                    f"| {name} | {n} | {peer_text} | {med['structured']:.4f} | {med['auto']:.4f} ({chosen}) | "
                    f"{ratios[0]} | {ratios[1]} | {len(times['auto'])} |",
                    flush=True,
                )
    finally:
        if peer is not None:
            peer.close()


def _mlp(width: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        ).eval()


def _estimated_seconds(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, implementation: str) -> float:
    if implementation == "auto":
        return 0.0
    alg = next(a for i, a in ALGORITHMS.items() if i.value == implementation)
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
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per scaling case")
    parser.add_argument("--rounds", type=int, default=30, help="alternating rounds per peer-table case")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="time cap per case")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--scaling", action="store_true")
    parser.add_argument("--scaling-sizes", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
    parser.add_argument("--scaling-widths", nargs="+", type=int, default=[256, 512, 1024, 2048])
    parser.add_argument(
        "--allocator",
        choices=["retain", "default"],
        default="retain",
        help="retain: glibc malloc keeps freed memory, as the server process does (NOTE [allocator]); the peer's "
        "process gets the same settings through MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_",
    )
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    if args.allocator == "retain":
        retain_freed_memory()
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)  # read by the peer's glibc at start
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(TRIM_THRESHOLD_BYTES)
    print(
        f"torch threads {THREADS}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, allocator {args.allocator} "
        f"(both sides), load {os.getloadavg()[0]:.1f}"
    )
    if args.peer:
        peer_table(args.models, args.sizes, args.rounds, args.max_seconds)
    if args.scaling:
        scaling_table(args.scaling_sizes, args.scaling_widths, args.repeats, args.max_seconds)


if __name__ == "__main__":
    main()
