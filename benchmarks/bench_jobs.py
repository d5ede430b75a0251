"""Batch jobs at their floor (issue 27): panels against the one-block floor, measured in the same run.

    .venv/bin/python benchmarks/bench_jobs.py                          # N = 8192: every part below
    .venv/bin/python benchmarks/bench_jobs.py --n 20000 --only tiled,server
    .venv/bin/python benchmarks/bench_jobs.py --small                  # a quick check that everything runs
    .venv/bin/python benchmarks/bench_jobs.py --scale --n 20000        # a real server: job, streamed download, xarray

The floor: one ``block × block`` off-diagonal kernel of the model timed here (``compute_ntk``, best of ``--repeat``
after a warm-up), divided by its block² pairs and multiplied by the pairs the symmetric job computes (N·(N+1)/2),
timed just before and just after each path and averaged (the shared host's speed drifts by tens of per cent over
minutes). ``--rounds`` repeats the tiled and server runs. Each line prints wall time, its floor, wall / floor, and
CPU / floor CPU (user + system seconds of all threads of the process doing the work: this process, or the server's):
on a shared machine the CPU ratio is the signal, since load on other cores stretches wall time but barely moves CPU
time. ``cores`` is CPU seconds per wall second: on an idle machine, how many cores the path kept busy (the floor
keeps them all). The load average is on every line.

- ``tiled``: ``compute_ntk_tiled`` of the trace MLP 784-512-512-10 with panels from the cost model, and with a
  panel per tile (``panel_tiles=1``, what every job ran before panels).
- ``diag``: an in-process A/B of the diagonal panels (``DIAGONAL_SPLIT`` blocks against one ``x2=None`` call
  each): CPU and wall seconds over the job's diagonal panels, alternated, each with a fresh side cache.
- ``writes``: an in-process A/B of one panel's result writes (13² chunks with their ledger entries): plain files
  in place against through Zarr (a temporary file and a rename each), alternated, median ratio.
- ``server``: the same kernel as a job of a real ``ntk-service`` process (local executor), submit to succeeded,
  with the server's resident-memory high-water mark (``VmHWM``) during the job; ``server-tiles`` (not in the
  default set) the same job with a panel per tile, as every job ran before panels.
- ``cnn``: a CNN whose kernel is dominated by its contraction (``_contraction_cnn``: small spatial, wide channels;
  its per-pair time is nearly flat from blocks of 256 up, so one block's per-pair rate is a fair floor),
  ``compute_ntk_tiled`` against its floor. (The CNN of benchmarks/_models.py is dominated by its sides: a 256² block
  costs 2.9x a 768² block per pair, so a one-block floor says nothing about a job of it.)
- ``ray``: ``compute_ntk_tiled`` on a local Ray with two one-CPU actors (1 torch thread each) against the local
  executor with 2 torch threads: throughput ratio (issue: ≥ 0.9).
- ``bytes``: bytes shipped per Ray task: before (one task per tile: the pickled JobWork with the whole TilePlan and
  the Tile, and each task deserialized its own copy of x1, a torch tensor, and of the model) and after (a panel
  call: the reference list and the panel description; model, x1 and JobWork fetched once per actor per job, x1 as
  numpy, zero-copy).

Run it on an idle machine for numbers to quote; the load average is printed beside them.

``--scale`` starts ``ntk-service`` as its own process (local executor), uploads the data set once, runs the trace
job, then streams the whole result to a .npy file with ``client.download_result``; it reports the job's wall time,
the server's resident-memory high-water mark (``VmHWM``, reset through ``/proc/<pid>/clear_refs`` before each phase)
during the job and during the download, and checks a random 1000 × 1000 block read through xarray
(``open_result(...).to_xarray().isel``) against a direct ``compute_ntk`` of those rows.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import resource
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import xarray as xr
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._models import make_inputs, make_mlp  # noqa: E402
from ntk_service.client import Client  # noqa: E402
from ntk_service.jobs import plan_panels, plan_tiles  # noqa: E402
from ntk_service.jobs.executors import RayExecutor  # noqa: E402
from ntk_service.kernels import KernelMode, compute_ntk  # noqa: E402
from ntk_service.registry import ModelRegistry  # noqa: E402
from ntk_service.results import compute_ntk_tiled, open_result  # noqa: E402

MLP = {"family": "mlp", "input_dim": 784, "hidden": [512, 512], "output_dim": 10, "activation": "relu", "bias": True}


def _contraction_cnn(n: int) -> tuple[nn.Module, torch.Tensor]:
    """A CNN whose trace kernel is its contraction: (n, 16, 8, 8) -> conv 3x3 16->64 (6x6), ReLU, conv 3x3 64->64
    (4x4), ReLU, flatten, Linear 1024->10; 56,458 parameters. CPU time per pair, 1 thread (contended): 26.5 µs at
    256² blocks, 26.7 at 512², 22.1 at 1024² (the _models.py CNN: 18.8, 9.1, 6.5 at 256², 512², 768²)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(16, 64, 3), nn.ReLU(), nn.Conv2d(64, 64, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 4 * 4, 10)
    )
    return model, torch.randn(n, 16, 8, 8, generator=torch.Generator().manual_seed(1))


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


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_s() -> float:
    """This process's CPU seconds, user + system, all threads (a signal that load on other cores barely moves)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_cpu_s(pid: int) -> float:
    """Another process's CPU seconds, user + system (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Floor:
    """The floor of a symmetric job: wall and CPU seconds of the pairs it needs, at one block's rate per pair.

    The host's speed drifts by tens of per cent over minutes on the shared machine, so a path is compared with
    the floor timed just before and just after it (``around``), never with one timed minutes earlier.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, block: int, n: int, repeat: int) -> None:
        self.model, self.left, self.right = model, x[:block], x[block : 2 * block]
        self.repeat, self.scale = repeat, n * (n + 1) / 2 / (block * block)
        compute_ntk(model, self.left, self.right, mode="trace")  # warm-up: one-time imports and allocations
        self.wall, self.cpu = self.sample()

    def sample(self) -> tuple[float, float]:
        """(wall, CPU) seconds of the job's pairs at the block's rate now: the best of ``repeat`` timings."""
        runs = []
        for _ in range(self.repeat):
            cpu, wall = _cpu_s(), time.perf_counter()
            compute_ntk(self.model, self.left, self.right, mode="trace")
            runs.append((time.perf_counter() - wall, _cpu_s() - cpu))
        return min(r[0] for r in runs) * self.scale, min(r[1] for r in runs) * self.scale

    def around(self, run: Callable[[], Any]) -> tuple[Any, float, float]:
        """``run()``'s value and the floor's (wall, CPU) seconds: the mean of the samples just before and after it."""
        before = self.sample()
        value = run()
        after = self.sample()
        return value, (before[0] + after[0]) / 2, (before[1] + after[1]) / 2


def _tiled(model: nn.Module, x: torch.Tensor, tmp: Path, name: str, **options: Any) -> tuple[float, Any]:
    wall, _, view = _tiled_cpu(model, x, tmp, name, **options)
    return wall, view


def _tiled_cpu(model: nn.Module, x: torch.Tensor, tmp: Path, name: str, **options: Any) -> tuple[float, float, Any]:
    cpu, start = _cpu_s(), time.perf_counter()
    view = compute_ntk_tiled(model, x, out=tmp / f"{name}.zarr", mode="trace", progress=False, **options)
    return time.perf_counter() - start, _cpu_s() - cpu, view


def _line(name: str, wall: float, floor: float, extra: str = "", *, cpu: float = 0.0, floor_cpu: float = 0.0) -> None:
    cpu_ratio = f"{cpu / floor_cpu:>8.2f}x" if floor_cpu else f"{'':>9}"
    busy = f"{cpu / wall:>6.2f}" if cpu else f"{'':>6}"  # cores busy on average: CPU seconds per wall second
    print(f"{name:<58} {wall:>9.2f} {floor:>9.2f} {wall / floor:>8.2f}x {cpu_ratio} {busy}  {extra}")


def _server_job(
    n: int, tile_size: int, tmp: Path, panel_tiles: int | None = None
) -> tuple[float, float, int, int, int]:
    """A trace job of the MLP on a real server, its panels from the server's cost model or ``panel_tiles``: (wall s,
    the server's CPU s, panel_tiles, VmHWM KiB during the job, idle RSS KiB)."""
    data_dir = Path(tempfile.mkdtemp(prefix="server-data-", dir=tmp))  # a fresh one per round
    process, url = _start_server(data_dir)
    try:
        x = make_inputs("mlp", n).numpy()
        with Client(url, timeout=3600) as client:
            client.register_model("mlp", MLP, seed=0)
            dataset = client.upload_dataset(x)["id"]
            warm = client.upload_dataset(x[: 2 * tile_size])["id"]
            warm_job = client.submit_job("mlp", warm, mode="trace", tile_size=tile_size)
            client.wait(warm_job, progress=False)  # warm-up, not timed
            idle_kib = _proc_kib(process.pid, "VmRSS")
            _reset_high_water(process.pid)
            cpu, started = _proc_cpu_s(process.pid), time.perf_counter()
            submitted = client.submit_job("mlp", dataset, mode="trace", tile_size=tile_size, panel_tiles=panel_tiles)
            job = client.wait(submitted, progress=False)
            wall, cpu = time.perf_counter() - started, _proc_cpu_s(process.pid) - cpu
            if job["status"] != "succeeded":
                raise SystemExit(f"server job failed: {job['error']}")
            return wall, cpu, int(job["panel_tiles"]), _proc_kib(process.pid, "VmHWM"), idle_kib
    finally:
        process.terminate()
        process.wait(60)


def _bytes_per_task(model: nn.Module, x: torch.Tensor, tile_size: int) -> tuple[int, int, int]:
    """(before, after, once per actor per job) bytes of one Ray task's arguments, pickled (Ray's cloudpickle gives
    the same sizes for these importable classes)."""
    from ntk_service.jobs.executors.base import JobWork
    from ntk_service.jobs.records import JobSpec

    n = int(x.shape[0])
    plan = plan_tiles(n=n, m=None, tile_size=tile_size, mode=KernelMode.TRACE)
    spec = JobSpec(
        model="mlp", version=1, weights_sha256="0" * 64, x1_dataset="ds", x2_dataset=None, x1_sha256="0" * 64,
        x2_sha256=None, n=n, m=n, k=10, mode="trace", implementation="auto", dtype="float32", params=None,
        tile_size=tile_size, memory_budget_bytes=2**33, panel_tiles=8,
    )  # fmt: skip
    work = JobWork(job_id="0" * 32, spec=spec, plan=plan, result_path=Path("/shared/result.zarr"))
    model_bytes = len(pickle.dumps(model))
    # Before: a task per tile carried the JobWork and the Tile inline, and deserialized x1 (a torch tensor in the
    # object store: a copy per task) and the model (a copy per task).
    before = len(pickle.dumps((work, plan.tiles[1]))) + x.numel() * x.element_size() + model_bytes
    panel = plan_panels(plan, panel_tiles=8)[1]
    refs = ["0" * 32 + ":0", b"r" * 28, b"r" * 28, None, b"r" * 28]  # an ObjectRef pickles to its 28-byte id
    after = len(pickle.dumps((refs, panel, tuple(t.id for t in panel.tiles))))
    once = model_bytes + len(pickle.dumps(work)) + x.numel() * x.element_size()
    return before, after, once


_PARTS = {"tiled", "diag", "writes", "server", "server-tiles", "cnn", "ray", "bytes"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8192, help="examples of the MLP runs (N). Default: 8192")
    parser.add_argument("--block", type=int, default=2048, help="the floor's block side. Default: 2048")
    parser.add_argument("--tile-size", type=int, default=256, help="examples per tile side. Default: 256")
    parser.add_argument("--cnn-n", type=int, default=2048, help="examples of the CNN run. Default: 2048")
    parser.add_argument("--cnn-block", type=int, default=1024, help="the CNN floor's block side. Default: 1024")
    parser.add_argument("--ray-n", type=int, default=4096, help="examples of the Ray run. Default: 4096")
    parser.add_argument("--repeat", type=int, default=2, help="timings of the floor's block (best). Default: 2")
    parser.add_argument("--rounds", type=int, default=1, help="tiled and server runs, alternated. Default: 1")
    parser.add_argument("--only", default="tiled,diag,writes,server,cnn,ray,bytes", help="comma-separated parts to run")
    parser.add_argument("--small", action="store_true", help="a quick run: N = 1024, blocks of 256, tiles of 64")
    parser.add_argument("--scale", action="store_true", help="the data-set-scale scenario through a real server")
    parser.add_argument("--slice", type=int, default=1000, help="--scale: rows and columns of the checked block")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.scale:
        run_scale(args.n, args.tile_size, args.slice)
        return
    if args.small:
        args.n, args.block, args.tile_size, args.cnn_n, args.cnn_block, args.ray_n = 1024, 256, 64, 256, 64, 512
    parts = set(args.only.split(","))
    if unknown := parts - _PARTS:
        parser.error(f"--only: unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(sorted(_PARTS))}")
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    print(
        f"issue 27 ratios: N = {args.n}, floor block {args.block}, tiles of {args.tile_size}, {cores} cores, "
        f"load average {os.getloadavg()[0]:.1f} (before), torch {torch.__version__}"
    )
    print(f"\n{'run':<58} {'wall s':>9} {'floor s':>9} {'wall/fl':>9} {'cpu/fl':>9} {'cores':>6}")
    mlp, x = make_mlp(), make_inputs("mlp", args.n)
    with tempfile.TemporaryDirectory(dir=os.environ.get("NTK_BENCH_TMP")) as name:
        tmp = Path(name)
        floor = (
            _Floor(mlp, x, args.block, args.n, args.repeat)
            if parts & {"tiled", "server", "server-tiles", "diag"}
            else None
        )
        if floor is not None:
            print(f"{'floor: one ' + str(args.block) + '² block per pair x N(N+1)/2 pairs':<58} {'':>9} "
                  f"{floor.wall:>9.2f}   cpu {floor.cpu:.2f} s, cores {floor.cpu / floor.wall:.2f}, "
                  f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        for round_ in range(args.rounds):
            if "tiled" in parts and floor is not None:
                if round_ == 0:
                    _tiled(mlp, x[: 2 * args.tile_size], tmp, "warm", tile_size=args.tile_size)
                (wall, cpu, view), fl, fl_cpu = floor.around(
                    lambda r=round_: _tiled_cpu(mlp, x, tmp, f"panels-{r}", tile_size=args.tile_size)
                )
                panel = view.attrs["spec"]["panel_tiles"]
                load = f"(issue: ≤ 1.2x) load {os.getloadavg()[0]:.1f}"
                _line(f"compute_ntk_tiled, trace MLP, panels of {panel}² tiles", wall, fl, load, cpu=cpu,
                      floor_cpu=fl_cpu)  # fmt: skip
                (wall, cpu, _), fl, fl_cpu = floor.around(
                    lambda r=round_: _tiled_cpu(mlp, x, tmp, f"tiles-{r}", tile_size=args.tile_size, panel_tiles=1)
                )
                _line("compute_ntk_tiled, trace MLP, a panel per tile (before)", wall, fl,
                      f"load {os.getloadavg()[0]:.1f}", cpu=cpu, floor_cpu=fl_cpu)  # fmt: skip
            if "diag" in parts and floor is not None and round_ == 0:
                _diagonal_ab(mlp, x, args.tile_size, floor)
            if "writes" in parts and round_ == 0:
                _writes_ab(args.n, args.tile_size, tmp)
            # "server": panels from the server's cost model; "server-tiles": a panel per tile, as before panels.
            for part, panel_tiles in (("server", None), ("server-tiles", 1)):
                if part not in parts or floor is None:
                    continue
                (wall, cpu, panel, hwm_kib, idle_kib), fl, fl_cpu = floor.around(
                    lambda p=panel_tiles: _server_job(args.n, args.tile_size, tmp, panel_tiles=p)
                )
                memory = f"server RSS idle {idle_kib / 1024:.0f} MiB, high-water in the job {hwm_kib / 1024:.0f} MiB"
                issue = "(issue: ≤ 1.2x) " if panel_tiles is None else ""
                label = f"panels of {panel}² tiles" if panel_tiles is None else "a panel per tile (before)"
                _line(f"server job, trace MLP, {label}", wall, fl, f"{issue}{memory}, load {os.getloadavg()[0]:.1f}",
                      cpu=cpu, floor_cpu=fl_cpu)  # fmt: skip
        if "cnn" in parts:
            cnn, xc = _contraction_cnn(args.cnn_n)
            cnn_floor = _Floor(cnn, xc, args.cnn_block, args.cnn_n, args.repeat)
            _tiled(cnn, xc[: 2 * args.tile_size], tmp, "cnn-warm", tile_size=args.tile_size)
            (wall, cpu, view), fl, fl_cpu = cnn_floor.around(
                lambda: _tiled_cpu(cnn, xc, tmp, "cnn", tile_size=args.tile_size)
            )
            panel = view.attrs["spec"]["panel_tiles"]
            _line(f"compute_ntk_tiled, trace CNN N={args.cnn_n}, panels of {panel}²", wall, fl,
                  f"(≤ 1.1x) load {os.getloadavg()[0]:.1f}", cpu=cpu, floor_cpu=fl_cpu)  # fmt: skip
        if "ray" in parts:
            _ray(mlp, make_inputs("mlp", args.ray_n), tmp, args.tile_size)
        if "bytes" in parts:
            before, after, once = _bytes_per_task(mlp, x, args.tile_size)
            print(
                f"\nbytes per Ray task at N = {args.n}: before {before:,} (a task per tile), after {after:,} "
                f"(a panel call; {once:,} once per actor per job): {before / after:,.0f}x fewer"
            )
    print(f"\nload average {os.getloadavg()[0]:.1f} (after)")


def _writes_ab(n: int, tile_size: int, tmp: Path, panel_tiles: int = 13, pairs: int = 7) -> None:
    """In-process A/B of a panel's result writes: ``panel_tiles²`` float32 trace chunks and their ledger entries
    written as plain files (NOTE [raw chunk writes] in jobs/results.py) against through Zarr (a temporary file and
    a rename per chunk and per ledger entry, what every result was written with before), alternated, each pair
    into fresh results; the median of the per-pair ratios, and what the saving is over the job's tiles."""
    from ntk_service.jobs.results import ResultArray

    side = panel_tiles * tile_size
    plan = plan_tiles(n=side, m=side, tile_size=tile_size, mode=KernelMode.TRACE)
    block = np.random.default_rng(0).standard_normal((tile_size, tile_size)).astype(np.float32)
    blocks = [(tile, block) for tile in plan.tiles]
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for pair in range(pairs):
        for raw in (True, False) if pair % 2 == 0 else (False, True):
            path = tmp / f"writes-{pair}-{raw}.zarr"
            ResultArray.create(path, plan=plan, k=10, dtype="float32", attributes={})
            array = ResultArray.open(path, plan=plan, raw_writes=raw)
            seconds[raw].append(_timed(lambda array=array: array.write_tiles(blocks)))
    ratio = float(np.median([r / z for r, z in zip(seconds[True], seconds[False], strict=True)]))
    per_chunk = {raw: float(np.median(v)) / len(blocks) * 1e3 for raw, v in seconds.items()}
    job_tiles = len(plan_tiles(n=n, m=None, tile_size=tile_size, mode=KernelMode.TRACE).tiles)
    print(
        f"writes of a panel of {panel_tiles}² chunks of {tile_size}² float32 (A/B, {pairs} pairs): through Zarr "
        f"{per_chunk[False]:.2f} ms a chunk with its ledger entry, plain files {per_chunk[True]:.2f} ms: median "
        f"ratio {ratio:.2f}x; over the {job_tiles} tiles of N = {n}: {per_chunk[False] * job_tiles / 1e3:.2f} s "
        f"against {per_chunk[True] * job_tiles / 1e3:.2f} s, load {os.getloadavg()[0]:.1f}"
    )


def _diagonal_ab(model: nn.Module, x: torch.Tensor, tile_size: int, floor: _Floor) -> None:
    """In-process A/B of the diagonal panels (``DIAGONAL_SPLIT``): each computed whole (one ``x2=None`` call) and
    split, alternately, each with a fresh side cache; CPU and wall seconds summed over the job's diagonal panels."""
    from ntk_service.jobs.executors.base import JobWork, compute_panel
    from ntk_service.jobs.executors.local import LocalExecutor
    from ntk_service.jobs.panels import DIAGONAL_SPLIT
    from ntk_service.jobs.records import JobSpec
    from ntk_service.jobs.tiled import _panel_tiles
    from ntk_service.kernels import SideCache
    from ntk_service.kernels.types import NtkImplementation

    n = int(x.shape[0])
    plan = plan_tiles(n=n, m=None, tile_size=tile_size, mode=KernelMode.TRACE)
    budget = LocalExecutor().memory_budget()
    # The cost model's panel size, as compute_ntk_tiled picks it.
    pt = _panel_tiles(LocalExecutor(), model, x[:1], plan, 10, NtkImplementation.AUTO, None, "float32", budget, None)
    spec = JobSpec(
        model="mlp", version=1, weights_sha256="w", x1_dataset="ds", x2_dataset=None, x1_sha256="x",
        x2_sha256=None, n=n, m=n, k=10, mode="trace", implementation="auto", dtype="float32", params=None,
        tile_size=tile_size, memory_budget_bytes=budget, panel_tiles=pt,
    )  # fmt: skip
    totals = {1: [0.0, 0.0], DIAGONAL_SPLIT: [0.0, 0.0]}
    for split in (1, DIAGONAL_SPLIT, 1, DIAGONAL_SPLIT):
        work = JobWork(job_id="ab", spec=spec, plan=plan, result_path=Path("unused"), diagonal_split=split)
        cache = SideCache(max_bytes=2**31)
        for panel in (p for p in work.panels() if p.is_diagonal):
            cpu, wall = _cpu_s(), time.perf_counter()
            compute_panel(model, x, None, work, panel, side_cache=cache)
            totals[split][0] += (time.perf_counter() - wall) / 2
            totals[split][1] += (_cpu_s() - cpu) / 2
    (whole_wall, whole_cpu), (split_wall, split_cpu) = totals[1], totals[DIAGONAL_SPLIT]
    print(
        f"diagonal panels of {pt}² tiles (A/B, mean of 2 each): one call {whole_wall:.2f} s wall {whole_cpu:.2f} s "
        f"cpu, split in {DIAGONAL_SPLIT} {split_wall:.2f} s wall {split_cpu:.2f} s cpu: split/one = "
        f"{split_cpu / whole_cpu:.2f} cpu, {split_wall / whole_wall:.2f} wall (floor cpu {floor.cpu:.2f} s), "
        f"load {os.getloadavg()[0]:.1f}"
    )


def _ray_cpu_s() -> dict[str, float]:
    """CPU seconds, user + system, of this process's Ray descendants by kind: the panel actors and the rest (raylet,
    GCS, agents, idle workers). Linux ``/proc``; a process that exits between two readings drops out of the sum."""
    from ntk_service.jobs.executors.ray import _command, _descendants

    found = {"actors": 0.0, "ray": 0.0}
    for pid in _descendants(os.getpid()):
        command = _command(pid)
        try:
            seconds = _proc_cpu_s(pid)
        except (OSError, IndexError):
            continue  # exited meanwhile
        found["actors" if "PanelWorker" in command else "ray"] += seconds
    return found


def _ray(model: nn.Module, x: torch.Tensor, tmp: Path, tile_size: int, repeat: int = 3) -> None:
    """Local (2 torch threads) against Ray (two 1-CPU actors), alternated ``repeat`` times: L, R, R', L, R, R', ...

    R: Ray at its own panel size (the cost model asks ``PANELS_PER_WORKER`` panels per actor); R': Ray at the local
    run's panel size, which shows the tail of a few large panels on two actors. Each round starts its own local Ray
    (ray.init and the actors' start-up are not timed: a warm-up job runs first; a job's model set-up on the actors
    is timed) and shuts it down before the next local run, so no local run shares the machine with Ray's processes.
    Prints each run's wall and CPU seconds (driver; actors; the rest of Ray) and the median ratio of throughputs."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    _tiled(model, x[: 2 * tile_size], tmp, "ray-local-warm", tile_size=tile_size)
    print(f"\nRay, 2 actors x 1 thread vs local executor x 2 threads, N = {len(x)}, alternated {repeat} times:")
    ratios: dict[str, list[float]] = {"own": [], "local's": []}
    for round_ in range(repeat):
        local_wall, local_cpu, local = _tiled_cpu(model, x, tmp, f"ray-local-{round_}", tile_size=tile_size)
        panel = local.attrs["spec"]["panel_tiles"]
        print(f"  local, panels of {panel}²: {local_wall:.2f} s wall, {local_cpu:.2f} s cpu, "
              f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        try:
            executor = RayExecutor(num_cpus=1)  # two actors of one CPU (one torch thread) each
            _tiled(model, x[: 2 * tile_size], tmp, f"ray-warm-{round_}", tile_size=tile_size, executor=executor)
            for sizes, options in (("own", {}), ("local's", {"panel_tiles": panel})):
                before = _ray_cpu_s()
                wall, cpu, on_ray = _tiled_cpu(
                    model, x, tmp, f"ray-{sizes}-{round_}", tile_size=tile_size, executor=executor, **options
                )
                after = _ray_cpu_s()
                rel = np.abs(on_ray.to_numpy() - local.to_numpy()).max() / np.abs(local.to_numpy()).max()
                ratios[sizes].append(local_wall / wall)
                print(
                    f"  ray at {sizes} panel size ({on_ray.attrs['spec']['panel_tiles']}²): {wall:.2f} s wall, "
                    f"cpu {cpu:.2f} s driver + {after['actors'] - before['actors']:.2f} s actors + "
                    f"{after['ray'] - before['ray']:.2f} s rest of Ray; ratio ray/local {local_wall / wall:.2f}, "
                    f"max |ray - local| / max |theta| = {rel:.2g}, load {os.getloadavg()[0]:.1f}"
                )
            executor.close()
        finally:
            ray.shutdown()
    for sizes, values in ratios.items():
        print(f"  median throughput ratio ray/local, ray at {sizes} panel size: {float(np.median(values)):.2f} "
              f"(issue: ≥ 0.9) of {', '.join(f'{v:.2f}' for v in values)}")  # fmt: skip


if __name__ == "__main__":
    main()
