"""Issues 18 and 31's side-by-side run: our ``auto`` (and optionally ``structured``, ``jacobian_contraction``)
against the torch.func tutorial's Jacobian contraction and neural-tangents (structured derivatives ``nt_sd``,
Jacobian contraction ``nt_jc``), FULL and TRACE, float32, on the ResNet and the transformer (``--cases grid``:
N = M = 16, 32, 64, 128 against the tutorial, with ``structured`` for AUTO's calibration; ``--cases real``:
N = M = 32 and 128 with the peers) and on the MLP / CNN cases of the neural-tangents target (``--cases peer``).

Time: every contender of a case runs once per round, in turn (ours and the peer's interleaved), for ``--rounds``
rounds (more, up to ``--case-seconds``, for fast cases), all in this one process but the peer, which runs in
``.peer-venv`` as a long-lived process (``_peer.PeerSession``, ``make peer-venv``) timing one jitted run per
request, so all see the same moments of a shared machine; medians, and each contender's time relative to ours.
A 2048² float32 matmul joins the rounds as the machine's matmul rate at that moment (the "peak" the GFLOP/s
compare with). GFLOP/s count the Jacobian-contraction work of the case, (N + M)·[FP]·(1 + 2k) + 2·N·M·k²·P (FULL;
k·P for TRACE), with [FP] the forward FLOPs of one example counted by the engine, the same numerator for every
contender (a faster algorithm can pass 100 %).

CPU s: the process's user + system time over the call, sys s the system part, faults the minor page faults
(ours and the tutorial only; medians per call). Allocator: the process keeps freed memory for the next call
(``retain_freed_memory``, as the server) and by default large buffers too (``reuse_large_buffers``, NOTE [large
buffers] in runtime/allocator.py; ``--no-reuse-large-buffers`` for glibc's fresh mappings), the same for every
contender.
Calibration: per case, each of our implementations' estimated FLOPs, AUTO's weight per FLOP and the weighted
cost, beside the measured seconds per estimated TFLOP and the weight that time implies relative to the Jacobian
contraction (``auto`` counts as the implementation it ran); AUTO's choice is right where the cheapest weighted
cost is the fastest implementation. At the end, a summary line per case: the tutorial's time over AUTO's.

Memory (``--memory``, of ``--memory-of``: auto and the tutorial by default): each contender once more in
``--memory-runs`` fresh processes of its own (median), with this run's allocator settings: the growth of VmHWM over
one call, after the model and inputs are built and one warm-up call on two examples (what a server, a job worker or
a loop pays per call: the first call's imports and lazily built state are paid once per process, ~0-100 MiB on
the ResNet, and fresh-process peaks spread by ~10 %; not ``ru_maxrss``: Linux carries a parent's peak over fork and
exec); for the peer (†), the growth of
VmHWM of its own process for that case and contender, over compiling and all the case's runs (compilation included).
A peer case that passes ``--peer-memory-gib`` resident or ``--peer-timeout`` is killed and reported as not run.

    .venv/bin/python benchmarks/bench_real_models.py --cases grid --no-peer --rounds 2 --case-seconds 0  # issue 31
    .venv/bin/python benchmarks/bench_real_models.py --cases grid --no-peer --rounds 2 --models transformer
    .venv/bin/python benchmarks/bench_real_models.py --cases real peer       # the whole table (~30 min, shared)
    .venv/bin/python benchmarks/bench_real_models.py --models resnet --sizes 32 --contenders auto tutorial
    .venv/bin/python benchmarks/bench_real_models.py --cases peer --no-memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# NOTE [OpenMP wait policy] in bench_structured.py: on a shared machine spin-waiting threads wait scheduler slices.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402
from _models import MODELS, make_inputs  # noqa: E402
from _peer import PeerSession, PeerUnavailableError  # noqa: E402
from torchfunc_tutorial import tutorial_ntk  # noqa: E402

from ntk_service.kernels import compute_ntk, retain_freed_memory  # noqa: E402
from ntk_service.kernels.choice import _algorithms, _weight  # noqa: E402  (AUTO's cost model, for the calibration)
from ntk_service.kernels.runtime.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, reuse_large_buffers  # noqa: E402
from ntk_service.kernels.runtime.problem_pool import prepared_problem  # noqa: E402

OURS = ("auto", "structured", "jacobian_contraction")
PEERS = {"nt_sd": "structured_derivatives", "nt_jc": "jacobian_contraction"}
CONTENDERS = (*OURS, "tutorial", *PEERS)
MATMUL = 2048

REAL_CASES = [(name, n, mode) for name in ("resnet", "transformer") for n in (32, 128) for mode in ("full", "trace")]
GRID_CASES = [
    (name, n, mode) for name in ("resnet", "transformer") for n in (16, 32, 64, 128) for mode in ("full", "trace")
]
GRID_CONTENDERS = ["auto", "tutorial", "structured"]
"""Issue 31's grid: AUTO against the tutorial on every cell, structured timed for AUTO's calibration."""
PEER_CASES = [("mlp", 64, "full"), ("mlp", 64, "trace"), ("mlp", 256, "full"), ("mlp2048", 16, "full"),
              ("cnn", 64, "full")]  # fmt: skip
"""The neural-tangents target's cases (>= 1.5x its structured derivatives), run against ``nt_sd`` only."""

NT_SD_TRANSFORMER = (
    "neural-tangents' structured derivatives on the transformer compiled for 224 s and ran 26 s at N = M = 2 "
    "(`peer_neural_tangents.py --models transformer --sizes 2`, 2026-12-01, shared machine), so it is not timed"
)


def _call(contender: str, model: torch.nn.Module, x1: torch.Tensor, x2: torch.Tensor, mode: str) -> str:
    """Run one of our contenders or the tutorial once; returns what ran (the implementation AUTO picked)."""
    if contender == "tutorial":
        tutorial_ntk(model, x1, x2, mode)
        return contender
    return compute_ntk(model, x1, x2, mode=mode, implementation=contender).implementation.value


def _calibration(
    model: torch.nn.Module, x1: torch.Tensor, x2: torch.Tensor, mode: str
) -> dict[str, tuple[float, float]]:
    """Implementation -> (estimated FLOPs, AUTO's weight per FLOP) of the case, as AUTO's choice sees them."""
    from ntk_service.kernels.modes import KernelMode

    with prepared_problem(model, x1[:1], None, params=None, dtype=None) as prepared:
        problem = prepared.problem
        n, m = x1.shape[0], x2.shape[0]
        return {
            impl.value: (alg.flops(problem, n, m, KernelMode(mode)), _weight(impl, alg, problem))
            for impl, alg in _algorithms(None, 0).items()
        }


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


def _memory(name: str, n: int, mode: str, contender: str, reuse: bool, runs: int) -> str:
    """Peak-RSS growth (MiB) of one warm call of ours or the tutorial, the median of ``runs`` fresh processes, as
    table text."""
    code = "\n".join(
        [
            f"import sys, json; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT.parent)!r}]",
            "import torch; torch.set_num_threads(2)",
            "from ntk_service.kernels.runtime.allocator import retain_freed_memory, reuse_large_buffers",
            f"{'reuse_large_buffers' if reuse else 'retain_freed_memory'}()",
            "from bench_real_models import _call, _high_water_kib",
            "from _models import MODELS, make_inputs",
            f"model = MODELS[{name!r}](); x1, x2 = make_inputs({name!r}, {n}), make_inputs({name!r}, {n}, seed=2)",
            f"_call({contender!r}, model, x1[:2], x2[:2], {mode!r})  # warm-up: imports, lazily built state",
            "base = _high_water_kib()",
            f"_call({contender!r}, model, x1, x2, {mode!r})",
            "print(json.dumps((_high_water_kib() - base) / 1024))",
        ]
    )
    peaks = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        peaks.append(float(json.loads(out.stdout.strip().splitlines()[-1])))
    return f"{statistics.median(peaks):.0f}"


@dataclass
class _Peer:
    """One fresh peer process per contender and case (so its VmHWM is that case's), killed past the limits."""

    memory_limit_bytes: int
    timeout: float
    sessions: dict[str, PeerSession] = field(default_factory=dict)
    base_kib: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    compile_seconds: dict[str, float] = field(default_factory=dict)

    def time_once(self, contender: str, name: str, n: int, mode: str) -> float:
        if contender in self.failed:
            raise PeerUnavailableError(self.failed[contender])
        session = self.sessions.get(contender)
        if session is None:
            session = self.sessions[contender] = PeerSession(memory_limit_bytes=self.memory_limit_bytes)
        try:
            seconds = session.time_once(name, n, PEERS[contender], mode, timeout=self.timeout)
        except PeerUnavailableError as exc:
            del self.sessions[contender]
            self.failed[contender] = str(exc).splitlines()[0].removeprefix("PeerSession: ")
            raise
        if "base_kib" in session.last:
            self.base_kib[contender] = session.last["base_kib"]
            self.compile_seconds[contender] = session.last["compile_seconds"]
        return seconds

    def peak_mib(self, contender: str) -> float:
        """VmHWM growth of the contender's process over this case (compiling included)."""
        return (self.sessions[contender].last["vmhwm_kib"] - self.base_kib[contender]) / 1024

    def end_case(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()
        self.base_kib.clear()
        self.failed.clear()
        self.compile_seconds.clear()


def bench_case(
    name: str, n: int, mode: str, contenders: list[str], args: argparse.Namespace, peer: _Peer | None
) -> dict[str, object]:
    """Time one case, print its table and AUTO's calibration; returns the summary row (``_summary``)."""
    model = MODELS[name]()
    x1, x2 = make_inputs(name, n), make_inputs(name, n, seed=2)
    flops = _work_flops(model, x1, x2, mode)
    a = torch.randn(MATMUL, MATMUL)
    calls: dict[str, Callable[[], str]] = {}
    for c in contenders:
        if c in PEERS:
            if peer is not None:
                calls[c] = lambda c=c: str(peer.time_once(c, name, n, mode))  # type: ignore[union-attr]
        else:
            calls[c] = lambda c=c: _call(c, model, x1, x2, mode)
    calls["matmul"] = lambda: str(float((a @ a)[0, 0]))
    ran: dict[str, str] = {}
    for c, call in list(calls.items()):  # warm-up (the peer compiles; AUTO's pick)
        try:
            ran[c] = call()
            if c in PEERS and peer is not None:
                ran[c] = f"compile {peer.compile_seconds[c]:.0f} s"
        except PeerUnavailableError as exc:
            ran[c] = f"not run: {str(exc).splitlines()[0].removeprefix('PeerSession: ')}"
            del calls[c]
    times: dict[str, list[float]] = {c: [] for c in calls}
    faults: dict[str, list[float]] = {c: [] for c in calls}
    cpu: dict[str, list[float]] = {c: [] for c in calls}
    system: dict[str, list[float]] = {c: [] for c in calls}
    start_case = time.perf_counter()
    rounds = 0
    while rounds < args.rounds or (time.perf_counter() - start_case < args.case_seconds and rounds < args.max_rounds):
        for c, call in calls.items():
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            reported = call()
            elapsed = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            times[c].append(float(reported) if c in PEERS else elapsed)  # the peer times its own run
            faults[c].append(after.ru_minflt - before.ru_minflt)
            cpu[c].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            system[c].append(after.ru_stime - before.ru_stime)
        rounds += 1
    peak_rate = 2.0 * MATMUL**3 / statistics.median(times["matmul"])
    reference = "auto" if "auto" in times else next(iter(times))
    print(
        f"\n{name} N=M={n} {mode}: work {flops / 1e9:.1f} GFLOP, matmul rate now {peak_rate / 1e9:.0f} GFLOP/s "
        f"({MATMUL}², median of {rounds} rounds), load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    print(
        f"| contender | median s | x / {reference} | GFLOP/s | % of matmul | CPU s | sys s | faults | peak MiB |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    row: dict[str, object] = {"case": f"{name} N={n} {mode.upper()}", "matmul": peak_rate, "ran": ran.get("auto")}
    for c in contenders:
        label = c if ran.get(c, c) == c else f"{c} ({ran[c]})"
        if c not in times:
            print(f"| {label} | - | - | - | - | - | - | - | - |", flush=True)
            continue
        t = statistics.median(times[c])
        rate = flops / t
        ratio = statistics.median(times[reference]) and t / statistics.median(times[reference])
        ours_cpu = c not in PEERS
        if c in PEERS:
            mib = f"{peer.peak_mib(c):.0f} †" if peer is not None else ""
        else:
            measured = args.memory and c in args.memory_of
            mib = _memory(name, n, mode, c, args.reuse_large_buffers, args.memory_runs) if measured else ""
        per_call = (statistics.median(system[c]), statistics.median(faults[c]), mib, rate / peak_rate)
        row[c] = (t, *per_call, statistics.median(cpu[c]))
        print(
            f"| {label} | {t:.4g} | {ratio:.2f} | {rate / 1e9:.0f} | {100 * rate / peak_rate:.0f} % | "
            f"{f'{statistics.median(cpu[c]):.2f}' if ours_cpu else '-'} | "
            f"{f'{statistics.median(system[c]):.2f}' if ours_cpu else '-'} | "
            f"{f'{statistics.median(faults[c]):.0f}' if ours_cpu else '-'} | {mib} |",
            flush=True,
        )
    _print_calibration(_calibration(model, x1, x2, mode), times, ran)
    return row


def _print_calibration(
    estimates: dict[str, tuple[float, float]], times: dict[str, list[float]], ran: dict[str, str]
) -> None:
    """AUTO's estimate of each implementation beside its measured time per estimated FLOP (NOTE [auto choice])."""
    measured = {c: statistics.median(v) for c, v in times.items() if c in OURS and c != "auto"}
    if "auto" in times:
        measured.setdefault(ran["auto"], statistics.median(times["auto"]))
    jc = "jacobian_contraction"
    base = measured[jc] / estimates[jc][0] if jc in measured else None
    print("calibration (AUTO's cost model against this run):")
    print("| implementation | est. GFLOP | weight | weighted cost | measured s | s per est. TFLOP | implied weight |")
    print("|---|---|---|---|---|---|---|")
    for impl, (est, weight) in sorted(estimates.items(), key=lambda kv: kv[1][0] * kv[1][1]):
        t = measured.get(impl)
        per = f"{1e12 * t / est:.2f}" if t is not None else "-"
        implied = f"{(t / est) / base:.2f}" if t is not None and base else "-"
        print(
            f"| {impl} | {est / 1e9:.1f} | {weight:.2f} | {est * weight / 1e9:.1f} | "
            f"{f'{t:.4g}' if t is not None else '-'} | {per} | {implied} |",
            flush=True,
        )


def _summary(rows: list[dict[str, object]]) -> None:
    """One line per case: AUTO against the tutorial (the issue's table), system time and faults beside wall."""
    rows = [r for r in rows if "auto" in r and "tutorial" in r]
    if not rows:
        return
    print(
        "\nsummary: tutorial s / auto s (> 1: auto faster) by wall time and by CPU s (user + system, the steadier "
        "figure on a shared machine), per call medians; peak MiB auto / tutorial"
    )
    print(
        "| case | auto ran | tutorial / auto | by CPU s | auto s (sys s, faults) | tutorial s (sys s, faults) "
        "| auto % of matmul | peak MiB auto / tutorial |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, t = r["auto"], r["tutorial"]
        assert isinstance(a, tuple) and isinstance(t, tuple)
        print(
            f"| {r['case']} | {r['ran']} | **{t[0] / a[0]:.2f}** | {t[5] / a[5]:.2f} | "
            f"{a[0]:.4g} ({a[1]:.2f}, {a[2]:.0f}) | "
            f"{t[0]:.4g} ({t[1]:.2f}, {t[2]:.0f}) | {100 * a[4]:.0f} % | {a[3] or '-'} / {t[3] or '-'} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=["grid", "real", "peer"], help="case lists (see top)")
    parser.add_argument(
        "--case",
        action="append",
        metavar="MODEL:N:MODE[:C1,C2]",
        help="one case (repeatable, run in this order), optionally with its own contenders; replaces the lists",
    )
    parser.add_argument("--models", nargs="+", default=["resnet", "transformer"], choices=sorted(MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[32])
    parser.add_argument("--modes", nargs="+", default=["full", "trace"], choices=["full", "trace"])
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="default: auto, tutorial, nt_sd, nt_jc")
    parser.add_argument("--rounds", type=int, default=3, help="at least this many rounds per case")
    parser.add_argument("--case-seconds", type=float, default=20.0, help="more rounds while a case is under this")
    parser.add_argument("--max-rounds", type=int, default=40)
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument(
        "--memory-of", nargs="+", default=["auto", "tutorial"], choices=CONTENDERS, help="whose peak to measure"
    )
    parser.add_argument("--memory-runs", type=int, default=3, help="fresh processes per peak (median). Default: 3")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--reuse-large-buffers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep large freed buffers for the next call (allocator.reuse_large_buffers), for every contender",
    )
    parser.add_argument("--peer-memory-gib", type=float, default=10.0, help="kill a peer case past this RSS")
    parser.add_argument("--peer-timeout", type=float, default=600.0, help="kill a peer case past this many s")
    args = parser.parse_args()
    torch.set_num_threads(2)
    retain_freed_memory()  # as the server does; the peer's glibc gets the same settings
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(TRIM_THRESHOLD_BYTES)
    if args.reuse_large_buffers:
        reuse_large_buffers()
        os.environ["MALLOC_MMAP_MAX_"] = "0"
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(2**62)  # never trim, as reuse_large_buffers
        os.environ["MALLOC_ARENA_MAX"] = "1"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, round-robin in one process, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, large buffers "
        f"{'reused' if args.reuse_large_buffers else 'mapped fresh'}, load {os.getloadavg()[0]:.1f}"
    )
    cases: list[tuple[list[str], tuple[str, int, str]]] = []
    if args.case:
        for text in args.case:
            name, n_text, mode, *chosen = text.split(":")
            own = chosen[0].split(",") if chosen else args.contenders or ["auto", "tutorial", "nt_sd", "nt_jc"]
            cases.append((own, (name, int(n_text), mode)))
    elif args.cases:
        real = args.contenders or ["auto", "tutorial", "nt_sd", "nt_jc"]
        grid = [case for case in GRID_CASES if case[0] in args.models]  # --models splits the grid in two runs
        cases += [(args.contenders or GRID_CONTENDERS, case) for case in grid] if "grid" in args.cases else []
        cases += [(real, case) for case in REAL_CASES] if "real" in args.cases else []
        cases += [(["auto", "nt_sd"], case) for case in PEER_CASES] if "peer" in args.cases else []
    else:
        contenders = args.contenders or ["auto", "tutorial", "nt_sd", "nt_jc"]
        cases = [(contenders, (m, n, mode)) for m in args.models for n in args.sizes for mode in args.modes]
    peer = _Peer(int(args.peer_memory_gib * 2**30), args.peer_timeout) if args.peer else None
    rows: list[dict[str, object]] = []
    for contenders, (name, n, mode) in cases:
        # interleave ours and the peer's so every run follows one of the other library
        order = [c for c in contenders if c not in PEERS]
        for i, p in enumerate(c for c in contenders if c in PEERS):
            order.insert(min(2 * i + 1, len(order)), p)
        if name == "transformer" and "nt_sd" in order:
            order.remove("nt_sd")
            print(f"\n{name} N=M={n} {mode}: nt_sd not run: {NT_SD_TRANSFORMER}")
        try:
            rows.append(bench_case(name, n, mode, order, args, peer))
        finally:
            if peer is not None:
                peer.end_case()
    _summary(rows)


if __name__ == "__main__":
    main()
