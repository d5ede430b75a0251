"""Analysis costs: ``/predict`` time split into kernel compute and analysis, and a stored kernel's spectrum by
Lanczos (top 20) against a dense eigh, with time and peak memory side by side.

1. ``/predict`` on the benchmark MLP (784-512-512-10, k = 10) through a real uvicorn server, N train and M test
   examples, in trace mode (an (N, N) eigh) and in full mode (an (N·k, N·k) eigh); the response says how long the
   server spent on the kernels (and f0) and on the analysis; the rest of the wall time is HTTP and JSON.
2. The TRACE kernel of the same MLP on N examples is computed once and stored as a Zarr array chunked by rows of
   tiles (as a job stores it). Then, alternating: ``spectrum(stored_kernel_operator(array), top=20)`` (Lanczos,
   reading 256 rows at a time) and ``numpy.linalg.eigvalsh`` of the whole array loaded into memory. Peak memory is
   tracemalloc's (numpy's allocations, LAPACK's workspace included); the two top-20 lists are checked to agree.

    .venv/bin/python benchmarks/bench_analysis.py                       # N = M = 1000, spectrum N = 4096
    .venv/bin/python benchmarks/bench_analysis.py --n 300 --full-n 100 --spectrum-n 1024 --rounds 1

NOTE [BLAS threads]: the analysis runs in numpy/scipy, whose OpenBLAS pool is not torch's and spins while it
waits. On this shared 2-core host a 512x512 eigvalsh took 0.06-0.1 s with OPENBLAS_NUM_THREADS=1 and 0.1-1.2 s with
2 threads; the script prints the setting it ran with (the server it starts inherits it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import scipy.sparse.linalg  # noqa: E402
import torch  # noqa: E402
import zarr  # noqa: E402

from benchmarks._models import make_mlp  # noqa: E402
from ntk_service.analysis import spectrum, stored_kernel_operator  # noqa: E402
from ntk_service.client import Client  # noqa: E402
from ntk_service.kernels import compute_ntk  # noqa: E402
from tests.conftest import start_live_server  # noqa: E402

ARCHITECTURE = {"family": "mlp", "input_dim": 784, "hidden": [512, 512], "output_dim": 10, "activation": "relu"}
"""The benchmark MLP's architecture (benchmarks/_models.make_mlp), as a registry spec."""


def bench_predict(n: int, m: int, full_n: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_live_server(
            Path(tmp) / "data",
            max_json_response_bytes=str(1024 * 2**20),
            compute_concurrency="1",
            side_cache_bytes="0",  # every round computes both sides, as a first request would
        )
        try:
            with Client(server.url, api_key=server.write_key, timeout=3600) as client:
                client.register_model("bench", ARCHITECTURE, seed=0)
                rng = np.random.default_rng(0)
                for mode, size, size_test in (("trace", n, m), ("full", full_n, full_n)):
                    x = rng.standard_normal((size, 784)).astype(np.float32)
                    xt = rng.standard_normal((size_test, 784)).astype(np.float32)
                    y = rng.standard_normal((size, 10))
                    rows = []
                    for _ in range(rounds):
                        start = time.perf_counter()
                        out = client.predict(
                            "bench", x, y, xt, times=[0, 100, float("inf")], learning_rate=1.0, mode=mode
                        )
                        wall = (time.perf_counter() - start) * 1000
                        rows.append((wall, out.kernel_ms, out.analysis_ms))
                    wall, kernel, analysis = (statistics.median(col) for col in zip(*rows, strict=True))
                    eig_n = size * (10 if mode == "full" else 1)
                    print(
                        f"/predict {mode:5s} N={size} M={size_test} (eigh {eig_n}x{eig_n}): wall {wall:8.0f} ms = "
                        f"kernels+f0 {kernel:8.0f} ms ({kernel / wall:5.1%}) + analysis {analysis:7.0f} ms "
                        f"({analysis / wall:5.1%}) + HTTP/JSON {wall - kernel - analysis:6.0f} ms",
                        flush=True,
                    )
        finally:
            server.stop()


def _measure(fn: Callable[[], np.ndarray]) -> tuple[float, int, np.ndarray]:
    tracemalloc.start()
    start = time.perf_counter()
    values = fn()
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, peak, values


def bench_spectrum(n: int, top: int, rounds: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(n, 784)
    start = time.perf_counter()
    theta = compute_ntk(make_mlp(), x, mode="trace").theta.double().numpy()  # (N, N)
    print(f"trace kernel of the MLP at N={n}: {time.perf_counter() - start:.1f} s to compute", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        # stored as a job stores its result: one uncompressed chunk per 256x256 tile
        stored = zarr.create_array(store=str(Path(tmp) / "theta.zarr"), shape=theta.shape, chunks=(256, 256),
                                   dtype="float64", compressors=None)  # fmt: skip
        stored[:] = theta
        del theta

        products = 0

        def lanczos() -> np.ndarray:
            nonlocal products
            operator = stored_kernel_operator(stored)

            def counted(v: np.ndarray) -> np.ndarray:
                nonlocal products
                products += 1
                return np.asarray(operator.matvec(v))

            wrapped = scipy.sparse.linalg.LinearOperator(operator.shape, matvec=counted, dtype=np.float64)
            return spectrum(wrapped, top=top, method="lanczos").eigenvalues

        def dense() -> np.ndarray:
            return np.linalg.eigvalsh(np.asarray(stored[:]))[::-1][:top]

        results: dict[str, list[tuple[float, int]]] = {"lanczos": [], "eigh": []}
        values = {}
        for _ in range(rounds):  # alternate, so load from other processes hits both alike
            for name, fn in (("lanczos", lanczos), ("eigh", dense)):
                seconds, peak, values[name] = _measure(fn)
                results[name].append((seconds, peak))
        agree = float(np.max(np.abs(values["lanczos"] - values["eigh"]) / values["eigh"][0]))
        summary = {
            name: (statistics.median(s for s, _ in rows), max(p for _, p in rows)) for name, rows in results.items()
        }
        (lt, lp), (et, ep) = summary["lanczos"], summary["eigh"]
        print(f"spectrum top-{top} of a stored {n}x{n} kernel (max rel. difference of the two: {agree:.1e}):")
        print(f"  Lanczos over 256-row reads: {lt:7.2f} s, peak {lp / 2**20:8.1f} MiB ({products // rounds} products)")
        print(f"  dense eigvalsh:             {et:7.2f} s, peak {ep / 2**20:8.1f} MiB")
        print(f"  ratio eigh / Lanczos:       time {et / lt:5.2f}x, peak memory {ep / lp:5.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="Train examples for /predict (trace). Default: 1000.")
    parser.add_argument("--m", type=int, default=None, help="Test examples. Default: N.")
    parser.add_argument("--full-n", type=int, default=1000, help="N = M for /predict in full mode. Default: 1000.")
    parser.add_argument("--spectrum-n", type=int, default=4096, help="Stored kernel size. Default: 4096.")
    parser.add_argument("--top", type=int, default=20, help="Eigenvalues by Lanczos. Default: 20.")
    parser.add_argument("--rounds", type=int, default=3, help="Timed rounds. Default: 3.")
    parser.add_argument("--skip-predict", action="store_true")
    parser.add_argument("--skip-spectrum", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, torch threads 2", flush=True)
    if not args.skip_predict:
        bench_predict(args.n, args.m or args.n, args.full_n, args.rounds)
    if not args.skip_spectrum:
        bench_spectrum(args.spectrum_n, args.top, args.rounds)


if __name__ == "__main__":
    main()
