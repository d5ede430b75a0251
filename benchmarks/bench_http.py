"""The cost of HTTP + encoding over the bare engine call, for JSON, .npy and safetensors, printed as ratios.

One MLP kernel (N = M = 128, full mode, k = 10: a 6.6 MB float32 result) is computed by ``compute_ntk`` in this
process and through a real uvicorn server (a subprocess on loopback) with each wire format, in interleaved rounds so
load from other processes hits all variants alike. A round trip counts everything a client waits for: encoding the
request, HTTP, the server's decoding, validation, compute and encoding, and decoding the response to numpy. The
server's side cache is off (``NTK_SIDE_CACHE_BYTES=0``) so every request computes as much as the bare call. Both
sides run the same implementation (the one the server's AUTO picks) with the same torch thread count.

    .venv/bin/python benchmarks/bench_http.py               # median of 7 rounds
    .venv/bin/python benchmarks/bench_http.py --rounds 3 --n 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ntk_service import wire  # noqa: E402
from ntk_service.kernels import compute_ntk  # noqa: E402
from tests.conftest import LiveServer, start_live_server  # noqa: E402
from tests.server.support import decode_theta, rebuild, request_kernel  # noqa: E402

ARCHITECTURE = {"family": "mlp", "input_dim": 32, "hidden": [128, 128], "output_dim": 10, "activation": "relu"}
FORMATS = ("json", "npy", "safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=128, help="N = M examples (x2 = x1). Default: 128.")
    parser.add_argument("--rounds", type=int, default=7, help="Timed rounds (after one warm-up). Default: 7.")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = start_live_server(
            Path(tmp) / "data",
            side_cache_bytes="0",
            max_json_response_bytes=str(1024 * 2**20),
            max_body_bytes=str(1024 * 2**20),
            compute_concurrency="1",
        )
        try:
            run(server, n=args.n, rounds=args.rounds)
        finally:
            server.stop()


def run(server: LiveServer, *, n: int, rounds: int) -> None:
    client = server.client("write", timeout=600.0)
    record = client.post("/v1/models", json={"name": "bench", "architecture": ARCHITECTURE}).json()
    model = rebuild(record, client.get("/v1/models/bench/versions/1/weights").content)
    torch.set_num_threads(2)  # the server's count on this machine: cores // compute_concurrency
    rng = np.random.default_rng(0)

    def fresh_x1() -> np.ndarray:
        return rng.standard_normal((n, ARCHITECTURE["input_dim"])).astype(np.float32)

    _, meta = decode_theta(request_kernel(client, "bench", fresh_x1(), None, fmt="npy"))
    implementation = meta["implementation"]

    def bare() -> dict[str, float]:
        x1 = torch.from_numpy(fresh_x1())
        start = time.perf_counter()
        compute_ntk(model, x1, mode="full", implementation=implementation)
        return {"total": time.perf_counter() - start}

    def over_http(fmt: str) -> Callable[[], dict[str, float]]:
        def call() -> dict[str, float]:
            x1 = fresh_x1()
            start = time.perf_counter()
            theta, meta = decode_theta(
                request_kernel(client, "bench", x1, None, fmt=fmt, implementation=implementation)
            )
            total = time.perf_counter() - start
            assert theta.shape == (n, n, 10, 10)
            return {"total": total, "server_compute": float(meta["elapsed_ms"]) / 1000}

        return call

    variants: dict[str, Callable[[], dict[str, float]]] = {"engine": bare}
    variants.update({fmt: over_http(fmt) for fmt in FORMATS})
    for call in variants.values():  # warm-up
        call()
    times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            times[name].append(call())
    client.close()

    engine = statistics.median(t["total"] for t in times["engine"])
    theta_mb = n * n * 100 * 4 / 1e6
    print(
        f"MLP {ARCHITECTURE['input_dim']}-128-128-10, N = M = {n}, full mode, theta {theta_mb:.1f} MB float32, "
        f"implementation {implementation}, median of {rounds} rounds, torch threads {torch.get_num_threads()}"
    )
    print(f"{'variant':<13} {'median ms':>10} {'ratio':>7} {'server compute ms':>18} {'paired ratio':>13}")
    print(f"{'engine (bare)':<13} {engine * 1000:>10.1f} {1.0:>7.3f} {'':>18} {'':>13}")
    for fmt in FORMATS:
        total = statistics.median(t["total"] for t in times[fmt])
        compute = statistics.median(t["server_compute"] for t in times[fmt])
        paired = statistics.median(t["total"] / t["server_compute"] for t in times[fmt])
        print(f"{fmt:<13} {total * 1000:>10.1f} {total / engine:>7.3f} {compute * 1000:>18.1f} {paired:>13.3f}")
    print(
        "ratio: HTTP round trip / the bare engine call in this process. paired ratio: each round trip / the engine "
        "time the server measured for that same request (removes the compute's run-to-run and process-to-process "
        f"variance). Media types: {wire.MEDIA_JSON}, {wire.MEDIA_NPY}, {wire.MEDIA_SAFETENSORS}."
    )


if __name__ == "__main__":
    main()
