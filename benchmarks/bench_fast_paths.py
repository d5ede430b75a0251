"""Each fast path of the structured engine A/B'd in one process: the default ``StructuredOptions`` against the same
options with that one path switched off, alternating call by call, on the benchmark MLP, CNN, ResNet and
transformer (benchmarks/_models.py) at small N.

Every call is compute_ntk's pipeline (the kept prepared problem, the block plan, the block runner) with
``Structured(options)`` as the algorithm, so the plan of each option set is made once and kept on the problem. Per
case and path the table prints the median of the per-round ratios off/on (the two calls of a round run back to
back, which goes first alternating, so both see the same moment of a shared machine), in CPU time of this process
(less sensitive to other processes than wall time, which is printed beside it): above 1, the path pays; about 1,
it does not apply to that case or buys nothing there; the "(none: on vs on)" row is the run's noise floor. Each
off kernel is checked against the default one.

    .venv/bin/python benchmarks/bench_fast_paths.py                          # every path, every case, 5 rounds
    .venv/bin/python benchmarks/bench_fast_paths.py --rounds 9 --cases mlp-full-64 cnn-full-16
    .venv/bin/python benchmarks/bench_fast_paths.py --paths chain fold_bias
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402
from _models import MODELS, make_inputs  # noqa: E402

from ntk_service.kernels import KernelMode  # noqa: E402
from ntk_service.kernels.blocks import run_blocks  # noqa: E402
from ntk_service.kernels.planning import plan_blocks  # noqa: E402
from ntk_service.kernels.runtime.device import device_memory_budget  # noqa: E402
from ntk_service.kernels.runtime.problem_pool import prepared_problem  # noqa: E402
from ntk_service.kernels.structured import FAST_PATHS, Structured, StructuredOptions  # noqa: E402

CASES: dict[str, tuple[str, KernelMode, int, bool]] = {
    # name: model, mode, N = M, x2 given (False: x2 = x1, where the symmetric split can apply)
    "mlp-full-64": ("mlp", KernelMode.FULL, 64, True),
    "mlp-trace-64": ("mlp", KernelMode.TRACE, 64, True),
    "mlp-full-256-sym": ("mlp", KernelMode.FULL, 256, False),
    "cnn-full-16": ("cnn", KernelMode.FULL, 16, True),
    "cnn-trace-16": ("cnn", KernelMode.TRACE, 16, True),
    "resnet-full-8": ("resnet", KernelMode.FULL, 8, True),
    "transformer-full-8": ("transformer", KernelMode.FULL, 8, True),
}
"""Small cases of the four benchmark models; N = M."""


NULL = "(none: on vs on)"
"""A row that A/Bs the default options with an equal copy of themselves: the noise floor of the run."""


def _kernel(
    model: torch.nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, mode: KernelMode
) -> Callable[[StructuredOptions], torch.Tensor]:
    """compute_ntk's pipeline for these inputs, the algorithm ``Structured(options)``."""

    def run(options: StructuredOptions) -> torch.Tensor:
        alg = Structured(options)
        with prepared_problem(model, x1, x2, params=None, dtype=None) as prepared:
            problem, a, b = prepared.problem, prepared.x1, prepared.x2
            n = a.shape[0]
            m = n if b is None else b.shape[0]
            budget = device_memory_budget(torch.device("cpu"))
            plan = plan_blocks(alg, problem, n, m, mode, symmetric=b is None, budget_bytes=budget)
            with torch.no_grad():
                return run_blocks(alg, problem, a, b, mode, plan)

    return run


def _timed(kernel: Callable[[StructuredOptions], torch.Tensor], options: StructuredOptions) -> tuple[float, float]:
    """(wall, CPU) seconds of one kernel; CPU time (this process, all threads) counts only the time the kernel ran,
    not the time other processes held the cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    kernel(options)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--paths", nargs="+", default=list(FAST_PATHS), choices=list(FAST_PATHS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    on = StructuredOptions()
    ratios: dict[str, dict[str, float]] = {}
    for case in args.cases:
        name, mode, n, given = CASES[case]
        model = MODELS[name]()
        x1 = make_inputs(name, n)
        x2 = make_inputs(name, n, seed=2) if given else None
        kernel = _kernel(model, x1, x2, mode)
        base = kernel(on)  # warm-up, and the plan of the default options
        ratios[case] = {}
        for path in [NULL, *args.paths]:
            off = StructuredOptions() if path == NULL else on.without(path)
            theta = kernel(off)  # warm-up of this option set
            same = torch.allclose(theta, base, rtol=1e-4, atol=1e-5 * float(base.abs().max()))
            assert same, f"{case}: the kernel with {path} off differs from the default"
            wall_ratios, cpu_ratios, cpu_on = [], [], []
            for r in range(args.rounds):
                first, second = (on, off) if r % 2 == 0 else (off, on)  # alternate which goes first
                t_first, t_second = _timed(kernel, first), _timed(kernel, second)
                t_on, t_off = (t_first, t_second) if first is on else (t_second, t_first)
                wall_ratios.append(t_off[0] / t_on[0])
                cpu_ratios.append(t_off[1] / t_on[1])
                cpu_on.append(t_on[1])
            ratios[case][path] = statistics.median(cpu_ratios)
            print(
                f"{case:20s} {path:26s} on {1e3 * statistics.median(cpu_on):8.1f} CPU ms  off/on CPU "
                f"{ratios[case][path]:.3f}  wall {statistics.median(wall_ratios):.3f}",
                flush=True,
            )
    print()
    print("| fast path | " + " | ".join(args.cases) + " |")
    print("|---|" + "---|" * len(args.cases))
    for path in [NULL, *args.paths]:
        cells = [f"{ratios[c][path]:.2f}" for c in args.cases]
        print(f"| {path} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
