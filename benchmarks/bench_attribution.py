"""LDS and end-to-end CPU time of data attribution on digits (issue 39): this project against traker and kronfluence.

Setting (``_attribution_data.py``): scikit-learn's digits, ``--n-train`` training and ``--n-test`` test examples,
an MLP 64-128-128-10 and a small CNN; ground truth from ``--subsets`` models retrained on random halves of the
training set (their test margins), computed here once and cached under ``--cache``; ``--checkpoints`` models trained
on the whole training set (seeds 1000 + c) are the ensemble every method scores with.

Methods, side by side on the same checkpoints:

- ``ours``: ``fit_attributor`` with the structured sketch at ``--dim`` (traker's projection size), then the
  (M, N) scores; ``ours-exact``: the same with ``features="exact"`` (the exact margin kernel, N × N);
- ``traker``: traker 0.3.2, its CPU ``BasicProjector`` at ``--dim``, float32 (``peer_attribution.py``, in
  ``.trak-venv``: ``make trak-venv``);
- ``kronfluence``: kronfluence 1.0.1, EK-FAC (in ``.kfac-venv``: ``make kronfluence-venv``).

Ridges: each method runs at its default (ours ``DEFAULT_RIDGE``; traker none; kronfluence its heuristic damping)
and, with ``--tune``, at the ridge that maximises the LDS on the even-indexed test examples (the grid is printed
with both halves' LDS: the LDS-vs-ridge curve). Reported LDS is on the odd-indexed half (never used for tuning) and
on all test examples. Timed rounds alternate the methods (the order rotates every round); times are the attribution
itself, from the checkpoints to the scores, wall and CPU (process time of all threads), medians over rounds, with
the load average beside; peers run in their own processes and time themselves (imports excluded, as for ours).
Before the timed rounds, ``--exactness-dims`` prints the relative error of the sketched scores against the exact
features' at each D (first checkpoint, default ridge). The ground truth's models train in ``--workers`` processes.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_attribution.py --tune --rounds 3   # the full run (idle)
    .venv/bin/python benchmarks/bench_attribution.py --archs mlp --subsets 20 --n-train 500 --rounds 1 \
        --methods ours ours-exact --exactness-dims                                                # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _attribution_data import checkpoints, digits, ground_truth, make_model, state_tensors  # noqa: E402

from ntk_service.attribution import (  # noqa: E402
    DEFAULT_RIDGE,
    AttributionOptions,
    fit_attributor,
    linear_datamodeling_score,
)

VENVS = {"traker": ROOT / ".trak-venv", "kronfluence": ROOT / ".kfac-venv"}
PEER = ROOT / "benchmarks" / "peer_attribution.py"
OUR_GRID = [0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0]
"""Relative ridges tried with --tune, ours and traker's alike (traker's λ = ρ × the mean squared feature norm)."""
KFAC_GRID = ["heuristic", "1e-8", "1e-4", "1e-3", "1e-2", "1e-1"]
"""kronfluence dampings tried with --tune: its heuristic (0.1 × mean eigenvalue) and absolute values."""


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def _lds(scores: np.ndarray, masks: np.ndarray, margins: np.ndarray, rows: np.ndarray) -> float:
    return linear_datamodeling_score(scores[rows], masks, margins[:, rows]).mean


class Ours:
    """This project's attribution, in this process."""

    def __init__(self, arch: str, data: tuple[np.ndarray, ...], states: list, dim: int, exact: bool) -> None:
        self.arch, self.data, self.states = arch, data, [state_tensors(s) for s in states]
        self.options = AttributionOptions(features="exact" if exact else "structured", dim=dim)

    def scores(self, ridges: list[float]) -> tuple[list[np.ndarray], float, float]:
        """Scores per ridge (one feature pass), and the wall / CPU seconds of the first ridge end to end."""
        x, y, xq, yq = (torch.from_numpy(a) for a in self.data)
        w0, c0 = time.perf_counter(), time.process_time()
        attributor = fit_attributor(
            make_model(self.arch), x, y, checkpoints=self.states, options=self.options.replace(ridge=ridges[0])
        )
        tests = attributor.target_features(xq, yq)
        out = [attributor.scores(features=tests)]
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        out += [attributor.with_ridge(r).scores(features=tests) for r in ridges[1:]]
        return out, wall, cpu


def _peer(method: str, args: argparse.Namespace, arch: str, ridges: list[str]) -> tuple[list[np.ndarray], float, float]:
    python = VENVS[method] / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(
            f"{python} is missing: make {'trak-venv' if method == 'traker' else 'kronfluence-venv'}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scores.npz"
        cmd = [
            str(python),
            str(PEER),
            "--method",
            method,
            "--arch",
            arch,
            "--n-train",
            str(args.n_train),
            "--n-test",
            str(args.n_test),
            "--checkpoints",
            str(args.checkpoints),
            "--dim",
            str(args.dim),
            "--cache",
            str(args.cache),
            "--out",
            str(out),
            "--ridges",
            *ridges,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{method} failed:\n{done.stderr[-3000:]}")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        with np.load(out) as z:
            scores = list(z["scores"])
    return scores, report["wall_s"][0], report["cpu_s"][0]


def _run(method: str, args: argparse.Namespace, arch: str, ours: dict[str, Ours], ridges: list) -> tuple:
    if method in ours:
        return ours[method].scores([float(r) for r in ridges])
    return _peer(method, args, arch, [str(r) for r in ridges])


def _exactness(arch: str, data: tuple[np.ndarray, ...], states: list, dims: list[int]) -> None:
    """Relative error of the structured sketch's scores against the exact features' at each D (one checkpoint)."""
    x, y, xq, yq = (torch.from_numpy(a) for a in data)
    checkpoint = [state_tensors(s) for s in states]
    exact = fit_attributor(make_model(arch), x, y, checkpoints=checkpoint, options=AttributionOptions(
        features="exact")).scores(xq, yq)  # fmt: skip
    cells = []
    for dim in dims:
        sketched = fit_attributor(make_model(arch), x, y, checkpoints=checkpoint, options=AttributionOptions(
            dim=dim)).scores(xq, yq)  # fmt: skip
        error = float(np.linalg.norm(sketched - exact) / np.linalg.norm(exact))
        cells.append(f"D={dim}: {error:.3f} (×√D {error * dim**0.5:.1f})")
    print(f"sketched vs exact scores, one checkpoint, ridge {DEFAULT_RIDGE}: " + ", ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["ours", "ours-exact", "traker", "kronfluence"],
        choices=["ours", "ours-exact", "traker", "kronfluence"],
    )
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--n-test", type=int, default=300)
    parser.add_argument("--subsets", type=int, default=200, help="models retrained on random halves (ground truth)")
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune", action="store_true", help="choose each method's ridge on the even test half")
    parser.add_argument("--workers", type=int, default=2, help="processes training the ground-truth models")
    parser.add_argument(
        "--exactness-dims",
        type=int,
        nargs="*",
        default=[512, 2048, 8192],
        help="D of the sketched-vs-exact score error (first checkpoint; none: skip)",
    )
    parser.add_argument("--cache", type=Path, default=Path("/tmp/ntk_bench_attribution"))
    args = parser.parse_args()

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY')}; load {_load()}",
        flush=True,
    )
    tune_rows, report_rows = np.arange(0, args.n_test, 2), np.arange(1, args.n_test, 2)
    for arch in args.archs:
        start = time.perf_counter()
        masks, margins = ground_truth(arch, args.n_train, args.n_test, args.subsets, args.cache, args.workers)
        states = checkpoints(arch, args.n_train, args.n_test, args.checkpoints, args.cache)
        print(
            f"\n## {arch}: N={args.n_train}, M={args.n_test}, {args.subsets} retrained models, {args.checkpoints} "
            f"checkpoints, D={args.dim} (data ready in {time.perf_counter() - start:.0f} s; load {_load()})",
            flush=True,
        )
        data = digits(args.n_train, args.n_test)
        ours = {
            "ours": Ours(arch, data, states, args.dim, exact=False),
            "ours-exact": Ours(arch, data, states, args.dim, exact=True),
        }
        defaults = {
            "ours": [DEFAULT_RIDGE],
            "ours-exact": [DEFAULT_RIDGE],
            "traker": [0.0],
            "kronfluence": ["heuristic"],
        }
        chosen = {m: defaults[m] for m in args.methods}
        if args.tune:
            for method in args.methods:
                grid = KFAC_GRID if method == "kronfluence" else OUR_GRID
                scores, _, _ = _run(method, args, arch, ours, grid)
                curve = [
                    (r, _lds(s, masks, margins, tune_rows), _lds(s, masks, margins, report_rows))
                    for r, s in zip(grid, scores, strict=True)
                ]
                best = max(curve, key=lambda c: c[1] if np.isfinite(c[1]) else -np.inf)
                chosen[method] = [best[0]]
                cells = "  ".join(f"{r}: {a:.3f}/{b:.3f}" for r, a, b in curve)
                print(f"ridge curve {method:12s} (LDS tune/report half) {cells}  -> {best[0]}", flush=True)
        runs = [
            (m, r)
            for m in args.methods
            for r in ([defaults[m][0]] + ([chosen[m][0]] if args.tune and chosen[m][0] != defaults[m][0] else []))
        ]
        results: dict[tuple, dict[str, list[float]]] = {
            run: {"wall": [], "cpu": [], "lds": [], "lds_all": []} for run in runs
        }
        for rnd in range(args.rounds):
            order = runs[rnd % len(runs) :] + runs[: rnd % len(runs)]
            for method, ridge in order:
                scores, wall, cpu = _run(method, args, arch, ours, [ridge])
                rec = results[(method, ridge)]
                rec["wall"].append(wall)
                rec["cpu"].append(cpu)
                rec["lds"].append(_lds(scores[0], masks, margins, report_rows))
                rec["lds_all"].append(_lds(scores[0], masks, margins, np.arange(args.n_test)))
                print(
                    f"  round {rnd}: {method:12s} ridge {ridge!s:9s} LDS {rec['lds'][-1]:.3f} wall {wall:6.1f} s "
                    f"cpu {cpu:6.1f} s  load {_load()}",
                    flush=True,
                )
        ref = (
            next(((m, r) for m, r in runs if m == "traker" and r == chosen["traker"][0]), None)
            if "traker" in args.methods
            else None
        )
        print(f"\n| {arch} | D | ridge | LDS (held-out half) | LDS (all) | wall s | CPU s | CPU vs traker |")
        print("|---|---|---|---|---|---|---|---|")
        for method, ridge in runs:
            rec = results[(method, ridge)]
            cpu = statistics.median(rec["cpu"])
            ratio = f"{cpu / statistics.median(results[ref]['cpu']):.3f}x" if ref else "-"
            how = "tuned" if args.tune and ridge == chosen[method][0] and ridge != defaults[method][0] else "default"
            dim = "exact" if method == "ours-exact" else ("-" if method == "kronfluence" else str(args.dim))
            print(
                f"| {method} | {dim} | {ridge} ({how}) | {statistics.median(rec['lds']):.3f} | "
                f"{statistics.median(rec['lds_all']):.3f} | {statistics.median(rec['wall']):.1f} | {cpu:.1f} | "
                f"{ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
