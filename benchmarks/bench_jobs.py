"""Batch jobs: the kernel of the benchmark MLP on N examples, local executor vs Ray, symmetric vs full grid; and a
data-set-scale job through a real server (``--scale``).

    .venv/bin/python benchmarks/bench_jobs.py                       # N = 4096, tiles of 256, local + Ray + full grid
    .venv/bin/python benchmarks/bench_jobs.py --n 1024 --no-full    # quicker
    .venv/bin/python benchmarks/bench_jobs.py --threads 1           # local tiles on 1 torch thread, as Ray's
    .venv/bin/python benchmarks/bench_jobs.py --scale --n 20000     # a real server: job, streamed download, xarray

``--scale`` starts ``ntk-service`` as its own process (local executor), uploads the data set once, runs the trace
job, then streams the whole result to a .npy file with ``client.download_result``; it reports the job's wall time
against (median tile time × tiles), the server's resident-memory high-water mark (``VmHWM``, reset through
``/proc/<pid>/clear_refs`` before each phase) during the job and during the download, and checks a random
1000 × 1000 block read through xarray (``open_result(...).to_xarray().isel``) against a direct ``compute_ntk`` of
those rows.

Runs in one process, side by side, on a temporary data directory (a real ModelRegistry, DatasetStore, JobStore and
Zarr arrays): the MLP 784-512-512-10 (ReLU) of benchmarks/_models.py registered as a built-in family, standard-normal
inputs. Reported per run: tiles, wall time from submission to success, tiles/s, and the sum of per-tile compute
seconds. Ratios: full grid (x2 given as a second data set with the same rows) over symmetric (x2 omitted, only
tiles on/above the diagonal), and Ray over local. Local and Ray results are compared (max |difference|).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import xarray as xr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._models import make_inputs  # noqa: E402
from ntk_service.client import Client  # noqa: E402
from ntk_service.jobs import JobManager, JobStatus, LocalExecutor  # noqa: E402
from ntk_service.jobs.executors import Executor, RayExecutor  # noqa: E402
from ntk_service.kernels import compute_ntk  # noqa: E402
from ntk_service.registry import DatasetStore, ModelRegistry  # noqa: E402
from ntk_service.results import open_result  # noqa: E402

MLP = {"family": "mlp", "input_dim": 784, "hidden": [512, 512], "output_dim": 10, "activation": "relu", "bias": True}


def run_job(
    data_dir: Path, registry: ModelRegistry, datasets: DatasetStore, executor: Executor, **job: object
) -> tuple[dict[str, float], np.ndarray]:
    manager = JobManager(data_dir=data_dir, models=registry, datasets=datasets, executor=executor)
    manager.start()
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        record = manager.submit(**job)  # type: ignore[arg-type]
        while not (record := manager.get(record.id)).is_finished:
            time.sleep(0.05)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if record.status is not JobStatus.SUCCEEDED:
            raise SystemExit(f"job failed: {record.error}")
        theta = manager.read_result(record.id)
        stats = {
            "tiles": record.tiles_total,
            "wall_s": wall,
            "tiles_per_s": record.tiles_total / wall,
            "tile_compute_s": sum(manager.store.tile_seconds(record.id)),
            "cpu_s": cpu,
        }
        return stats, theta
    finally:
        manager.stop()


def _proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def _reset_high_water(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # Linux: VmHWM := current RSS


def _start_server(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NTK_")}
    env.update(NTK_DATA_DIR=str(data_dir), NTK_PORT=str(port), NTK_LOG_LEVEL="warning")
    serve = "from ntk_service.config import Settings; from ntk_service.server import serve; serve(Settings())"
    log = (data_dir.parent / "server.log").open("wb")
    process = subprocess.Popen([sys.executable, "-c", serve], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.3)
    process.kill()
    raise SystemExit(f"server did not start; see {data_dir.parent / 'server.log'}")


def run_scale(n: int, tile_size: int, slice_size: int) -> None:
    """The data-set-scale scenario (``--scale``): see the module docstring."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("NTK_BENCH_TMP")) as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        process, url = _start_server(data_dir)
        try:
            _scale(process.pid, url, data_dir, Path(tmp), n, tile_size, slice_size)
        finally:
            process.terminate()
            process.wait(60)


def _scale(pid: int, url: str, data_dir: Path, tmp: Path, n: int, tile_size: int, slice_size: int) -> None:
    x = make_inputs("mlp", n).numpy()
    with Client(url, timeout=3600) as client:
        client.register_model("mlp", MLP, seed=0)
        dataset = client.upload_dataset(x)["id"]  # uploaded once; the job reads it from the server's store
        idle_kib = _proc_kib(pid, "VmRSS")
        _reset_high_water(pid)
        started = time.perf_counter()
        job = client.submit_job("mlp", dataset, mode="trace", tile_size=tile_size)
        job = client.wait(job, progress=sys.stderr.isatty())
        job_s = time.perf_counter() - started
        job_hwm_kib = _proc_kib(pid, "VmHWM")
        with sqlite3.connect(f"file:{data_dir / 'jobs' / 'jobs.sqlite3'}?mode=ro", uri=True) as conn:
            tile_s = [r[0] for r in conn.execute("SELECT elapsed_s FROM tiles WHERE job_id = ?", (job["id"],))]
        before_download_kib = _proc_kib(pid, "VmRSS")
        _reset_high_water(pid)
        started = time.perf_counter()
        on_disk = client.download_result(job, tmp / "theta.npy")
        download_s = time.perf_counter() - started
        download_hwm_kib = _proc_kib(pid, "VmHWM")
    result_bytes = on_disk.size * on_disk.itemsize
    # The same rows computed directly, here (the server's registry rebuilds the same seeded weights).
    registry = ModelRegistry(data_dir)
    _, model = registry.load_module("mlp")
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(n, size=min(slice_size, n), replace=False))
    cols = np.sort(rng.choice(n, size=min(slice_size, n), replace=False))
    started = time.perf_counter()
    raw = xr.open_zarr(data_dir / "jobs" / job["id"] / "result.zarr")  # opens as any xarray user would
    theta = open_result(data_dir / "jobs" / job["id"]).to_xarray()  # the same, mirrored below the diagonal
    block = theta.isel(x1=rows, x2=cols).values
    xarray_s = time.perf_counter() - started
    direct = compute_ntk(model, torch.from_numpy(x[rows]), torch.from_numpy(x[cols]), mode="trace").theta.numpy()
    one_tile_started = time.perf_counter()
    compute_ntk(model, torch.from_numpy(x[:tile_size]), torch.from_numpy(x[tile_size : 2 * tile_size]), mode="trace")
    one_tile_here_s = time.perf_counter() - one_tile_started
    registry.close()
    rel = float(np.abs(block - direct).max() / np.abs(direct).max())
    median_tile = float(np.median(tile_s))
    tiles = len(tile_s)
    print(
        f"\ntrace kernel, MLP 784-512-512-10, N = {n}, tiles of {tile_size}: {tiles} tiles (symmetric), "
        f"result {on_disk.shape} {on_disk.dtype} = {result_bytes / 2**30:.2f} GiB downloaded, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'quantity':<58} {'value':>14}")
    for name, value in (
        ("job wall time, submit to succeeded (s)", f"{job_s:.1f}"),
        ("median tile time in the job (s)", f"{median_tile:.3f}"),
        ("median tile x tiles (s)", f"{median_tile * tiles:.1f}"),
        ("sum of tile times (s)", f"{sum(tile_s):.1f}"),
        ("job wall / (median tile x tiles)", f"{job_s / (median_tile * tiles):.2f}"),
        ("one off-diagonal tile timed in this process (s)", f"{one_tile_here_s:.3f}"),
        ("server RSS idle, data set uploaded (MiB)", f"{idle_kib / 1024:.0f}"),
        ("server RSS high-water during the job (MiB)", f"{job_hwm_kib / 1024:.0f}"),
        ("server RSS before the download (MiB)", f"{before_download_kib / 1024:.0f}"),
        ("server RSS high-water during the streamed download (MiB)", f"{download_hwm_kib / 1024:.0f}"),
        ("download rate (MiB/s)", f"{result_bytes / 2**20 / download_s:.0f}"),
        (f"xarray open + random {len(rows)}x{len(cols)} isel (s)", f"{xarray_s:.2f}"),
        ("max |xarray block - compute_ntk| / max |compute_ntk|", f"{rel:.2g}"),
        ("xarray block equals the downloaded file (bitwise)", str(np.array_equal(block, on_disk[np.ix_(rows, cols)]))),
    ):
        print(f"{name:<58} {value:>14}")
    print(f"raw xarray.open_zarr: {dict(raw.sizes)}, attrs format_version={raw.attrs['format_version']}")
    if not np.allclose(block, direct, rtol=1e-4, atol=1e-5 * float(np.abs(direct).max())):
        raise SystemExit("the xarray block differs from compute_ntk beyond float32 tolerance")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096, help="examples (N). Default: 4096")
    parser.add_argument("--tile-size", type=int, default=256, help="examples per tile side. Default: 256")
    parser.add_argument("--no-full", action="store_true", help="skip the full-grid (non-symmetric) local run")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    parser.add_argument("--mode", default="trace", help="kernel mode. Default: trace")
    parser.add_argument("--scale", action="store_true", help="the data-set-scale scenario through a real server")
    parser.add_argument("--slice", type=int, default=1000, help="--scale: rows and columns of the checked block")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of the local executor. Default: all cores"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.scale:
        run_scale(args.n, args.tile_size, args.slice)
        return
    cores = os.cpu_count() or 1
    torch.set_num_threads(args.threads or cores)
    print(
        f"{args.mode} kernel, MLP 784-512-512-10, N = {args.n}, tiles of {args.tile_size}, {cores} cores "
        f"(load average {os.getloadavg()[0]:.1f}), torch {torch.__version__}, local executor with "
        f"{torch.get_num_threads()} torch thread(s), Ray tasks with 1"
    )
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        registry, datasets = ModelRegistry(data_dir), DatasetStore(data_dir)
        registry.register("mlp", MLP, seed=0)
        x = make_inputs("mlp", args.n).numpy()
        x1 = datasets.create(x).id
        x1_again = datasets.create(x.copy()).id  # the same rows as a second data set: the full grid is computed
        job = {"model": "mlp", "x1_dataset": x1, "mode": args.mode, "tile_size": args.tile_size}
        warmup = {**job, "x1_dataset": datasets.create(x[: 2 * args.tile_size]).id}
        # Not timed: the first kernel in a process pays one-time imports and allocations.
        run_job(data_dir, registry, datasets, LocalExecutor(), **warmup)
        runs: dict[str, dict[str, float]] = {}
        runs["local, symmetric"], theta_local = run_job(data_dir, registry, datasets, LocalExecutor(), **job)
        if not args.no_full:
            runs["local, full grid"], theta_full = run_job(
                data_dir, registry, datasets, LocalExecutor(), **job, x2_dataset=x1_again
            )
        if not args.no_ray:
            import ray

            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            started = time.perf_counter()
            ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
            executor = RayExecutor(num_cpus=1)
            run_job(data_dir, registry, datasets, executor, **warmup)  # starts and warms the workers
            print(f"ray.init and worker warm-up: {time.perf_counter() - started:.1f} s (not counted below)")
            runs[f"ray ({cores} tasks x 1 thread), symmetric"], theta_ray = run_job(
                data_dir, registry, datasets, executor, **job
            )
            ray.shutdown()
        # cpu s: CPU seconds of this process (the local executor's work; for Ray only the driver's share).
        print(f"\n{'run':<40} {'tiles':>6} {'wall s':>9} {'tiles/s':>9} {'tile compute s':>15} {'cpu s':>8}")
        for name, stats in runs.items():
            print(
                f"{name:<40} {stats['tiles']:>6.0f} {stats['wall_s']:>9.1f} {stats['tiles_per_s']:>9.3f} "
                f"{stats['tile_compute_s']:>15.1f} {stats['cpu_s']:>8.1f}"
            )
        sym = runs["local, symmetric"]
        if "local, full grid" in runs:
            full = runs["local, full grid"]
            print(
                f"\nsymmetric saving: {full['tiles'] / sym['tiles']:.2f}x fewer tiles, "
                f"{full['wall_s'] / sym['wall_s']:.2f}x less wall time, "
                f"{full['cpu_s'] / sym['cpu_s']:.2f}x less CPU time "
                f"(max |full - symmetric| = {np.abs(theta_full - theta_local).max():.3g})"
            )
        ray_runs = [name for name in runs if name.startswith("ray")]
        if ray_runs:
            ray_stats = runs[ray_runs[0]]
            rel = np.abs(theta_ray - theta_local).max() / np.abs(theta_local).max()
            print(
                f"ray / local wall time: {ray_stats['wall_s'] / sym['wall_s']:.2f} "
                f"(max |ray - local| / max |theta| = {rel:.2g}; bitwise equal: "
                f"{np.array_equal(theta_ray, theta_local)}, float32 sums may differ with 1 vs "
                f"{torch.get_num_threads()} torch threads per tile)"
            )
        registry.close()
        datasets.close()


if __name__ == "__main__":
    main()
