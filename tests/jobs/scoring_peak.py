"""The measured peak memory of an attribution job's scoring, run in a fresh process (``python -m
tests.jobs.scoring_peak N M D C BUDGET FOLDER``): the steps of ``AttributionKind``'s run after the test features
(factor F + λI of each checkpoint, solve the test features, score the planned blocks of training rows into the
running top-k, the total and the self influence), reading the training sides and the test features from Zarr arrays
and F from a memory-mapped ``.npy``, as the job does. Prints one JSON line: the plan (``plan_scoring``) and the
resident-set high-water mark above the process's resident set before scoring (``VmHWM`` after resetting it through
``/proc/self/clear_refs``), so the planned estimate is compared with what the operating system counted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import zarr

from ntk_service.attribution import AttributionLoss, FeatureKind, fit_checkpoint
from ntk_service.attribution.answers import RunningTop
from ntk_service.attribution.features import TrainFeatures
from ntk_service.attribution.scoring import (
    score_train_rows,
    self_influence_scores,
    solve_targets,
    total_influence_scores,
)
from ntk_service.jobs.kinds.attribution import plan_scoring

TOP_K = 10


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _stores(folder: Path, n: int, m: int, dim: int, checkpoints: int) -> tuple[list[TrainFeatures], list[object]]:
    """Random training sides and test features written to Zarr (F = G'ᵀG' to a .npy), opened as the job opens
    them."""
    rng = np.random.default_rng(0)
    sides, tests = [], []
    for c in range(checkpoints):
        group = zarr.open_group(str(folder / f"c{c}.zarr"), mode="w")
        features = group.create_array("features", shape=(n, dim), chunks=(4096, dim), dtype="float32")
        gram = np.zeros((dim, dim))
        for start in range(0, n, 4096):
            block = rng.standard_normal((min(4096, n - start), dim), dtype=np.float32)
            features[start : start + len(block)] = block
            gram += block.T.astype(np.float64) @ block
        np.save(folder / f"gram{c}.npy", gram)
        test = group.create_array("test", shape=(m, dim), chunks=(min(m, 4096), dim), dtype="float32")
        test[:] = rng.standard_normal((m, dim), dtype=np.float32)
        sides.append(
            TrainFeatures(
                loss=AttributionLoss.CROSS_ENTROPY,
                kind=FeatureKind.STRUCTURED,
                seed=c,
                features=features,
                loss_weights=rng.random(n),
                gram=np.load(folder / f"gram{c}.npy", mmap_mode="r"),
                rows=n,
            )
        )
        tests.append(test)
    return sides, tests


def main(n: int, m: int, dim: int, checkpoints: int, budget: int, folder: Path) -> dict[str, int]:
    plan = plan_scoring(n, m, [dim] * checkpoints, top_k=TOP_K, budget_bytes=budget)
    sides, tests = _stores(folder, n, m, dim, checkpoints)
    torch.ones(64, 64) @ torch.ones(64, 64)  # the thread pool starts before the baseline
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    fitted = [fit_checkpoint(side, 0.3) for side in sides]
    solved = solve_targets(fitted, tests)
    running = RunningTop(n_test=m, n_train=n, k=TOP_K)
    for j0 in range(0, n, plan.train_rows):
        for tile in score_train_rows(fitted, solved, (j0, min(n, j0 + plan.train_rows))):
            running.add(tile)
    total_influence_scores(fitted, tests)  # type: ignore[arg-type]
    self_influence_scores(fitted)
    peak = _status_kib("VmHWM")
    return {"train_rows": plan.train_rows, "planned": plan.bytes, "measured": 1024 * (peak - before)}


if __name__ == "__main__":
    n, m, dim, c, budget = (int(v) for v in sys.argv[1:6])
    print(json.dumps(main(n, m, dim, c, budget, Path(sys.argv[6]))))
