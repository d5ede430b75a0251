"""Batch jobs: the kernel of the benchmark MLP on N examples, local executor vs Ray, symmetric vs full grid.

    .venv/bin/python benchmarks/bench_jobs.py                       # N = 4096, tiles of 256, local + Ray + full grid
    .venv/bin/python benchmarks/bench_jobs.py --n 1024 --no-full    # quicker
    .venv/bin/python benchmarks/bench_jobs.py --threads 1           # local tiles on 1 torch thread, as Ray's

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
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._models import make_inputs  # noqa: E402
from ntk_service.jobs import JobManager, JobStatus, LocalExecutor  # noqa: E402
from ntk_service.jobs.executors import Executor, RayExecutor  # noqa: E402
from ntk_service.registry import DatasetStore, ModelRegistry  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096, help="examples (N). Default: 4096")
    parser.add_argument("--tile-size", type=int, default=256, help="examples per tile side. Default: 256")
    parser.add_argument("--no-full", action="store_true", help="skip the full-grid (non-symmetric) local run")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    parser.add_argument("--mode", default="trace", help="kernel mode. Default: trace")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of the local executor. Default: all cores"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
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
