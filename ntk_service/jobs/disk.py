"""The disk side of job results: the budget a new job is checked against, and removing a result safely.

- **Budget.** With ``NTK_JOB_DISK_BUDGET_BYTES`` every stored result (finished or not, of every kind) counts at its
  estimate, which is exact for kernels (results are uncompressed) and an upper bound for the others (Φ is
  compressed), so deleting a result gives its bytes back. Without it a new job may take ``DISK_FREE_FRACTION`` of the
  free space less what unfinished jobs will still write (their tiles not done).
- **Removal.** A job's folder is first renamed to ``DELETING_PREFIX + id`` (atomic: no reader ever opens half of
  it), then removed; ``sweep_deletions`` finishes a removal a crash cut off.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ntk_service.errors import DiskEstimateExceeded, format_bytes
from ntk_service.jobs.kinds.base import Layout
from ntk_service.jobs.records import JobStatus
from ntk_service.jobs.store import JobStore

__all__ = [
    "DELETING_PREFIX",
    "DISK_FREE_FRACTION",
    "DiskUsage",
    "available_bytes",
    "check_fits",
    "move_aside",
    "stored_bytes",
    "sweep_deletions",
    "tree_bytes",
    "unwritten_bytes",
]

DISK_FREE_FRACTION = 0.9
"""Without an explicit disk budget a job may use 90% of the free space: the rest stays for the registry and logs."""

DELETING_PREFIX = ".deleting-"
"""A job folder being removed is first renamed to this prefix + its id."""


@dataclass(frozen=True, slots=True)
class DiskUsage:
    """The job results' share of the disk (``/metrics``).

    Attributes:
        used_bytes: what the stored results take (their estimates: exact, results are uncompressed), finished or not.
        budget_bytes: the configured budget (NTK_JOB_DISK_BUDGET_BYTES), or None (90% of the free space).
        available_bytes: what a new job may still take.
    """

    used_bytes: int
    budget_bytes: int | None
    available_bytes: int


def stored_bytes(store: JobStore) -> int:
    """Bytes every result still on disk takes at its full estimate (the unfinished ones will grow to it)."""
    return sum(r.estimate_bytes for r in store.list_jobs() if r.result_deleted_at is None)


def unwritten_bytes(store: JobStore) -> int:
    """Bytes the queued and running jobs will still write (their missing tiles)."""
    return sum(
        r.estimate_bytes * (r.tiles_total - r.tiles_done) // max(r.tiles_total, 1)
        for r in store.list_jobs(statuses=[JobStatus.QUEUED, JobStatus.RUNNING])
    )


def available_bytes(store: JobStore, results_dir: Path, budget_bytes: int | None) -> tuple[int, str]:
    """Bytes a new job may take, and where that limit comes from (for the message)."""
    if budget_bytes is not None:
        used = stored_bytes(store)
        source = "the disk budget (NTK_JOB_DISK_BUDGET_BYTES)"
        if used:
            source += f" of {format_bytes(budget_bytes)} less {format_bytes(used)} of stored results,"
        return max(0, budget_bytes - used), source
    # Unfinished jobs will still write their missing tiles: that space is already spoken for.
    reserved = unwritten_bytes(store)
    budget = max(0, int(shutil.disk_usage(results_dir).free * DISK_FREE_FRACTION) - reserved)
    source = f"{DISK_FREE_FRACTION:.0%} of the free space in {results_dir}"
    if reserved:
        source += f" less {format_bytes(reserved)} that unfinished jobs will still write,"
    return budget, source


def check_fits(layout: Layout, budget: int, source: str, operation: str) -> None:
    """Raises DiskEstimateExceeded (413, with the estimate and the budget) when a job's result does not fit
    ``budget`` (from ``available_bytes``, whose ``source`` says where that limit comes from)."""
    if layout.estimate_bytes > budget:
        raise DiskEstimateExceeded(
            f"{operation}: {layout.what} needs {format_bytes(layout.estimate_bytes)} on disk{layout.note}, more than "
            f"{source} of {format_bytes(budget)}; {layout.fix}",
            estimate_bytes=layout.estimate_bytes,
            budget_bytes=budget,
        )


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def move_aside(results_dir: Path, job_id: str) -> Path:
    """Rename the job's folder out of the way (atomic); returns where it went (which may not exist)."""
    job_dir, trash = results_dir / job_id, results_dir / f"{DELETING_PREFIX}{job_id}"
    if job_dir.exists():
        os.replace(job_dir, trash)
    return trash


def sweep_deletions(results_dir: Path) -> list[str]:
    """Remove folders a deletion had moved aside before a crash; returns their job ids."""
    ids = []
    for path in results_dir.glob(f"{DELETING_PREFIX}*"):
        ids.append(path.name.removeprefix(DELETING_PREFIX))
        shutil.rmtree(path, ignore_errors=True)
    return ids
