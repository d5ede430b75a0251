"""One ``linearize(model)`` forward (and forward + backward, a training step's work) against the plain model's, A/B in
one process on the benchmark models (benchmarks/_models.py).

Per case the table prints the median over rounds of the per-round ratio linearized / plain (the two calls of a
round run back to back, which goes first alternating, so both see the same moment of a shared machine), in CPU
time of this process with wall time beside it, and the activation memory autograd saves for backward in one
forward with gradients on (bytes of the tensors made by that forward and packed by ``saved_tensors_hooks``, each
storage counted once; parameters, θ0 and the input left out): the memory a training step holds beyond the
parameters. The issue's expectation is about 2x in memory (NOTE [nested jvp] in ntk_service/analysis/linearize.py);
in time the tangent of a layer y = W a costs two matmuls (ΔW·a and W·ȧ), so a forward is up to ~3 plain ones.
Each linearized output is checked against the plain one at θ0.

    .venv/bin/python benchmarks/bench_linearize.py                        # mlp, cnn, resnet at N = 64, 7 rounds
    .venv/bin/python benchmarks/bench_linearize.py --models mlp --n 8 --rounds 3
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
from torch import nn  # noqa: E402

from ntk_service.analysis import linearize  # noqa: E402


def _existing(module: nn.Module, x: torch.Tensor) -> set[int]:
    """Storages that exist before a forward: the input, parameters, buffers, and a linearization's θ0 / frozen
    tensors (private attributes, read here only to leave them out of the count)."""
    tensors = [x, *module.parameters(), *module.buffers()]
    for store in ("_lin_theta0", "_lin_frozen", "_lin_buffers"):
        tensors += list(getattr(module, store, {}).values())
    return {t.untyped_storage().data_ptr() for t in tensors}


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors made in one forward of ``module`` at ``x`` that autograd keeps for backward (each
    storage once; parameters, θ0 and the input are not counted: they exist anyway)."""
    before = _existing(module, x)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in before:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    del out
    return sum(seen.values())


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def _step(module: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> None:
        module.zero_grad(set_to_none=True)
        module(x).square().sum().backward()

    return run


def _forward(module: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> None:
        with torch.no_grad():
            module(x)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "resnet"], choices=sorted(MODELS))
    parser.add_argument("--n", type=int, default=64, help="batch size")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, N = {args.n}, {args.rounds} rounds")
    print("| model | P | forward: plain ms | linearized / plain (cpu) | (wall) | step: plain ms | linearized / plain "
          "(cpu) | (wall) | saved for backward: plain MB | linearized / plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model = MODELS[name]().eval()
        x = make_inputs(name, args.n)
        flin = linearize(model)
        with torch.no_grad():
            err = (flin(x) - model(x)).abs().max().item()
        assert err <= 1e-5, f"{name}: the linearization at θ0 differs from the model by {err}"
        row = [name, f"{sum(p.numel() for p in model.parameters()):,}"]
        for make in (_forward, _step):
            plain, lin = make(model, x), make(flin, x)
            plain(), lin()  # warm up
            ratios_cpu, ratios_wall, plain_ms = [], [], []
            for r in range(args.rounds):
                order = (plain, lin) if r % 2 == 0 else (lin, plain)
                times = {id(f): _timed(f) for f in order}
                (pc, pw), (lc, lw) = times[id(plain)], times[id(lin)]
                ratios_cpu.append(lc / pc)
                ratios_wall.append(lw / pw)
                plain_ms.append(pw * 1e3)
            row += [
                f"{statistics.median(plain_ms):.1f}",
                f"{statistics.median(ratios_cpu):.2f}",
                f"{statistics.median(ratios_wall):.2f}",
            ]
        plain_bytes, lin_bytes = _saved_bytes(model, x), _saved_bytes(flin, x)
        row += [f"{plain_bytes / 2**20:.1f}", f"{lin_bytes / plain_bytes:.2f}"]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
