"""Two versions of the kernel engine in one process, alternating on the same models: an A/B of an engine change.

The base tree's ``ntk_service`` package is copied to a temporary directory as ``ntk_base`` (every import of
``ntk_service`` in its files rewritten), so both versions import side by side; each round runs the base engine's
``compute_ntk`` and this tree's on the same model and inputs, one after the other, and the median of the per-round
CPU-time ratios (user + system of this process) is the A/B. Both kernels are checked to agree. Models: the benchmark
MLP, CNN, ResNet and transformer (``_models.py``) and three researchers' classes (``GatedLoop`` of width 64,
``ResidualMlp`` of width 64, ``TinyAttention`` on (8, 16) sequences), N = M from ``--n`` per model.

    git worktree add /tmp/base <commit>      # or: git archive <commit> | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_engine_ab.py --base /tmp/base --rounds 7
    .venv/bin/python benchmarks/bench_engine_ab.py --base /tmp/base --models mlp resnet --modes trace --rounds 3
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE [OpenMP wait policy] in bench_structured.py

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT.parent), str(ROOT)]

import torch  # noqa: E402
from _models import MODELS, make_inputs  # noqa: E402
from torch import nn  # noqa: E402

from ntk_service.kernels import compute_ntk, retain_freed_memory  # noqa: E402
from tests.registry.exported_models import GatedLoop, ResidualMlp, TinyAttention  # noqa: E402

SIZES = {"mlp": 64, "cnn": 32, "resnet": 16, "transformer": 16, "gated_loop": 64, "residual_mlp": 64, "attention": 64}
"""Default N = M per model: a few hundred ms at most on the contended machine."""


def _base_engine(tree: Path, into: Path) -> Any:
    """The ``compute_ntk`` of ``tree``'s ntk_service, imported as ``ntk_base`` from a rewritten copy in ``into``."""
    copy = into / "ntk_base"
    shutil.copytree(tree / "ntk_service", copy)
    for path in copy.rglob("*.py"):
        path.write_text(path.read_text().replace("ntk_service", "ntk_base"))
    sys.path.insert(0, str(into))
    return importlib.import_module("ntk_base.kernels").compute_ntk


def _case(name: str, n: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    if name in MODELS:
        return MODELS[name](), make_inputs(name, n), make_inputs(name, n, seed=2)
    g = torch.Generator().manual_seed(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: nn.Module = {
            "gated_loop": lambda: GatedLoop(64, 3, 4),
            "residual_mlp": lambda: ResidualMlp(64, 2, 4),
            "attention": lambda: TinyAttention(16, 4),
        }[name]().eval()
    shape = {"gated_loop": (64,), "residual_mlp": (4,), "attention": (8, 16)}[name]
    return model, torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _ab(base: Callable[..., Any], name: str, n: int, mode: str, implementation: str, rounds: int) -> None:
    model, x1, x2 = _case(name, n)
    engines: dict[str, Callable[[], Any]] = {
        "base": lambda: base(model, x1, x2, mode=mode, implementation=implementation),
        "this": lambda: compute_ntk(model, x1, x2, mode=mode, implementation=implementation),
    }
    thetas = {key: call().theta for key, call in engines.items()}  # warm-up, and the kernels agree
    error = float((thetas["base"] - thetas["this"]).abs().max() / thetas["base"].abs().max())
    assert error < 1e-4, f"{name} {mode}: the engines differ by {error:.1e} of max|theta|"
    cpu: dict[str, list[float]] = {key: [] for key in engines}
    for _ in range(rounds):
        for key, call in engines.items():
            start = _cpu()
            call()
            cpu[key].append(_cpu() - start)
    ratio = statistics.median(b / a for a, b in zip(cpu["base"], cpu["this"], strict=True))
    print(f"| {name} N={n} {mode.upper()} | {statistics.median(cpu['base']):.4f} | "
          f"{statistics.median(cpu['this']):.4f} | {ratio:.3f} | {os.getloadavg()[0]:.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="The other source tree (a checkout's root).")
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--modes", nargs="+", default=["full", "trace"], choices=["full", "trace"])
    parser.add_argument("--implementation", default="structured", help="Default: structured.")
    parser.add_argument("--rounds", type=int, default=7, help="Timed rounds after one warm-up. Default: 7.")
    parser.add_argument("--n", type=int, default=None, help="N = M for every model. Default: SIZES per model.")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    retain_freed_memory()  # process-wide: both engines run under it
    with tempfile.TemporaryDirectory() as tmp:
        base = _base_engine(args.base.resolve(), Path(tmp))
        print(f"base {args.base} vs this tree, {args.implementation}, median of {args.rounds} alternating rounds")
        print("| case | base CPU s | this CPU s | this / base (paired median) | load |\n|---|---|---|---|---|")
        for name in args.models:
            for mode in args.modes:
                _ab(base, name, args.n or SIZES[name], mode, args.implementation, args.rounds)


if __name__ == "__main__":
    main()
