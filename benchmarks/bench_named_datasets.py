"""Named-array data sets in one process, alternating: (1) ``DatasetStore.load`` of a row block of two named int64
arrays (``input_ids``, ``attention_mask``) against one array holding the same bytes, and (2) the submit-time ids
check (``first_out_of_range``, every row against a vocabulary, chunked through the memory map) against a plain
``np.load`` + min/max of the same array.

    .venv/bin/python benchmarks/bench_named_datasets.py                    # N = 200,000 rows of T = 128 ids
    .venv/bin/python benchmarks/bench_named_datasets.py --rows 20000 --repeats 3

Prints one table: median seconds per operation and the ratios side by side.
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

from ntk_service.registry import DatasetStore  # noqa: E402


def _median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--block", type=int, default=4096, help="rows per load (a job's panel side)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30_000, (args.rows, args.tokens)).astype(np.int64)
    mask = np.ones_like(ids)
    with tempfile.TemporaryDirectory() as tmp:
        store = DatasetStore(Path(tmp))
        named = store.create({"input_ids": ids, "attention_mask": mask}).id
        single = store.create(np.stack([ids, mask], axis=1)).id  # the same bytes as one (N, 2, T) array
        path = store.path(single)
        rows = (args.rows // 3, args.rows // 3 + args.block)
        results: dict[str, list[float]] = {k: [] for k in ("load named", "load single", "ids check", "np min/max")}
        for _ in range(args.repeats):  # alternating, so drift hits both sides alike
            results["load named"].append(_median(lambda: store.load(named, *rows), 1))
            results["load single"].append(_median(lambda: store.load(single, *rows), 1))
            results["ids check"].append(
                _median(lambda: store.first_out_of_range(named, "input_ids", 30_000, 0, args.rows), 1)
            )
            results["np min/max"].append(
                _median(lambda: (lambda a: (a[:, 0].min(), a[:, 0].max()))(np.load(path, mmap_mode="r")), 1)
            )
        store.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"N = {args.rows:,} rows x T = {args.tokens} int64 ids (+ mask); load block {args.block} rows; "
        f"{args.repeats} alternating repeats, medians"
    )
    print(f"{'operation':<14} {'seconds':>10}")
    for key, value in med.items():
        print(f"{key:<14} {value:>10.4f}")
    print(
        f"load named / single: {med['load named'] / med['load single']:.2f}x;  "
        f"ids check / np min-max: {med['ids check'] / med['np min/max']:.2f}x"
    )


if __name__ == "__main__":
    main()
