"""The kernel of an exported model vs the same model as its ``nn.Module`` (issue 24), ``implementation="auto"`` both.

The structured engine's rules are keyed to ``nn.Module`` layers (``nn.Linear``, ``nn.Conv2d``, ...); the graph
module of ``ExportedProgram.module()`` calls ATen operators and has no such layers, so on it ``auto`` picks
``jacobian_contraction`` (or the vector products) where the module may get ``structured``. This times both, in one
process, rounds alternating module / exported so that drift on a shared machine hits both alike, and prints the
implementation ``auto`` chose for each, the median and the minimum time of each, the median of the per-round
ratios (each round's pair ran back to back) and the ratio of the minima (the runs least disturbed by other load).
The exported copy is loaded with the service's checked loader (``load_exported``) from ``torch.export.save``'s
bytes, as the server does. Both kernels are checked to agree.

    .venv/bin/python benchmarks/bench_exported_kernels.py                           # default sizes, 5 rounds
    .venv/bin/python benchmarks/bench_exported_kernels.py --n 8 --rounds 1 --width 16  # a small smoke run
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

from ntk_service.client._export import export_module  # noqa: E402
from ntk_service.kernels.api import compute_ntk  # noqa: E402
from ntk_service.registry.exported import load_exported  # noqa: E402
from tests.registry.exported_models import ConvBn, GatedLoop, ResidualMlp  # noqa: E402


def _models(width: int) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    return [
        (f"GatedLoop width {width} depth 3", GatedLoop(width=width, depth=3, classes=4).eval(), (width,)),
        ("ResidualMlp width 6 (LayerNorm, GELU)", ResidualMlp().eval(), (4,)),
        ("ConvBn (Conv2d, eval BatchNorm)", ConvBn().eval(), (2, 5, 5)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=32, help="Examples in x1 = x2. Default: 32.")
    parser.add_argument("--width", type=int, default=64, help="GatedLoop width. Default: 64.")
    parser.add_argument("--rounds", type=int, default=5, help="Timed rounds per model and side. Default: 5.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is steadier on a shared machine).")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export's own deprecation notices, per export

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, n = {args.n}, median of {args.rounds} rounds")
    head = "auto -> median / min"
    print(f"{'model':<38} {'module: ' + head:<38} {'exported: ' + head:<38} exported/module: paired / min")
    for label, module, shape in _models(args.width):
        program = load_exported(export_module(module, input_shape=shape, input_dtype="float32"), operation="bench")
        graph = program.module.eval()
        x = torch.randn(args.n, *shape, generator=torch.Generator().manual_seed(1))
        times: dict[str, list[float]] = {"module": [], "exported": []}
        chosen: dict[str, str] = {}
        thetas: dict[str, torch.Tensor] = {}
        compute_ntk(module, x), compute_ntk(graph, x)  # warm-up: first-call costs out of the rounds
        for _ in range(args.rounds):
            for side, model in (("module", module), ("exported", graph)):
                start = time.perf_counter()
                result = compute_ntk(model, x, implementation="auto")
                times[side].append(time.perf_counter() - start)
                chosen[side], thetas[side] = result.implementation.value, result.theta
        scale = thetas["module"].abs().max().item()
        error = (thetas["module"] - thetas["exported"]).abs().max().item() / scale
        assert error < 1e-4, f"{label}: the kernels differ by {error:.1e} of max|theta|"
        median = {side: statistics.median(values) for side, values in times.items()}
        paired = statistics.median(e / m for m, e in zip(times["module"], times["exported"], strict=True))
        best = {side: min(values) for side, values in times.items()}
        cells = [f"{chosen[s]:<20} {median[s] * 1e3:7.1f} / {best[s] * 1e3:6.1f} ms" for s in ("module", "exported")]
        ratios = f"{paired:6.2f}x / {best['exported'] / best['module']:5.2f}x"
        print(f"{label:<38} {cells[0]:<38} {cells[1]:<38} {ratios}")


if __name__ == "__main__":
    main()
