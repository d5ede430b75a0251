"""The cost of HTTP over the bare engine call: an inline kernel's binary round trip against the library call plus
the transfer, and the fixed per-request cost, all alternating in one run.

A real uvicorn server (a subprocess on loopback, its side cache at the default size, so the bench also shows the
cache stays out of the way of inline inputs) and this process compute the same kernel, x1 and x2 inline
(N = M, default the benchmark MLP 784-512-512-10 at N = M = 64, full mode). Each round runs, in turn:

- ``engine``: ``compute_ntk(model, x1, x2)`` in this process (after ``retain_freed_memory``, as the server);
- ``wire``: the transfer's in-process share: encoding x1 and x2 as safetensors, decoding them, encoding theta and
  decoding it (what a round trip adds in bytes handled, without the socket);
- ``safetensors`` / ``npy``: the round trip (``npy`` sends x1 alone, x2 = x1, so it is a different kernel and
  compares with ``engine_sym``, the bare symmetric call);
- ``tiny``: a 2-example kernel over HTTP, whose round trip minus its server-measured compute and its wire time
  is the fixed per-request cost (HTTP on loopback, auth, the registry lookup, thread hops);
- ``transfer``: the bytes of theta over the same HTTP stack without a kernel: a GET of the weights of a
  one-hidden-layer "carrier" model registered with about theta's size (its time scaled to theta's bytes exactly),
  so one fixed per-request cost and the socket and HTTP framing of that many bytes, both ways' Python included.

The target (issue 18): the binary round trip within 1.15× of the library call plus the transfer, i.e.
round trip / (engine + wire + transfer). Medians over rounds; the machine is shared, so only the ratios of one run
mean much.

    .venv/bin/python benchmarks/bench_http.py                 # 15 rounds
    .venv/bin/python benchmarks/bench_http.py --rounds 7 --n 128 --hidden 128 128 --input-dim 32
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
from ntk_service.kernels import compute_ntk, retain_freed_memory  # noqa: E402
from tests.conftest import LiveServer, start_live_server  # noqa: E402
from tests.server.support import decode_theta, rebuild, request_kernel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=64, help="N = M examples. Default: 64.")
    parser.add_argument("--input-dim", type=int, default=784)
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 512])
    parser.add_argument("--rounds", type=int, default=15, help="Timed rounds (after one warm-up). Default: 15.")
    args = parser.parse_args()
    architecture = {
        "family": "mlp",
        "input_dim": args.input_dim,
        "hidden": args.hidden,
        "output_dim": 10,
        "activation": "relu",
    }
    with tempfile.TemporaryDirectory() as tmp:
        server = start_live_server(
            Path(tmp) / "data",
            max_json_response_bytes=str(1024 * 2**20),
            max_body_bytes=str(1024 * 2**20),
            compute_concurrency="1",
        )
        try:
            run(server, architecture, n=args.n, rounds=args.rounds)
        finally:
            server.stop()


def _wire_time(x1: np.ndarray, x2: np.ndarray | None, theta: np.ndarray) -> float:
    """Seconds to encode and decode the request's tensors and the response's theta (safetensors)."""
    start = time.perf_counter()
    tensors = {"x1": x1} if x2 is None else {"x1": x1, "x2": x2}
    wire.decode_safetensors(wire.encode_safetensors(tensors))
    wire.decode_safetensors(wire.encode_safetensors({"theta": theta}, {"mode": "full"}))
    return time.perf_counter() - start


def run(server: LiveServer, architecture: dict[str, object], *, n: int, rounds: int) -> None:
    client = server.client("write", timeout=600.0)
    record = client.post("/v1/models", json={"name": "bench", "architecture": architecture}).json()
    model = rebuild(record, client.get("/v1/models/bench/versions/1/weights").content)
    torch.set_num_threads(2)  # the server's count on this machine: cores // compute_concurrency
    retain_freed_memory()  # as the server's warm_up
    rng = np.random.default_rng(0)
    dim = int(architecture["input_dim"])  # type: ignore[call-overload]

    def fresh(rows: int) -> np.ndarray:
        return rng.standard_normal((rows, dim)).astype(np.float32)

    theta_bytes = n * n * 100 * 4
    width = max(1, round(theta_bytes / 4 / (dim + 1 + 10)))  # 784-width-10: (dim + 1 + 10)·width + 10 floats
    carrier = {"family": "mlp", "input_dim": dim, "hidden": [width], "output_dim": 10, "activation": "relu"}
    assert client.post("/v1/models", json={"name": "carrier", "architecture": carrier}).status_code == 201

    def engine() -> dict[str, float]:
        x1, x2 = torch.from_numpy(fresh(n)), torch.from_numpy(fresh(n))
        start = time.perf_counter()
        compute_ntk(model, x1, x2)
        return {"total": time.perf_counter() - start}

    def engine_sym() -> dict[str, float]:
        x1 = torch.from_numpy(fresh(n))
        start = time.perf_counter()
        compute_ntk(model, x1)
        return {"total": time.perf_counter() - start}

    def transfer() -> dict[str, float]:
        return {"total": _wire_time(fresh(n), fresh(n), np.zeros((n, n, 10, 10), np.float32))}

    def over_http(fmt: str, rows: int) -> Callable[[], dict[str, float]]:
        def call() -> dict[str, float]:
            x1 = fresh(rows)
            x2 = None if fmt == "npy" else fresh(rows)
            start = time.perf_counter()
            theta, meta = decode_theta(request_kernel(client, "bench", x1, x2, fmt=fmt))
            total = time.perf_counter() - start
            assert theta.shape == (rows, rows, 10, 10)
            out = {"total": total, "server_compute": float(meta["elapsed_ms"]) / 1000}
            if rows != n:
                out["wire"] = _wire_time(x1, x2, theta)
            return out

        return call

    def transfer_over_http() -> dict[str, float]:
        start = time.perf_counter()
        body = client.get("/v1/models/carrier/versions/1/weights").content
        return {"total": (time.perf_counter() - start) * theta_bytes / len(body)}

    variants: dict[str, Callable[[], dict[str, float]]] = {
        "engine": engine,
        "safetensors": over_http("safetensors", n),
        "wire": transfer,
        "engine_sym": engine_sym,
        "npy": over_http("npy", n),
        "tiny": over_http("safetensors", 2),
        "transfer": transfer_over_http,
    }
    for call in variants.values():  # warm-up
        call()
    times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            times[name].append(call())
    client.close()

    def med(name: str, field: str = "total") -> float:
        return statistics.median(t[field] for t in times[name])

    hidden = "-".join(str(h) for h in architecture["hidden"])  # type: ignore[attr-defined]
    print(
        f"MLP {dim}-{hidden}-10, N = M = {n}, full mode, theta {theta_bytes / 1e6:.1f} MB float32, x1 and x2 inline, "
        f"median of {rounds} alternating rounds, torch threads {torch.get_num_threads()}, server side cache on"
    )
    engine_s, wire_s, http_s, transfer_s = med("engine"), med("wire"), med("safetensors"), med("transfer")
    fixed = statistics.median(t["total"] - t["server_compute"] - t["wire"] for t in times["tiny"])
    print(f"{'variant':<34} {'median ms':>10}")
    rows = [
        ("engine: compute_ntk(x1, x2)", engine_s),
        ("wire: safetensors codec of x1, x2, theta", wire_s),
        ("safetensors round trip (x1, x2)", http_s),
        ("  its server-measured compute", med("safetensors", "server_compute")),
        ("engine_sym: compute_ntk(x1)", med("engine_sym")),
        (".npy round trip (x1 only)", med("npy")),
        ("tiny (N = M = 2) round trip", med("tiny")),
        ("fixed per-request cost", fixed),
        ("transfer: theta's bytes over HTTP", transfer_s),
    ]
    for label, seconds in rows:
        print(f"{label:<34} {seconds * 1000:>10.2f}")
    ratio = http_s / (engine_s + wire_s + transfer_s)
    print(f"round trip / (engine + wire + transfer): {ratio:.3f}   (target <= 1.15)")
    print(f"round trip / (engine + wire):            {http_s / (engine_s + wire_s):.3f}")
    print(f"round trip / (engine + wire + fixed):    {http_s / (engine_s + wire_s + fixed):.3f}")
    print(f"server compute / engine:            {med('safetensors', 'server_compute') / engine_s:.3f}")
    print(f".npy round trip / engine_sym:       {med('npy') / med('engine_sym'):.3f}")


if __name__ == "__main__":
    main()
