"""The ResNet and the transformer (benchmarks/_models.py) side by side: our ``auto``, ``structured`` and
``jacobian_contraction`` against the torch.func tutorial's Jacobian contraction, FULL and TRACE, float32.

Time: every contender of a case runs once per round, in turn (round-robin), for many rounds in this one process,
so all see the same moments of a shared machine; medians, and each contender's ratio to the tutorial. A 2048²
float32 matmul joins the rounds as the machine's matmul rate at that moment (the "peak" the GFLOP/s compare with).
GFLOP/s count the Jacobian-contraction work of the case, (N + M)·[FP]·(1 + 2k) + 2·N·M·k²·P (FULL; k·P for
TRACE), with [FP] the forward FLOPs of one example counted by the engine, the same numerator for every contender.

CPU s: the process's user + system time over the call (less sensitive to other processes than wall time).
Memory: each contender once more in its own fresh process (``--memory``): the growth of the peak RSS over that
one call, after the model and inputs are built.

    .venv/bin/python benchmarks/bench_real_models.py                       # N = M = 32, 9 rounds, memory
    .venv/bin/python benchmarks/bench_real_models.py --sizes 32 128 --rounds 5 --models resnet
    .venv/bin/python benchmarks/bench_real_models.py --contenders auto tutorial --no-memory
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402
from _models import MODELS, make_inputs  # noqa: E402
from torchfunc_tutorial import tutorial_ntk  # noqa: E402

from ntk_service.kernels import compute_ntk, retain_freed_memory  # noqa: E402
from ntk_service.kernels.problem_pool import prepared_problem  # noqa: E402

CONTENDERS = ("auto", "structured", "jacobian_contraction", "tutorial")
MATMUL = 2048


def _call(contender: str, model: torch.nn.Module, x1: torch.Tensor, x2: torch.Tensor, mode: str) -> str:
    """Run one contender once; returns what ran (the implementation AUTO picked, or the contender)."""
    if contender == "tutorial":
        tutorial_ntk(model, x1, x2, mode)
        return contender
    return compute_ntk(model, x1, x2, mode=mode, implementation=contender).implementation.value


def _work_flops(model: torch.nn.Module, x1: torch.Tensor, x2: torch.Tensor, mode: str) -> float:
    with prepared_problem(model, x1[:1], None, params=None, dtype=None) as prepared:
        problem = prepared.problem
        fp, k, p = problem.forward_flops, problem.k, problem.num_params
    n, m = x1.shape[0], x2.shape[0]
    contraction = 2.0 * n * m * k * p * (k if mode == "full" else 1)
    return (n + m) * fp * (1 + 2 * k) + contraction


def _high_water_kib() -> int:
    """This process's peak RSS (VmHWM, KiB). Not ``ru_maxrss``: Linux carries that over fork and exec, so a child
    of a large process would start at its parent's peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _memory(name: str, n: int, mode: str, contender: str) -> float:
    """Peak-RSS growth (MiB) of one call in a fresh process."""
    code = "\n".join(
        [
            f"import sys, json, resource; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT.parent)!r}]",
            "import torch; torch.set_num_threads(2)",
            "from bench_real_models import _call",
            "from _models import MODELS, make_inputs",
            f"model = MODELS[{name!r}](); x1, x2 = make_inputs({name!r}, {n}), make_inputs({name!r}, {n}, seed=2)",
            "from bench_real_models import _high_water_kib",
            "base = _high_water_kib()",
            f"_call({contender!r}, model, x1, x2, {mode!r})",
            "print(json.dumps((_high_water_kib() - base) / 1024))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def memory_case(name: str, n: int, mode: str, contenders: list[str]) -> None:
    print(f"\n{name} N=M={n} {mode}: peak RSS growth of one call in a fresh process")
    for c in contenders:
        print(f"  {c:<28} {_memory(name, n, mode, c):7.0f} MiB")


def bench_case(name: str, n: int, mode: str, contenders: list[str], rounds: int, memory: bool) -> None:
    model = MODELS[name]()
    x1, x2 = make_inputs(name, n), make_inputs(name, n, seed=2)
    flops = _work_flops(model, x1, x2, mode)
    a = torch.randn(MATMUL, MATMUL)
    calls: dict[str, Callable[[], str]] = {c: (lambda c=c: _call(c, model, x1, x2, mode)) for c in contenders}
    calls["matmul"] = lambda: str(float((a @ a)[0, 0]))
    ran = {c: call() for c, call in calls.items()}  # warm-up (and what AUTO picks)
    times: dict[str, list[float]] = {c: [] for c in calls}
    faults: dict[str, list[float]] = {c: [] for c in calls}
    cpu: dict[str, list[float]] = {c: [] for c in calls}
    for _ in range(rounds):
        for c, call in calls.items():
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            call()
            times[c].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults[c].append(after.ru_minflt - before.ru_minflt)
            cpu[c].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    peak_rate = 2.0 * MATMUL**3 / statistics.median(times["matmul"])
    tutorial = statistics.median(times["tutorial"]) if "tutorial" in times else None
    print(
        f"\n{name} N=M={n} {mode}: work {flops / 1e9:.1f} GFLOP, matmul rate now "
        f"{peak_rate / 1e9:.0f} GFLOP/s ({MATMUL}², median of {rounds})"
    )
    print(
        f"  {'contender':<28} {'median s':>9} {'tutorial/x':>10} {'GFLOP/s':>8} {'% peak':>7} {'CPU s':>6} "
        f"{'faults':>8} {'MiB':>7}"
    )
    for c in contenders:
        t = statistics.median(times[c])
        ratio = f"{tutorial / t:10.2f}" if tutorial is not None else f"{'':>10}"
        mib = f"{_memory(name, n, mode, c):7.0f}" if memory else f"{'':>7}"
        label = c if ran[c] == c else f"{c} ({ran[c]})"
        rate = flops / t
        print(
            f"  {label:<28} {t:9.3f} {ratio} {rate / 1e9:8.0f} {100 * rate / peak_rate:6.0f}% "
            f"{statistics.median(cpu[c]):6.2f} {statistics.median(faults[c]):8.0f} {mib}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet", "transformer"], choices=["resnet", "transformer"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[32])
    parser.add_argument("--modes", nargs="+", default=["full", "trace"], choices=["full", "trace"])
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--memory-only", action="store_true", help="only the fresh-process peak memory")
    args = parser.parse_args()
    torch.set_num_threads(2)
    retain_freed_memory()  # as the server does
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, round-robin in one process")
    for name in args.models:
        for n in args.sizes:
            for mode in args.modes:
                if args.memory_only:
                    memory_case(name, n, mode, args.contenders)
                else:
                    bench_case(name, n, mode, args.contenders, args.rounds, args.memory)


if __name__ == "__main__":
    main()
