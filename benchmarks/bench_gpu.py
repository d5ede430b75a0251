"""Kernels on a CUDA GPU: our implementations beside the torch.func tutorial's contraction on the same GPU.

For the benchmark MLP and CNN (``_models.py``) at N = M = 64, 256, 1024 (full mode, float32, TF32 off), times
``structured``, ``jacobian_contraction`` and ``auto`` and the tutorial's unchunked contraction
(``torchfunc_tutorial.py``) on one GPU in one process, in interleaved rounds, and prints each as a ratio to the
tutorial, with the peak GPU memory of each (``torch.cuda.max_memory_allocated`` over what was allocated before).
Every timing is bracketed by ``torch.cuda.synchronize()`` (kernels launch asynchronously). Then one HTTP kernel
is served from the GPU (a real server with ``NTK_DEVICE``) and timed against the bare engine call.

Without CUDA it refuses at once, saying so. ``--device cpu`` runs the same code paths on the CPU at the sizes
given (to check the script, not to measure: peak memory is then not reported)::

    .venv/bin/python benchmarks/bench_gpu.py --out results.json            # on a GPU machine
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --sizes 8 --repeats 1 --http-n 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._models import MODELS, make_inputs  # noqa: E402
from benchmarks.torchfunc_tutorial import tutorial_ntk  # noqa: E402
from ntk_service.errors import UnknownDevice  # noqa: E402
from ntk_service.kernels import compute_ntk, parse_device  # noqa: E402

TUTORIAL = "tutorial"
IMPLEMENTATIONS = ["structured", "jacobian_contraction", "auto"]
HTTP_ARCHITECTURE = {"family": "mlp", "input_dim": 784, "hidden": [512, 512], "output_dim": 10, "activation": "relu"}
"""The benchmark MLP's architecture as the service's built-in family (its own seeded weights)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(call: Callable[[], object], device: torch.device) -> tuple[float, int | None, object]:
    """Seconds of one call, synchronized before and after, its peak GPU memory above what was allocated before,
    and its result."""
    _sync(device)
    base = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    result = call()
    _sync(device)
    seconds = time.perf_counter() - start
    peak = None if base is None else torch.cuda.max_memory_allocated(device) - base
    return seconds, peak, result


def _variants(model: torch.nn.Module, x1: torch.Tensor, x2: torch.Tensor, device: torch.device) -> dict[str, Any]:
    calls: dict[str, Callable[[], object]] = {TUTORIAL: lambda: tutorial_ntk(model, x1, x2, "full")}
    for impl in IMPLEMENTATIONS:
        calls[impl] = lambda impl=impl: compute_ntk(model, x1, x2, implementation=impl, device=device).theta
    return calls


def bench_kernels(device: torch.device, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """One row per (model, N, variant): median seconds, peak bytes, ratio to the tutorial, or the error."""
    rows: list[dict[str, Any]] = []
    for name in ["mlp", "cnn"]:
        model = MODELS[name]().to(device)
        for n in sizes:
            x1, x2 = make_inputs(name, n).to(device), make_inputs(name, n, seed=2).to(device)
            calls = _variants(model, x1, x2, device)
            times: dict[str, list[float]] = {v: [] for v in calls}
            peaks: dict[str, int | None] = {}
            errors: dict[str, str] = {}
            diffs: dict[str, float] = {}
            reference: torch.Tensor | None = None
            for variant, call in calls.items():  # warm-up: the peak memory of one call, and a check of its numbers
                try:
                    _, peaks[variant], theta = measure(call, device)
                    assert isinstance(theta, torch.Tensor)
                    if variant == TUTORIAL:
                        reference = theta
                    elif reference is not None:
                        diffs[variant] = float((theta - reference).abs().max() / reference.abs().max())
                    del theta
                except torch.OutOfMemoryError as exc:
                    errors[variant] = f"out of GPU memory: {str(exc).splitlines()[0]}"
                    torch.cuda.empty_cache()
            for _ in range(repeats):  # interleaved, so drift hits every variant alike
                for variant, call in calls.items():
                    if variant not in errors:
                        times[variant].append(measure(call, device)[0])
            base = statistics.median(times[TUTORIAL]) if TUTORIAL not in errors else None
            del reference
            for variant in calls:
                median = statistics.median(times[variant]) if variant not in errors else None
                rows.append(
                    {
                        "model": name,
                        "n": n,
                        "variant": variant,
                        "median_s": median,
                        "peak_bytes": peaks.get(variant),
                        "ratio_to_tutorial": None if median is None or base is None else median / base,
                        "max_rel_diff_vs_tutorial": diffs.get(variant),
                        "error": errors.get(variant),
                    }
                )
            del x1, x2, calls
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_http(device: torch.device, n: int, repeats: int) -> dict[str, Any]:
    """A float32 MLP kernel (N = M = n, full) over HTTP from a server on ``device`` vs the bare engine call."""
    from tests.conftest import start_live_server
    from tests.server.support import decode_theta, rebuild, request_kernel

    with tempfile.TemporaryDirectory() as tmp:
        server = start_live_server(
            Path(tmp) / "data",
            device=str(device),
            side_cache_bytes="0",
            compute_concurrency="1",
            max_body_bytes=str(1024 * 2**20),
        )
        try:
            with server.client("write", timeout=600.0) as client:
                ready = client.get("/readyz").json()
                record = client.post("/v1/models", json={"name": "bench", "architecture": HTTP_ARCHITECTURE}).json()
                model = rebuild(record, client.get("/v1/models/bench/versions/1/weights").content).to(device)
                x1 = np.random.default_rng(0).standard_normal((n, 784)).astype(np.float32)
                theta, meta = decode_theta(request_kernel(client, "bench", x1, None, fmt="npy"))
                implementation = meta["implementation"]
                x1t = torch.from_numpy(x1)
                expected = compute_ntk(model, x1t, implementation=implementation, device=device).theta.cpu().numpy()
                max_rel = float(np.abs(theta - expected).max() / np.abs(expected).max())

                def bare() -> object:
                    return compute_ntk(model, x1t, implementation=implementation, device=device).theta.cpu()

                def http() -> object:
                    return decode_theta(
                        request_kernel(client, "bench", x1, None, fmt="npy", implementation=implementation)
                    )

                bare_s, http_s = [], []
                for _ in range(repeats):
                    bare_s.append(measure(bare, device)[0])
                    http_s.append(measure(http, device)[0])
        finally:
            server.stop()
    engine, served = statistics.median(bare_s), statistics.median(http_s)
    return {
        "readyz": ready,
        "n": n,
        "implementation": implementation,
        "engine_s": engine,
        "http_npy_s": served,
        "http_over_engine": served / engine,
        "max_rel_diff_http_vs_engine": max_rel,
    }


def _print(rows: list[dict[str, Any]], http: dict[str, Any] | None) -> None:
    print(
        f"{'model':<5} {'N=M':>5} {'variant':<21} {'median s':>10} {'x tutorial':>10} {'peak GPU MiB':>13} "
        f"{'rel diff':>9}"
    )
    for r in rows:
        if r["error"]:
            print(f"{r['model']:<5} {r['n']:>5} {r['variant']:<21} {r['error']}")
            continue
        ratio = "" if r["ratio_to_tutorial"] is None else f"{r['ratio_to_tutorial']:.3f}"
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        diff = "" if r["max_rel_diff_vs_tutorial"] is None else f"{r['max_rel_diff_vs_tutorial']:.1e}"
        print(f"{r['model']:<5} {r['n']:>5} {r['variant']:<21} {r['median_s']:>10.4f} {ratio:>10} {peak:>13} {diff:>9}")
    print("x tutorial: our median time / the tutorial's on the same device in the same rounds (< 1: faster).")
    print("rel diff: max |ours - tutorial| / max |tutorial| of the warm-up results (float32; a sanity check).")
    if http is not None:
        print(
            f"HTTP (server {http['readyz']}): MLP N=M={http['n']} full float32 as .npy, {http['implementation']}: "
            f"{http['http_npy_s'] * 1000:.1f} ms vs the bare engine call {http['engine_s'] * 1000:.1f} ms "
            f"(x{http['http_over_engine']:.2f}); max rel diff {http['max_rel_diff_http_vs_engine']:.1e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (checks the script). Default: cuda.")
    parser.add_argument("--sizes", nargs="+", type=int, default=[64, 256, 1024], help="N = M values.")
    parser.add_argument("--repeats", type=int, default=3, help="Timed rounds after one warm-up. Default: 3.")
    parser.add_argument("--http-n", type=int, default=256, help="N = M of the HTTP kernel; 0 skips it.")
    parser.add_argument("--out", type=Path, default=None, help="Also write the results as JSON here.")
    args = parser.parse_args(argv)
    try:
        device = parse_device(args.device, operation="bench_gpu")
    except UnknownDevice as exc:
        print(f"{exc.message}\nNothing was measured.", file=sys.stderr)
        return 2
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name}, float32, TF32 off")
    else:
        print(f"torch {torch.__version__} on the CPU ({torch.get_num_threads()} threads): a check of the script only")
    rows = bench_kernels(device, args.sizes, args.repeats)
    http = bench_http(device, args.http_n, args.repeats) if args.http_n > 0 else None
    _print(rows, http)
    if args.out is not None:
        info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
        if device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(device)
        args.out.write_text(json.dumps({"info": info, "kernels": rows, "http": http}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
