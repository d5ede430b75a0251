"""Two (or more) source trees of ntk-service side by side with neural-tangents, alternating in one run.

A change to the engine that saves a few percent is invisible between two runs of ``bench_structured.py`` on a
shared machine (±20–30 % drift). Here each tree runs in its own long-lived process (``--serve-tree``, one timed
``compute_ntk`` per request) and single runs alternate — tree A, the peer, tree B, the peer, … — so all see the
same moments and every run follows one of the other library's. Prints medians and NT / tree. Check out the
baseline with ``git worktree add /tmp/base <commit>``.

    .venv/bin/python benchmarks/bench_trees_ab.py base=/tmp/base new=. --model mlp --n 64 --rounds 60
    .venv/bin/python benchmarks/bench_trees_ab.py a=. b=.:GOMP_SPINCOUNT=10000   # same tree, another env
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# as in bench_structured.py (NOTE [OpenMP wait policy] there): before torch loads libgomp
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent
THREADS = 2


def serve_tree(tree: str) -> None:
    """Answer ``MODEL N IMPLEMENTATION`` lines with one timed ``compute_ntk`` of ``tree``'s engine each."""
    sys.path[:0] = [str(Path(tree).resolve()), str(Path(tree).resolve() / "benchmarks")]
    import torch
    from _models import MODELS, make_inputs

    from ntk_service.kernels import compute_ntk, retain_freed_memory

    torch.set_num_threads(THREADS)
    retain_freed_memory()
    cases: dict[tuple[str, int], tuple[object, torch.Tensor, torch.Tensor]] = {}
    for line in sys.stdin:
        name, n_text, implementation = line.split()
        key = (name, int(n_text))
        if key not in cases:
            cases[key] = (MODELS[name](), make_inputs(name, key[1]), make_inputs(name, key[1], seed=2))
            compute_ntk(*cases[key], implementation=implementation)  # type: ignore[arg-type]
        start = time.perf_counter()
        compute_ntk(*cases[key], implementation=implementation)  # type: ignore[arg-type]
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def _start(spec: str) -> tuple[str, subprocess.Popen[str]]:
    """``NAME=TREE[:VAR=VALUE,...]``: a server process for TREE with extra environment (VAR= unsets VAR)."""
    sys.path[:0] = [str(ROOT.parent)]
    from ntk_service.kernels.runtime.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES

    name, _, rest = spec.partition("=")
    tree, _, extra = rest.partition(":")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES))
    env["MALLOC_TRIM_THRESHOLD_"] = str(TRIM_THRESHOLD_BYTES)
    for item in filter(None, extra.split(",")):
        var, _, value = item.partition("=")
        if value:
            env[var] = value
        else:
            env.pop(var, None)
    command = [sys.executable, __file__, "--serve-tree", tree]
    return name, subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", help="NAME=TREE[:VAR=VALUE,...]")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--implementation", default="auto")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--serve-tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_tree:
        serve_tree(args.serve_tree)
        return
    if not args.trees:
        parser.error("give at least one NAME=TREE")
    sys.path.insert(0, str(ROOT))
    from _peer import PeerSession

    servers = dict(_start(spec) for spec in args.trees)
    request = f"{args.model} {args.n} {args.implementation}\n"

    def ours(server: subprocess.Popen[str]) -> float:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(request)
        server.stdin.flush()
        return float(json.loads(server.stdout.readline())["seconds"])

    times: dict[str, list[float]] = {name: [] for name in [*servers, "peer"]}
    try:
        with PeerSession() as peer:
            peer.time_once(args.model, args.n, "structured_derivatives")  # compiles
            for server in servers.values():
                ours(server)  # prepares and warms up
            for r in range(args.rounds):
                order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
                for name, server in order:
                    times[name].append(ours(server))
                    times["peer"].append(peer.time_once(args.model, args.n, "structured_derivatives"))
    finally:
        for server in servers.values():
            if server.stdin is not None:
                server.stdin.close()
            server.wait(timeout=60)
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.model} N = M = {args.n}, {args.implementation}, {args.rounds} rounds (medians)")
    for name in servers:
        print(f"  {name}: {med[name] * 1e3:.2f} ms, NT / {name} {med['peer'] / med[name]:.3f}x")
    print(f"  neural-tangents SD: {med['peer'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
