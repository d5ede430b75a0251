"""Rows of stored data sets, as the matrix-free kinds (solve, features) take them: the request value, the range
check, the one-row probe of the model, and the memory map a run reads chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ntk_service.errors import InvalidInput
from ntk_service.jobs.kinds.base import DatasetSource, ModelSource

__all__ = ["DataRows", "mapped_rows", "probe_model", "resolve_rows"]


@dataclass(frozen=True, slots=True)
class DataRows:
    """A stored data set, or the rows ``[start, stop)`` of it (None: from the first / to the last row)."""

    dataset: str
    start: int | None = None
    stop: int | None = None


def resolve_rows(datasets: DatasetSource, rows: DataRows, side: str, *, operation: str) -> tuple[int, int]:
    """``(start, stop)`` of ``rows`` inside its data set.

    Raises:
        DatasetNotFound: no such data set (404). InvalidInput: rows outside it (422).
    """
    size = int(datasets.get(rows.dataset).shape[0])
    lo = 0 if rows.start is None else int(rows.start)
    hi = size if rows.stop is None else int(rows.stop)
    if not 0 <= lo < hi <= size:
        raise InvalidInput(
            f"{operation}: {side} rows [{rows.start}, {rows.stop}) are outside the data set of {size} rows; expected "
            f"0 ≤ start < stop ≤ {size}"
        )
    return lo, hi


def probe_model(
    models: ModelSource, datasets: DatasetSource, model: str, version: int | None, dataset: str, row: int, *,
    operation: str,
) -> tuple[int, int]:  # fmt: skip
    """(the model version, k): the model run on one row, so a wrong data set is a 422 now, not a failed job.

    Raises:
        ModelNotFound (404). InvalidInput: the model fails on the row (422).
    """
    record, module = models.load_module(model, version)
    first = torch.from_numpy(np.ascontiguousarray(datasets.load(dataset, row, row + 1)))
    try:
        with torch.no_grad():
            own = next(iter(module.parameters()), torch.empty(0)).dtype  # the shared module is never cast
            out = module(first.to(own) if first.is_floating_point() else first)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise InvalidInput(
            f"{operation}: the model fails on the first row of data set {dataset!r}: {exc}; check that the data set "
            "matches the model's input shape and dtype"
        ) from exc
    return int(record.version), int(out.reshape(1, -1).shape[1])


def mapped_rows(datasets: DatasetSource, dataset: str, start: int, count: int) -> np.ndarray:
    """Rows ``[start, start + count)`` as a read-only memory map (read in chunks by the run)."""
    mapped: np.ndarray = np.load(datasets.path(dataset), mmap_mode="r", allow_pickle=False)
    return mapped[start : start + count]
