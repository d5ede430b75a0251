"""Time and peak memory of every implementation × mode, side by side with the torch.func tutorial's contraction.

Each case runs in its own subprocess (clean peak-RSS accounting) under an address-space limit (``--memory-gib``):
our engine gets that limit as its memory budget and chunks to fit; the tutorial's unchunked contraction has no
budget and fails where it does not fit. Times are medians of ``--repeats`` runs after one warm-up; peak memory is
the growth of the peak RSS over the process's RSS once the model and inputs exist.

    .venv/bin/python benchmarks/bench_kernels.py                       # the README table
    .venv/bin/python benchmarks/bench_kernels.py --models mlp --sizes 64 --modes full
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TUTORIAL = "tutorial"
IMPLEMENTATIONS = ["jacobian_contraction", "ntk_vector_products", "structured", "auto", TUTORIAL]
MODES = ["full", "trace", "output_diagonal", "example_diagonal"]
SLOW_CASE_S = 10.0
"""A case whose first run takes longer is timed by that run alone (warm-up effects are lost in it)."""
_TUTORIAL_COMPUTE = {"full": "full", "trace": "trace", "output_diagonal": "diagonal"}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_case(model_name: str, n: int, implementation: str, mode: str, repeats: int, budget: int) -> dict:
    """Runs in the child process: returns the measurements of one case."""
    import torch

    from benchmarks._models import MODELS, make_inputs
    from benchmarks.torchfunc_tutorial import tutorial_ntk
    from ntk_service.kernels import compute_ntk, retain_freed_memory

    torch.set_num_threads(2)
    retain_freed_memory()  # as the server process does, for every column alike (NOTE [allocator])
    model = MODELS[model_name]()
    x1, x2 = make_inputs(model_name, n), make_inputs(model_name, n, seed=2)
    base = _rss_bytes()
    if implementation == TUTORIAL:

        def call() -> str:
            tutorial_ntk(model, x1, x2, _TUTORIAL_COMPUTE[mode])
            return TUTORIAL
    else:

        def call() -> str:
            result = compute_ntk(model, x1, x2, mode=mode, implementation=implementation, memory_budget_bytes=budget)
            return result.implementation.value

    start = time.perf_counter()
    ran = call()
    times = [time.perf_counter() - start]
    if times[0] < SLOW_CASE_S:  # the warm-up run counts only for slow cases, where one-time costs are noise
        times.clear()
    for _ in range(repeats if not times else 0):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": statistics.median(times), "peak_bytes": max(peak - base, 0), "ran": ran}


def _child(args: argparse.Namespace) -> None:
    limit = int(args.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit + 3 * 2**30, limit + 3 * 2**30))  # + the runtime's own mappings
    try:
        out = run_case(args.model, args.n, args.implementation, args.mode, args.repeats, int(limit * 0.75))
    except (MemoryError, RuntimeError) as exc:
        out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    except Exception as exc:  # a refusal by our engine (MemoryEstimateExceeded) or an unavailable implementation
        out = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    print(json.dumps(out))


def _spawn(model: str, n: int, impl: str, mode: str, repeats: int, memory_gib: float, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--n", str(n), "--implementation", impl,
           "--mode", mode, "--repeats", str(repeats), "--memory-gib", str(memory_gib)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:100]}"}
    return json.loads(lines[-1])


def _peer_seconds(models: list[str], sizes: list[int], repeats: int) -> dict[tuple[str, int], float]:
    """neural-tangents STRUCTURED_DERIVATIVES (jitted JAX) full-kernel seconds, from ``.peer-venv``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _peer import PeerUnavailableError, run_peer

    try:
        rows = run_peer(models, sizes, ["structured_derivatives"], repeats=repeats)
    except PeerUnavailableError as exc:
        print(f"# neural-tangents peer not run: {str(exc).splitlines()[0]}")
        return {}
    return {(r["model"], r["n"]): r["seconds"] for r in rows if r.get("seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--implementations", nargs="+", default=IMPLEMENTATIONS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-gib", type=float, default=8.0, help="address-space limit and engine budget")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    parser.add_argument("--no-peer", action="store_true", help="skip the neural-tangents column")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--implementation", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    peer = {} if args.no_peer or "full" not in args.modes else _peer_seconds(args.models, args.sizes, args.repeats)
    print(f"# N = M, float32, 2 threads, memory limit {args.memory_gib} GiB")
    print("# vs tutorial = torch.func tutorial time / ours; vs NT SD = neural-tangents structured time / ours (full)")
    header = f"| model | N | mode | {'implementation':22} | time (s) | peak MiB | vs tutorial | vs NT SD | ran |"
    print(header)
    print("|" + "|".join("---" for _ in range(header.count("|") - 1)) + "|")
    for model in args.models:
        for n in args.sizes:
            for mode in args.modes:
                impls = [i for i in args.implementations if i != TUTORIAL or mode in _TUTORIAL_COMPUTE]
                rows = {i: _spawn(model, n, i, mode, args.repeats, args.memory_gib, args.timeout) for i in impls}
                tutorial = rows.get(TUTORIAL, {}).get("seconds")
                nt = peer.get((model, n)) if mode == "full" else None
                if nt is not None:
                    rows["neural-tangents SD"] = {"seconds": nt, "peak_bytes": None, "ran": "jax (peer venv)"}
                for impl, row in rows.items():
                    if "error" in row:
                        print(f"| {model} | {n} | {mode} | {impl:22} | - | - | - | - | {row['error']} |", flush=True)
                        continue
                    vs_tutorial = f"{tutorial / row['seconds']:.2f}x" if tutorial else "-"
                    vs_nt = f"{nt / row['seconds']:.2f}x" if nt else "-"
                    peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.0f}"
                    print(
                        f"| {model} | {n} | {mode} | {impl:22} | {row['seconds']:.4f} | {peak} | {vs_tutorial} | "
                        f"{vs_nt} | {row['ran']} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
