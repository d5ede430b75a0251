"""``compute_ntk`` on a machine shared with other torch processes: what ``import ntk_service`` before torch buys.

NOTE [OpenMP wait policy] (``ntk_service/_openmp.py``): libgomp's default waiting spins, so beside other processes
that also spin every parallel op can wait out a scheduler slice. Three long-lived worker processes compute the same
full kernel of the README's MLP (784-512-512-10, N = M = 64, float32, ``auto``), each started its own way:

- ``torch first``: ``import torch`` before ntk_service, ``OMP_WAIT_POLICY`` unset: libgomp's default (the before);
- ``ntk_service first``: ``import ntk_service`` before torch, unset: the package sets ``PASSIVE`` (the after);
- ``torch first, 1 thread``: the default policy and ``torch.set_num_threads(1)`` (the other remedy).

Two hog processes run their own 2-thread torch loops (the default policy, as another user's training would);
they are paused (SIGSTOP) for the "alone" timings and resumed (SIGCONT) for the "beside" ones. Each round visits
both conditions, in alternating order, and every worker in each, so all see the same moments of the machine; a
visit times ``--calls`` calls and keeps their median. Printed: the load average, each worker's median per
condition, beside / alone, and each worker against ``torch first`` beside the hogs.

    .venv/bin/python benchmarks/bench_shared_machine.py                     # 15 rounds, about 2 minutes idle
    .venv/bin/python benchmarks/bench_shared_machine.py --rounds 3 --n 16   # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_WORKER = r"""
import json, sys, time
order, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if order == "ntk_service":
    import ntk_service
import torch
from ntk_service.kernels import compute_ntk
import os
torch.set_num_threads(threads)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10))
x1, x2 = torch.randn(n, 784), torch.randn(n, 784)
theta = compute_ntk(model, x1, x2).theta  # warm-up
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"), "threads": torch.get_num_threads(),
                  "checksum": float(theta.double().sum())}), flush=True)
for line in sys.stdin:
    times = []
    for _ in range(int(line)):
        start = time.perf_counter()
        compute_ntk(model, x1, x2)
        times.append(time.perf_counter() - start)
    print(json.dumps(times), flush=True)
"""

_HOG = r"""
import torch
torch.set_num_threads(2)
a = torch.randn(256, 256)
while True:
    b = torch.relu(a @ a) * 1e-3 + a
    a = b / (1.0 + b.abs().max())
"""


@dataclass
class Worker:
    label: str
    process: subprocess.Popen[str]
    info: dict[str, object] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=lambda: {"alone": [], "beside": []})

    def time(self, calls: int) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{calls}\n")
        self.process.stdin.flush()
        return float(statistics.median(json.loads(self.process.stdout.readline())))


def _default_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start_worker(label: str, order: str, threads: int, n: int) -> Worker:
    process = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", _WORKER, order, str(threads), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_default_env(),
    )
    assert process.stdout is not None
    worker = Worker(label, process)
    worker.info = json.loads(process.stdout.readline())
    return worker


def _hogs(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", _HOG], env=_default_env()) for _ in range(count)]


def _signal(hogs: list[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    for hog in hogs:
        os.kill(hog.pid, sig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5, help="calls per visit; the visit keeps their median")
    parser.add_argument("--n", type=int, default=64, help="examples per side (N = M)")
    parser.add_argument("--hogs", type=int, default=2, help="torch processes running their own 2-thread loops")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds after pausing or resuming the hogs")
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores, load average {os.getloadavg()[0]:.1f} before starting, N = M = {args.n}, "
          f"{args.rounds} rounds x {args.calls} calls, {args.hogs} hogs")  # fmt: skip
    workers = [
        _start_worker("torch first", "torch", cores, args.n),
        _start_worker("ntk_service first", "ntk_service", cores, args.n),
        _start_worker("torch first, 1 thread", "torch", 1, args.n),
    ]
    hogs = _hogs(args.hogs)
    try:
        checksums = [float(w.info["checksum"]) for w in workers]  # type: ignore[arg-type]
        assert max(checksums) - min(checksums) <= 1e-4 * abs(checksums[0]), checksums  # one kernel, three ways
        for worker in workers:
            print(f"  {worker.label:<24} OMP_WAIT_POLICY={worker.info['policy']}, {worker.info['threads']} threads")
        loads = []
        for r in range(args.rounds):
            conditions = ("alone", "beside") if r % 2 == 0 else ("beside", "alone")
            for condition in conditions:
                _signal(hogs, signal.SIGCONT if condition == "beside" else signal.SIGSTOP)
                time.sleep(args.settle)
                order = workers[r % len(workers) :] + workers[: r % len(workers)]
                for worker in order:
                    worker.times[condition].append(worker.time(args.calls))
            loads.append(os.getloadavg()[0])
        _signal(hogs, signal.SIGCONT)
    finally:
        processes: list[subprocess.Popen[bytes] | subprocess.Popen[str]] = [*hogs, *(w.process for w in workers)]
        for process in processes:
            process.kill()
            process.wait()

    print(f"load average during the rounds: {min(loads):.1f} to {max(loads):.1f} (hogs included when running)\n")
    base = statistics.median(workers[0].times["beside"])
    print("| worker | OMP_WAIT_POLICY | alone (ms) | beside the hogs (ms) | beside / alone | beside, vs torch first |")
    print("|---|---|---:|---:|---:|---:|")
    for worker in workers:
        alone, beside = (statistics.median(worker.times[c]) for c in ("alone", "beside"))
        print(f"| {worker.label} | {worker.info['policy']} | {alone * 1e3:.1f} | {beside * 1e3:.1f} | "
              f"{beside / alone:.2f}x | {base / beside:.2f}x faster |")  # fmt: skip


if __name__ == "__main__":
    main()
