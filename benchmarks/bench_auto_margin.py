"""Issue 37: AUTO against the torch.func tutorial's Jacobian contraction on ResNet and transformer *variants*
(eval BatchNorm and GroupNorm, widths, depths; transformer widths, depths, sequence lengths), as modules and as
exported programs, N = M = 16-128, FULL and TRACE — alternating in one process.

Per case the contenders run once per round, in turn: ``auto`` on the module, ``auto`` on the program (exported as
``Client.register_module`` does, loaded by the service's loader; ``--no-programs`` leaves it out), the tutorial on the
module (``torchfunc_tutorial.tutorial_ntk``), and with ``--calibrate`` ``structured`` and ``jacobian_contraction``
on the module (the implementations AUTO chooses between). Printed per case: median wall and CPU seconds (user +
system of this process), the tutorial's time over each (the paired median of the rounds' ratios: > 1, faster than
the tutorial), AUTO's pick and, with ``--calibrate``, each implementation's weighted estimate beside its time (AUTO's
choice is right where the cheapest estimate is the fastest). The summary lists tutorial / auto per case; the target
is >= 1.1 everywhere. The load average is printed beside each case.

    .venv/bin/python benchmarks/bench_auto_margin.py                                  # every variant, N = 16-128
    .venv/bin/python benchmarks/bench_auto_margin.py --variants resnet resnet_gn --sizes 16 32 --rounds 3
    .venv/bin/python benchmarks/bench_auto_margin.py --small --rounds 1 --calibrate   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE [OpenMP wait policy] in bench_structured.py

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT.parent), str(ROOT)]

import torch  # noqa: E402
from _models import ResNet, TransformerClassifier, randomize_batchnorm  # noqa: E402
from torch import nn  # noqa: E402
from torchfunc_tutorial import tutorial_ntk  # noqa: E402

from ntk_service.client._export import export_module  # noqa: E402
from ntk_service.kernels import KernelMode, compute_ntk, retain_freed_memory  # noqa: E402
from ntk_service.kernels.choice import weighted_costs  # noqa: E402
from ntk_service.kernels.runtime.problem_pool import prepared_problem  # noqa: E402
from ntk_service.registry.exported import load_exported  # noqa: E402

Variant = tuple[Callable[[], nn.Module], Callable[[int, int], torch.Tensor], tuple[int, ...], str]


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build()
    return randomize_batchnorm(model, torch.Generator().manual_seed(100)).eval()


def _images(size: int) -> Callable[[int, int], torch.Tensor]:
    return lambda n, seed: torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _tokens(length: int) -> Callable[[int, int], torch.Tensor]:
    return lambda n, seed: torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def variants(small: bool) -> dict[str, Variant]:
    """name -> (build, inputs (n, seed), one example's shape, its dtype)."""
    image = 8 if small else 32
    w = (4, 8) if small else None
    t = 8 if small else 32
    transformer: Callable[..., nn.Module] = TransformerClassifier
    return {
        "resnet": (lambda: _seeded(lambda: ResNet(widths=w or (16, 32, 64))), _images(image), (3, image, image),
                   "float32"),
        "resnet_gn": (lambda: _seeded(lambda: ResNet(widths=w or (16, 32, 64), norm="group")), _images(image),
                      (3, image, image), "float32"),
        "resnet_wide": (lambda: _seeded(lambda: ResNet(widths=w or (32, 64, 128))), _images(image),
                        (3, image, image), "float32"),
        "resnet_deep": (lambda: _seeded(lambda: ResNet(widths=w or (16, 32, 64), depth=2)), _images(image),
                        (3, image, image), "float32"),
        "transformer": (lambda: _seeded(lambda: transformer(max_len=t, d=16 if small else 128)), _tokens(t), (t,),
                        "int64"),
        "transformer_deep": (lambda: _seeded(lambda: transformer(max_len=t, d=16 if small else 64, heads=4,
                                                                 d_ff=64 if small else 256, layers=4)),
                             _tokens(t), (t,), "int64"),
        "transformer_long": (lambda: _seeded(lambda: transformer(max_len=2 * t, d=16 if small else 64, heads=4,
                                                                 d_ff=64 if small else 256)),
                             _tokens(2 * t), (2 * t,), "int64"),
    }  # fmt: skip


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_case(name: str, variant: Variant, n: int, mode: str, args: argparse.Namespace) -> dict[str, float]:
    build, inputs, shape, dtype = variant
    module = build()
    x1, x2 = inputs(n, 1), inputs(n, 2)
    contenders: dict[str, Callable[[], Any]] = {
        "auto": lambda: compute_ntk(module, x1, x2, mode=mode),
        "tutorial": lambda: tutorial_ntk(module, x1, x2, mode),
    }
    if args.programs:
        program = load_exported(export_module(module, input_shape=shape, input_dtype=dtype), operation="bench").module
        contenders["auto (exported)"] = lambda: compute_ntk(program, x1, x2, mode=mode)
    if args.calibrate:
        contenders["structured"] = lambda: compute_ntk(module, x1, x2, mode=mode, implementation="structured")
        contenders["jacobian_contraction"] = lambda: compute_ntk(
            module, x1, x2, mode=mode, implementation="jacobian_contraction"
        )
    results = {key: call() for key, call in contenders.items()}  # warm-up
    wall: dict[str, list[float]] = {key: [] for key in contenders}
    cpu: dict[str, list[float]] = {key: [] for key in contenders}
    for _ in range(args.rounds):
        for key, call in contenders.items():
            c, t = _cpu(), time.perf_counter()
            results[key] = call()
            wall[key].append(time.perf_counter() - t)
            cpu[key].append(_cpu() - c)
    expected = torch.as_tensor(results["tutorial"]).double()
    for key, result in results.items():
        error = float((torch.as_tensor(getattr(result, "theta", result)).double() - expected).abs().max())
        assert error <= 1e-3 * float(expected.abs().max()), f"{name}: {key} differs from the tutorial"
    costs: dict[str, float] = {}
    if args.calibrate:
        with prepared_problem(module, x1, x2, params=None, dtype=None) as prepared:
            costs = {i.value: c / 1e9 for i, c in weighted_costs(prepared.problem, n, n, KernelMode(mode)).items()}
    print(f"\n{name} N=M={n} {mode.upper()} (load {os.getloadavg()[0]:.1f})")
    print("| contender | ran | wall s | CPU s | tutorial / x (wall) | tutorial / x (CPU) | weighted est. GFLOP |")
    print("|---|---|---|---|---|---|---|")
    out = {}
    for key in contenders:
        ran = getattr(getattr(results[key], "implementation", None), "value", "")
        by_wall = statistics.median(a / b for a, b in zip(wall["tutorial"], wall[key], strict=True))
        by_cpu = statistics.median(a / b for a, b in zip(cpu["tutorial"], cpu[key], strict=True))
        estimate = f"{costs[key]:.2f}" if key in costs else ""
        print(f"| {key} | {ran} | {statistics.median(wall[key]):.3f} | {statistics.median(cpu[key]):.3f} | "
              f"{by_wall:.2f} | {by_cpu:.2f} | {estimate} |")  # fmt: skip
        out[key] = by_wall
        out[key + " cpu"] = by_cpu
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(variants(False)), choices=list(variants(False)))
    parser.add_argument("--sizes", nargs="+", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--modes", nargs="+", default=["full", "trace"], choices=["full", "trace"])
    parser.add_argument("--rounds", type=int, default=3, help="Timed rounds after one warm-up. Default: 3.")
    parser.add_argument("--calibrate", action="store_true", help="Also time structured and jacobian_contraction.")
    parser.add_argument("--no-programs", dest="programs", action="store_false", help="Skip the exported programs.")
    parser.add_argument("--small", action="store_true", help="Small models and inputs for a quick check.")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # torch.export's notices, SDPA's vmap fallback in the tutorial
    torch.set_num_threads(2)
    retain_freed_memory()  # as the server
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds per case")
    summary = []
    for name in args.variants:
        for n in args.sizes:
            for mode in args.modes:
                ratios = run_case(name, variants(args.small)[name], n, mode, args)
                summary.append((f"{name} N={n} {mode.upper()}", ratios))
    print("\nsummary: tutorial / auto, paired medians (target >= 1.1), wall (CPU)")
    print("| case | module | exported |\n|---|---|---|")
    for label, ratios in summary:
        exported = f"{ratios['auto (exported)']:.2f} ({ratios['auto (exported) cpu']:.2f})" if args.programs else "-"
        print(f"| {label} | {ratios['auto']:.2f} ({ratios['auto cpu']:.2f}) | {exported} |")


if __name__ == "__main__":
    main()
