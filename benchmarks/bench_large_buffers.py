"""Issue 31's in-process A/Bs: glibc's fresh mappings against ``reuse_large_buffers``, and the Jacobian side kept
as its chunks against chunks copied into one tensor per parameter (the build before issue 31), beside the
torch.func tutorial, all alternating in one process.

The allocator is process-wide, so it is toggled between rounds with ``mallopt`` (``M_MMAP_MAX``,
``M_TRIM_THRESHOLD``) and ``malloc_trim(0)``; each contender is warmed by one call under each setting before the
measured call. Per contender and setting: the medians of wall, user and system seconds and minor page faults per
call (``resource.getrusage``); on a shared machine user s, system s and faults are the figures to read.

    .venv/bin/python benchmarks/bench_large_buffers.py --model transformer --n 64 --mode trace --copied-chunk 32
    .venv/bin/python benchmarks/bench_large_buffers.py --model resnet --n 128 --mode trace --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE [OpenMP wait policy] in bench_structured.py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402
from _models import MODELS, make_inputs  # noqa: E402
from torchfunc_tutorial import tutorial_ntk  # noqa: E402

from ntk_service.kernels import compute_ntk, retain_freed_memory  # noqa: E402
from ntk_service.kernels.jacobian_contraction import JacobianContraction, jacobians  # noqa: E402
from ntk_service.kernels.modes import KernelMode  # noqa: E402
from ntk_service.kernels.runtime.allocator import TRIM_THRESHOLD_BYTES  # noqa: E402
from ntk_service.kernels.runtime.problem_pool import prepared_problem  # noqa: E402

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc malloc.h
_GLIBC_MMAP_MAX = 65536  # glibc's default M_MMAP_MAX


def _settings() -> dict[str, Callable[[], None]]:
    """Allocator setting name -> a function that puts the process's malloc into it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))

    def fresh() -> None:
        libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        libc.malloc_trim(0)

    def reuse() -> None:
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, -1)

    return {"fresh mappings": fresh, "reuse_large_buffers": reuse}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer", choices=sorted(MODELS))
    parser.add_argument("--n", type=int, default=64, help="N = M")
    parser.add_argument("--mode", default="trace", choices=["full", "trace"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--copied-chunk", type=int, help="also time sides built in chunks of this many, copied")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("bench_large_buffers: glibc's malloc only (Linux)")
    torch.set_num_threads(2)
    retain_freed_memory()
    model = MODELS[args.model]()
    x1, x2 = make_inputs(args.model, args.n), make_inputs(args.model, args.n, seed=2)
    mode, alg = KernelMode(args.mode), JacobianContraction()

    def copied(chunk: int) -> torch.Tensor:
        with prepared_problem(model, x1, x2, params=None, dtype=None) as prepared, torch.no_grad():
            left = jacobians(prepared.problem, prepared.x1, chunk=chunk)  # chunks concatenated: one copy
            right = jacobians(prepared.problem, prepared.x2, chunk=chunk)
            return alg.pair(prepared.problem, left, right, mode).contiguous()

    calls: dict[str, Callable[[], object]] = {
        "tutorial": lambda: tutorial_ntk(model, x1, x2, args.mode),
        "auto": lambda: compute_ntk(model, x1, x2, mode=args.mode),
    }
    if args.copied_chunk:
        calls[f"chunks of {args.copied_chunk}, copied"] = lambda: copied(args.copied_chunk)
    stats: dict[tuple[str, str], list[tuple[float, float, float, int]]] = {}
    for _ in range(args.rounds):
        for setting, apply in _settings().items():
            apply()
            for name, call in calls.items():
                call()  # warm under this setting: the buffers a reused heap would hand to the next call
                before = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                call()
                wall = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_SELF)
                stats.setdefault((setting, name), []).append(
                    (
                        wall,
                        after.ru_utime - before.ru_utime,
                        after.ru_stime - before.ru_stime,
                        after.ru_minflt - before.ru_minflt,
                    )
                )
    print(
        f"{args.model} N=M={args.n} {args.mode}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds, load {os.getloadavg()[0]:.1f}"
    )
    print("| allocator | contender | wall s | user s | system s | minor faults |\n|---|---|---|---|---|---|")
    for (setting, name), runs in stats.items():
        wall, user, system, faults = (statistics.median(r[i] for r in runs) for i in range(4))
        print(f"| {setting} | {name} | {wall:.3f} | {user:.2f} | {system:.2f} | {faults:.0f} |", flush=True)


if __name__ == "__main__":
    main()
