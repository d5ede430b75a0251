"""Write ``v1-data-dir.tar.gz``: a data directory produced by the job code of before issue 40 (two job frameworks:
``jobs/jobs.sqlite3`` for kernel jobs, ``jobs/solve_jobs.sqlite3`` for solve and features jobs), ending in a
SIGKILL with jobs of every kind queued or running. ``test_migration.py`` opens it with the current code.

This script talks to a real server over HTTP only (the client), so it runs against the code it is given. Run it with
the code of the last commit before the single job store (12f8780), never with the current code:

    git archive 12f8780 | (mkdir -p /tmp/v1 && tar -x -C /tmp/v1)
    cd /tmp/v1 && OMP_WAIT_POLICY=PASSIVE PYTHONPATH=/tmp/v1 <repo>/.venv/bin/python \\
        <repo>/tests/jobs/data/make_v1_data_dir.py <repo>/tests/jobs/data/v1-data-dir.tar.gz

What it holds (``manifest.json`` beside the data directory names every job):

- kernel jobs: ``trace`` (succeeded; its kernel in ``expected/trace.npy``), ``kept`` (succeeded, result deleted with
  the record kept), ``cancelled`` (cancelled while running), ``cut`` (running at the SIGKILL: some tiles done, maybe
  one claimed).
- solve jobs: ``ridge`` (succeeded; ``expected/ridge_alpha.npy``, ``expected/ridge_predictions.npy`` and its report
  in the manifest), ``cancelled_solve``, ``running_solve`` (running at the SIGKILL), ``queued_solve`` (queued).
- features jobs: ``phi`` (succeeded; ``expected/phi.npy``), ``queued_features`` (queued at the SIGKILL).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from ntk_service.client import Client

TINY_MLP = {"family": "mlp", "input_dim": 4, "hidden": [6], "output_dim": 3, "activation": "tanh", "bias": True}
SLOW = {
    "family": "factory",
    "factory": "tests.server.slow_factory:build",
    "kwargs": {"in_dim": 4, "out_dim": 3, "delay_s": 0.03},
    "input_shape": [4],
    "input_dtype": "float32",
}
"""Forward passes that sleep: a job stays running long enough to be cut by the SIGKILL."""
SLOW_SOLVE = {**SLOW, "kwargs": {**SLOW["kwargs"], "delay_s": 0.01}}  # type: ignore[dict-item]
WRITE_KEY = "write-key"
SERVE = "from ntk_service.config import Settings; from ntk_service.server import serve; serve(Settings())"


def _start(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NTK_")}
    env.update(
        NTK_HOST="127.0.0.1",
        NTK_PORT=str(port),
        NTK_DATA_DIR=str(data_dir),
        NTK_LOG_LEVEL="warning",
        NTK_MODEL_FACTORIES="tests.server.slow_factory:build",
        NTK_API_KEYS=f"read-key:read,{WRITE_KEY}:write",
        NTK_MEMORY_BUDGET_BYTES=str(64 * 2**20),
    )
    process = subprocess.Popen([sys.executable, "-c", SERVE], env=env, cwd=os.getcwd())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start")


def _until(check: object, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def main(out: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="v1-data-"))
    data_dir, expected = work / "data", work / "expected"
    expected.mkdir(parents=True)
    process, url = _start(data_dir)
    rng = np.random.default_rng(40)
    jobs: dict[str, dict[str, str]] = {}
    with Client(url, api_key=WRITE_KEY) as client:
        client.register_model("tiny", TINY_MLP, seed=0)
        client.register_model("slow", SLOW, seed=0)
        client.register_model("slow-solve", SLOW_SOLVE, seed=0)
        x = client.upload_dataset(rng.standard_normal((11, 4)).astype(np.float32))["id"]
        x2 = client.upload_dataset(rng.standard_normal((7, 4)).astype(np.float32))["id"]
        y = client.upload_dataset(rng.standard_normal((11, 3)))["id"]
        t = client.upload_dataset(rng.standard_normal((5, 4)).astype(np.float32))["id"]
        x8 = client.upload_dataset(rng.standard_normal((8, 4)).astype(np.float32))["id"]
        datasets = {"x": x, "x2": x2, "y": y, "t": t, "x8": x8}

        trace = client.wait(client.submit_job("tiny", x, mode="trace", tile_size=4), progress=False)
        np.save(expected / "trace.npy", client.job_result(trace["id"]))
        kept = client.wait(client.submit_job("tiny", x, x2, mode="full", tile_size=4), progress=False)
        client.delete_job(kept["id"], keep_record=True)
        cancelled = client.submit_job("slow", x8, mode="full", tile_size=2, panel_tiles=1)
        client.cancel_job(cancelled["id"])
        jobs["kernel"] = {"trace": trace["id"], "kept": kept["id"], "cancelled": cancelled["id"]}

        ridge = client.submit_solve_job("tiny", kind="kernel_ridge", train=x, targets=y, test=t, ridge=1e-2)
        ridge = client.wait_solve_job(ridge["id"], poll_s=0.05, timeout_s=120, progress=None)
        result = client.solve_job_result(ridge["id"])
        np.save(expected / "ridge_alpha.npy", result.alpha)
        np.save(expected / "ridge_predictions.npy", result.predictions)
        stopped = client.submit_solve_job("slow-solve", kind="kernel_ridge", train=x, targets=y, examples_per_chunk=1)
        client.cancel_solve_job(stopped["id"])
        client.wait_solve_job(stopped["id"], poll_s=0.05, timeout_s=120, progress=None)
        phi = client.submit_features_job("tiny", dataset=x, dim=8, seed=5, dtype="float64")
        client.wait_features_job(phi["id"], poll_s=0.05, timeout_s=120, progress=None)
        np.save(expected / "phi.npy", client.features_result(phi["id"]))

        # Cut by the SIGKILL: a solve running (and one queued behind it, then a features job), a kernel job running.
        running = client.submit_solve_job(
            "slow-solve", kind="kernel_ridge", train=x, targets=y, test=t, ridge=1e-2, max_iterations=6,
            examples_per_chunk=1, progress_every=2,
        )  # fmt: skip
        queued = client.submit_solve_job("tiny", kind="linearized", train=x, targets=y, test=t, ridge=1e-2)
        queued_features = client.submit_features_job("tiny", dataset=x, dim=8, seed=6, rows_per_chunk=4)
        cut = client.submit_job("slow", x8, mode="full", tile_size=2, panel_tiles=1)

        def cut_mid_job() -> bool:
            job = client.get_job(cut["id"])
            products = (client.solve_job(running["id"])["progress"] or {}).get("products", 0)
            return bool(job["tiles_done"] >= 3 and products >= 1)

        _until(cut_mid_job, "the kernel job and the solve to be under way")
        process.kill()  # SIGKILL: no shutdown code runs
        process.wait(10)
    jobs["kernel"]["cut"] = cut["id"]
    jobs["solve"] = {
        "ridge": ridge["id"],
        "cancelled_solve": stopped["id"],
        "running_solve": running["id"],
        "queued_solve": queued["id"],
    }
    jobs["features"] = {"phi": phi["id"], "queued_features": queued_features["id"]}
    manifest = {
        "made_by": "tests/jobs/data/make_v1_data_dir.py",
        "jobs": jobs,
        "datasets": datasets,
        "ridge_report": {key: value for key, value in vars(result).items() if key not in ("alpha", "predictions")},
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2))
    with tarfile.open(out, "w:gz") as tar:
        for name in ("data", "expected", "manifest.json"):
            tar.add(work / name, arcname=name)
    shutil.rmtree(work)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1]).absolute())
