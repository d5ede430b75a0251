"""The kernel family beside compute_ntk, measured side by side in one run.

Sections (``--section``, default all):

- ``mc``: ``monte_carlo_ntk`` of 16 models as batched ensemble calls (NOTE [batched ensemble]) against a loop of
  16 ``compute_ntk`` calls on the same models (the loop's mean is checked equal to the ensemble's).
- ``operator``: ``ntk_operator`` time per product and peak memory against building the FULL kernel with
  ``compute_ntk``, at an N where FULL fits the budget and at one where it does not (there ``compute_ntk`` refuses
  up front with its estimate). Each case runs in its own subprocess; peak memory is the growth of the peak RSS
  (VmHWM) over the RSS once the model and inputs exist.
- ``groups``: ``compute_ntk_groups(groups="modules")`` (one pass, 3 groups) against one ``compute_ntk`` per group
  (``params=`` the group's parameters) and against one plain kernel of all parameters, on the benchmark MLP and
  CNN (benchmarks/_models.py), per implementation, medians of alternated rounds (target: grouped <= 1.2x single).
- ``limit``: the Monte Carlo NTK and NNGP of a one-hidden-layer ReLU net in NTK parameterization against the
  closed-form arc-cosine kernels, relative Frobenius error by width and samples (the docs/kernel_family.md table).

    .venv/bin/python benchmarks/bench_kernel_family.py
    .venv/bin/python benchmarks/bench_kernel_family.py --section operator --budget-mib 256
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._models import make_cnn, make_inputs, make_mlp  # noqa: E402
from ntk_service.errors import MemoryEstimateExceeded  # noqa: E402
from ntk_service.kernels import compute_ntk, compute_ntk_groups, monte_carlo_ntk, ntk_operator  # noqa: E402


def _median_time(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- mc ---------------------------------------------------------------------------------------------------------
def _mc_medium(seed: int) -> nn.Module:
    """MLP 32-128-128-10, P = 22,026."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _mc_small(seed: int) -> nn.Module:
    """MLP 8-64-1, P = 641: per-call overhead, not FLOPs, is the cost."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))


def section_mc(repeats: int) -> None:
    seeds = list(range(16))
    print("## monte_carlo_ntk of 16 models vs a loop of 16 compute_ntk (AUTO), N = 16, float32")
    print("| model | mode | batched ensemble (s) | loop of 16 compute_ntk (s) | loop / batched |")
    print("|---|---|---:|---:|---:|")
    for build, d in ((_mc_small, 8), (_mc_medium, 32)):
        x = torch.randn(16, d, generator=torch.Generator().manual_seed(1))
        for mode in ("full", "trace"):

            def batched(mode: str = mode, build: object = build, x: torch.Tensor = x) -> torch.Tensor:
                return monte_carlo_ntk(build, x, seeds=seeds, mode=mode).mean  # type: ignore[arg-type]

            def loop(mode: str = mode, build: object = build, x: torch.Tensor = x) -> torch.Tensor:
                models = [build(s) for s in seeds]  # type: ignore[operator]
                return sum(compute_ntk(m, x, mode=mode).theta for m in models) / len(models)  # type: ignore[return-value]

            mean_b, mean_l = batched(), loop()  # warm-up, and the two agree
            assert float((mean_b - mean_l).abs().max()) <= 1e-4 * float(mean_l.abs().max())
            times_b, times_l = [], []
            for _ in range(repeats):  # alternated, so contention hits both alike
                times_b.append(_median_time(batched, 1))
                times_l.append(_median_time(loop, 1))
            tb, tl = statistics.median(times_b), statistics.median(times_l)
            print(f"| {(build.__doc__ or '').split(',')[0]} | {mode} | {tb:.3f} | {tl:.3f} | {tl / tb:.2f} |")


# --- operator ---------------------------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def run_operator_case(what: str, n: int, budget: int, repeats: int) -> dict:  # type: ignore[type-arg]
    """In the child: one case, time and peak-RSS growth."""
    from benchmarks._models import make_inputs, make_mlp

    torch.set_num_threads(2)
    model = make_mlp()
    x = make_inputs("mlp", n)
    base = _rss()
    if what == "full":
        try:
            start = time.perf_counter()
            result = compute_ntk(model, x, mode="full", memory_budget_bytes=budget)
            seconds = time.perf_counter() - start
        except MemoryEstimateExceeded as exc:
            return {"refused": True, "estimate": exc.estimate_bytes}
        return {"seconds": seconds, "peak": _hwm() - base, "impl": result.implementation.value}
    op = ntk_operator(model, x, memory_budget_bytes=budget)
    v = torch.randn(n, 10)
    op.matvec(v)  # warm-up
    seconds = _median_time(lambda: op.matvec(v), repeats)
    return {"seconds": seconds, "peak": _hwm() - base, "chunk": op.examples_per_chunk}


def _child(what: str, n: int, budget: int, repeats: int) -> dict:  # type: ignore[type-arg]
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
        "from benchmarks.bench_kernel_family import run_operator_case; "
        f"print(json.dumps(run_operator_case({what!r}, {n}, {budget}, {repeats})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def section_operator(budget_mib: int, sizes: list[int], repeats: int) -> None:
    budget = budget_mib * 2**20
    print(
        f"## ntk_operator vs FULL compute_ntk: MLP 784-512-512-10 (P = 669,706, k = 10), float32, "
        f"budget {budget_mib} MiB"
    )
    print("| N | FULL kernel size | compute_ntk FULL | its peak | operator s / product | its peak |")
    print("|---:|---:|---|---:|---:|---:|")
    for n in sizes:
        full = _child("full", n, budget, repeats)
        op = _child("operator", n, budget, repeats)
        size = n * n * 100 * 4 / 2**20
        if full.get("refused"):
            full_cell, full_peak = f"refused (estimate {full['estimate'] / 2**20:.0f} MiB)", "-"
        else:
            full_cell, full_peak = f"{full['seconds']:.2f} s ({full['impl']})", f"{full['peak'] / 2**20:.0f} MiB"
        print(
            f"| {n} | {size:.0f} MiB | {full_cell} | {full_peak} | {op['seconds']:.3f} (chunk {op['chunk']}) | "
            f"{op['peak'] / 2**20:.0f} MiB |"
        )


# --- limit ------------------------------------------------------------------------------------------------------
class NtkReluNet(nn.Module):
    """f(x) = v · relu(W x / √d) / √m, W (m, d), v (m,) ~ N(0, 1), no bias (NTK parameterization)."""

    def __init__(self, d: int, m: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(m, d))
        self.v = nn.Parameter(torch.randn(1, m))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w.T / math.sqrt(self.w.shape[1])) @ self.v.T / math.sqrt(self.w.shape[0])


def arc_cosine_kernels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(NNGP, NTK) of NtkReluNet at infinite width (Cho & Saul 2009; Jacot et al. 2018), written out."""
    q = x @ x.T / x.shape[1]
    r = q.diagonal()
    norms = torch.sqrt(r[:, None] * r[None, :])
    cos = (q / norms).clamp(-1.0, 1.0)
    theta = torch.arccos(cos)
    nngp = norms / (2 * math.pi) * (torch.sin(theta) + (math.pi - theta) * cos)
    return nngp, nngp + q * (math.pi - theta) / (2 * math.pi)


def section_limit(widths: list[int], samples: list[int]) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    nngp, ntk = arc_cosine_kernels(x)
    print("## Monte Carlo kernels vs the arc-cosine limit: one-hidden-layer ReLU, d = 8, N = 16, float64")
    print("relative Frobenius error ‖mean − exact‖ / ‖exact‖, NTK (NNGP in brackets)")
    print("| width | " + " | ".join(f"S = {s}" for s in samples) + " |")
    print("|---:|" + "---:|" * len(samples))
    for width in widths:

        def build(seed: int, width: int = width) -> nn.Module:
            torch.manual_seed(seed)
            return NtkReluNet(8, width).double()

        cells = []
        for s in samples:
            seeds = range(1000 * width, 1000 * width + s)
            mc_ntk = monte_carlo_ntk(build, x, seeds=seeds, mode="trace").mean
            mc_nngp = monte_carlo_ntk(build, x, seeds=seeds, mode="trace", kernel="nngp").mean
            e_ntk = float((mc_ntk - ntk).norm() / ntk.norm())
            e_nngp = float((mc_nngp - nngp).norm() / nngp.norm())
            cells.append(f"{e_ntk:.3f} ({e_nngp:.2f})")
        print(f"| {width} | " + " | ".join(cells) + " |")


# --- groups -----------------------------------------------------------------------------------------------------
def _groups_row(name: str, model: nn.Module, x: torch.Tensor, mode: str, impl: str, repeats: int) -> str:
    """One table row: medians of alternated rounds of the plain kernel, the grouped pass, and one kernel per group."""
    members = compute_ntk_groups(model, x[:2], groups="modules", mode="trace").parameters
    runs = {
        "single": lambda: compute_ntk(model, x, mode=mode, implementation=impl),
        "grouped": lambda: compute_ntk_groups(model, x, groups="modules", mode=mode, implementation=impl),
        "per_group": lambda: [
            compute_ntk(model, x, mode=mode, implementation=impl, params=list(p)) for p in members.values()
        ],
    }
    one, many = runs["single"](), runs["grouped"]()  # warm-up, and the groups add up to the kernel
    err = float((many.total() - one.theta).abs().max())  # type: ignore[union-attr]
    assert err <= 1e-4 * float(one.theta.abs().max()), err  # type: ignore[union-attr]
    runs["per_group"]()
    times: dict[str, list[float]] = {what: [] for what in runs}
    # single and grouped alternate round by round, back to back, which goes first alternating (so load changes
    # hit both alike); the per-group kernels are timed apart, after them.
    for order in [("single", "grouped"), ("grouped", "single")] * repeats + [("per_group",)] * repeats:
        for what in order:
            start = time.perf_counter()
            runs[what]()
            times[what].append(time.perf_counter() - start)
    t = {what: statistics.median(values) for what, values in times.items()}
    ran = f"auto ({many.implementation.value})" if impl == "auto" else impl  # type: ignore[union-attr]
    return (
        f"| {name} | {x.shape[0]} | {mode} | {ran} | {t['single']:.3f} | {t['grouped']:.3f} | {t['per_group']:.3f} "
        f"| {t['grouped'] / t['single']:.2f} | {t['per_group'] / t['single']:.2f} |"
    )


def section_groups(repeats: int, n_mlp: int, n_cnn: int, implementations: list[str]) -> None:
    print("## compute_ntk_groups (3 groups, one pass) vs one compute_ntk per group vs one plain kernel, float32")
    print("| model | N | mode | implementation | single (s) | grouped (s) | per group (s) | grouped / single "
          "| per group / single |")  # fmt: skip
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for name, model, n in (("mlp", make_mlp(), n_mlp), ("cnn", make_cnn(), n_cnn)):
        x = make_inputs(name, n)
        for mode in ("full", "trace"):
            for impl in implementations:
                print(_groups_row(name, model, x, mode, impl, repeats), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=["mc", "operator", "groups", "limit", "all"], default="all")
    parser.add_argument("--n-mlp", type=int, default=32, help="groups: examples for the MLP")
    parser.add_argument("--n-cnn", type=int, default=16, help="groups: examples for the CNN")
    parser.add_argument(
        "--group-implementations", nargs="+", default=["jacobian_contraction", "structured", "auto"], help="groups"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.section in ("mc", "all"):
        section_mc(args.repeats)
    if args.section in ("operator", "all"):
        section_operator(args.budget_mib, args.sizes, args.repeats)
    if args.section in ("groups", "all"):
        section_groups(args.repeats, args.n_mlp, args.n_cnn, args.group_implementations)
    if args.section in ("limit", "all"):
        section_limit(args.widths, args.samples)


if __name__ == "__main__":
    main()
