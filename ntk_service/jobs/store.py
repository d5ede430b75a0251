"""SQLite job and tile state (WAL mode, ``BEGIN IMMEDIATE`` for every write).

One file, ``<data_dir>/jobs/jobs.sqlite3``, two tables:

- ``jobs``: one row per job (spec as JSON, status, times, error, the implementation the tiles ran).
- ``tiles``: one row per planned tile: ``state`` pending | running | done, ``attempts`` (how many times a computation
  of the tile started: the compute count that proves no tile is computed twice needlessly), ``elapsed_s``.

A tile is ``done`` only after the executor has written its chunk and then called :meth:`JobStore.mark_tile_done`;
completion is never inferred from the Zarr store (an all-zero chunk is not stored at all). Every call opens its own
short connection, so the store is safe to share between threads; WAL keeps readers from blocking the writer. WAL
does not work on network filesystems: keep this file on a local disk even when the Zarr results live on a shared one.
See NOTE [resume] in ``manager.py`` for how ``running`` tiles are handled after a crash.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from ntk_service.errors import JobNotFound
from ntk_service.jobs.records import TERMINAL_STATUSES, JobRecord, JobSpec, JobStatus

__all__ = ["BUSY_TIMEOUT_S", "JobStore"]

BUSY_TIMEOUT_S = 30.0
"""How long a writer waits for the lock; tile writes are tiny, so only a stalled disk ever reaches this."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    executor TEXT NOT NULL,
    tiles_total INTEGER NOT NULL,
    result_shape TEXT NOT NULL,
    estimate_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    error TEXT,
    implementation_used TEXT,
    result_deleted_at REAL
);
CREATE TABLE IF NOT EXISTS tiles (
    job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    tile_id INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    elapsed_s REAL,
    finished_at REAL,
    PRIMARY KEY (job_id, tile_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tiles_by_state ON tiles (job_id, state);
"""

_JOB_COLUMNS = (
    "id, spec, status, executor, tiles_total, result_shape, estimate_bytes, created_at, started_at, finished_at, "
    "error, implementation_used, result_deleted_at, "
    "(SELECT COUNT(*) FROM tiles t WHERE t.job_id = jobs.id AND t.state = 'done')"
)


class JobStore:
    """Job and tile state in one SQLite file.

    Args:
        path (Path): the database file; its directory is created if missing.

    Examples:
        >>> store = JobStore(tmp_path / "jobs.sqlite3")          # doctest: +SKIP
        >>> store.create_job(record, tile_ids=[0, 1, 3])         # doctest: +SKIP
        >>> store.claim_tile(record.id, 0); store.mark_tile_done(record.id, 0, elapsed_s=0.1)  # doctest: +SKIP
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
            columns = {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}
            if "result_deleted_at" not in columns:  # a database from before result deletion existed
                conn.execute("ALTER TABLE jobs ADD COLUMN result_deleted_at REAL")

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        # NORMAL under WAL loses nothing when the process dies (only on power loss), and is far faster than FULL.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with closing(self._connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # -- jobs -------------------------------------------------------------------------------------------------------

    def create_job(self, record: JobRecord, *, tile_ids: Sequence[int]) -> None:
        """Insert a job and its pending tiles in one transaction (a crash leaves either both or neither)."""
        with self._write() as conn:
            conn.execute(
                "INSERT INTO jobs (id, spec, status, executor, tiles_total, result_shape, estimate_bytes, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    json.dumps(record.spec.to_dict()),
                    record.status.value,
                    record.executor,
                    record.tiles_total,
                    json.dumps(record.result_shape),
                    record.estimate_bytes,
                    record.created_at,
                ),
            )
            conn.executemany("INSERT INTO tiles (job_id, tile_id) VALUES (?, ?)", [(record.id, t) for t in tile_ids])

    def get_job(self, job_id: str) -> JobRecord:
        """The job's current record. Raises JobNotFound."""
        with closing(self._connect()) as conn:
            row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(f"jobs: no job with id {job_id!r}; list jobs with GET /v1/jobs")
        return _record(row)

    def list_jobs(self, *, statuses: Sequence[JobStatus] | None = None) -> list[JobRecord]:
        """All jobs, newest first, optionally only those with one of ``statuses``."""
        query = f"SELECT {_JOB_COLUMNS} FROM jobs"
        args: tuple[str, ...] = ()
        if statuses:
            query += f" WHERE status IN ({','.join('?' * len(statuses))})"
            args = tuple(s.value for s in statuses)
        with closing(self._connect()) as conn:
            rows = conn.execute(query + " ORDER BY created_at DESC, id", args).fetchall()
        return [_record(r) for r in rows]

    def set_status(
        self, job_id: str, status: JobStatus, *, error: str | None = None, only_from: Sequence[JobStatus] = ()
    ) -> bool:
        """Move a job to ``status`` unless it is already finished (or not in ``only_from``, when given).

        Sets ``started_at`` on the first RUNNING and ``finished_at`` on a terminal status.

        Returns:
            True when the row changed; False when the job was already finished or in another state.
        """
        allowed = [s.value for s in (only_from or [s for s in JobStatus if s not in TERMINAL_STATUSES])]
        now = time.time()
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE jobs SET status = ?, error = COALESCE(?, error),"
                " started_at = CASE WHEN ? = 'running' THEN COALESCE(started_at, ?) ELSE started_at END,"
                " finished_at = CASE WHEN ? THEN ? ELSE finished_at END"
                f" WHERE id = ? AND status IN ({','.join('?' * len(allowed))})",
                (status.value, error, status.value, now, status in TERMINAL_STATUSES, now, job_id, *allowed),
            )
            return cur.rowcount == 1

    def set_implementation_used(self, job_id: str, implementation: str) -> None:
        """Record the implementation the tiles run (AUTO resolved by the first tile)."""
        with self._write() as conn:
            conn.execute("UPDATE jobs SET implementation_used = ? WHERE id = ?", (implementation, job_id))

    def mark_result_deleted(self, job_id: str) -> bool:
        """Record that a job's result was removed (the record is kept). False if it already was (or no such job)."""
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE jobs SET result_deleted_at = ? WHERE id = ? AND result_deleted_at IS NULL",
                (time.time(), job_id),
            )
            return cur.rowcount == 1

    def delete_job(self, job_id: str) -> bool:
        """Remove a job and its tiles. Returns False when there was no such job."""
        with self._write() as conn:
            return conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount == 1

    # -- tiles ------------------------------------------------------------------------------------------------------

    def pending_tile_ids(self, job_id: str) -> list[int]:
        """Ids of tiles not done (pending or running), in id order."""
        with closing(self._connect()) as conn:
            rows = conn.execute(
                "SELECT tile_id FROM tiles WHERE job_id = ? AND state != 'done' ORDER BY tile_id", (job_id,)
            ).fetchall()
        return [r[0] for r in rows]

    def done_tile_ids(self, job_id: str) -> set[int]:
        """Ids of tiles whose chunk is written and recorded."""
        with closing(self._connect()) as conn:
            rows = conn.execute("SELECT tile_id FROM tiles WHERE job_id = ? AND state = 'done'", (job_id,)).fetchall()
        return {r[0] for r in rows}

    def claim_tile(self, job_id: str, tile_id: int) -> bool:
        """Mark a tile running and count the attempt. Returns False if it is already done (nothing to compute)."""
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE tiles SET state = 'running', attempts = attempts + 1"
                " WHERE job_id = ? AND tile_id = ? AND state != 'done'",
                (job_id, tile_id),
            )
            return cur.rowcount == 1

    def claim_tiles(self, job_id: str, tile_ids: Sequence[int]) -> list[int]:
        """Claim a panel's tiles in one transaction: mark those not done running and count their attempt.

        Args:
            job_id: the job. tile_ids: the panel's tile ids.

        Returns:
            The ids claimed (those not done), in the order given; empty when the whole panel is done.
        """
        if not tile_ids:
            return []
        marks = ",".join("?" * len(tile_ids))
        with self._write() as conn:
            rows = conn.execute(
                f"UPDATE tiles SET state = 'running', attempts = attempts + 1"
                f" WHERE job_id = ? AND tile_id IN ({marks}) AND state != 'done' RETURNING tile_id",
                (job_id, *tile_ids),
            ).fetchall()
        claimed = {r[0] for r in rows}
        return [t for t in tile_ids if t in claimed]

    def mark_tiles_done(self, job_id: str, tile_ids: Sequence[int], *, elapsed_s: float) -> None:
        """Record a panel's tiles as done in one transaction; call only after all their chunks are written.

        Args:
            job_id: the job. tile_ids: the tiles written. elapsed_s: the panel's compute seconds, shared out
                evenly over its tiles (so ``tile_seconds`` still sums to the compute time).
        """
        if not tile_ids:
            return
        share, now = elapsed_s / len(tile_ids), time.time()
        with self._write() as conn:
            conn.executemany(
                "UPDATE tiles SET state = 'done', elapsed_s = ?, finished_at = ? WHERE job_id = ? AND tile_id = ?",
                [(share, now, job_id, t) for t in tile_ids],
            )

    def mark_tile_done(self, job_id: str, tile_id: int, *, elapsed_s: float) -> None:
        """Record a tile as done; call only after its chunk is written."""
        with self._write() as conn:
            conn.execute(
                "UPDATE tiles SET state = 'done', elapsed_s = ?, finished_at = ? WHERE job_id = ? AND tile_id = ?",
                (elapsed_s, time.time(), job_id, tile_id),
            )

    def release_running_tiles(self, job_id: str, *, uncount: bool = False) -> int:
        """Put tiles left ``running`` (by a process that died or stopped) back to pending; returns how many.

        Args:
            job_id: the job. uncount: also take back the attempt their claim counted (a computation given up
                by a clean stop, NOTE [stop timeout] in manager.py). Default: False (a crash's tiles keep it).
        """
        attempts = ", attempts = MAX(attempts - 1, 0)" if uncount else ""
        with self._write() as conn:
            cur = conn.execute(
                f"UPDATE tiles SET state = 'pending'{attempts} WHERE job_id = ? AND state = 'running'", (job_id,)
            )
            return cur.rowcount

    def tile_attempts(self, job_id: str) -> dict[int, int]:
        """``{tile_id: attempts}``: how many times each tile's computation started."""
        with closing(self._connect()) as conn:
            rows = conn.execute("SELECT tile_id, attempts FROM tiles WHERE job_id = ?", (job_id,)).fetchall()
        return dict(rows)

    def tile_seconds(self, job_id: str) -> list[float]:
        """Compute seconds of each done tile (for throughput estimates)."""
        with closing(self._connect()) as conn:
            rows = conn.execute(
                "SELECT elapsed_s FROM tiles WHERE job_id = ? AND state = 'done' AND elapsed_s IS NOT NULL", (job_id,)
            ).fetchall()
        return [r[0] for r in rows]


def _record(row: sqlite3.Row | tuple[Any, ...]) -> JobRecord:
    (job_id, spec, status, executor, total, shape, estimate, created, started, finished, error, impl, deleted, done) = (
        row
    )
    return JobRecord(
        id=str(job_id),
        spec=JobSpec.from_dict(json.loads(spec)),
        status=JobStatus(status),
        tiles_done=int(done),
        tiles_total=int(total),
        created_at=float(created),
        started_at=None if started is None else float(started),
        finished_at=None if finished is None else float(finished),
        error=None if error is None else str(error),
        implementation_used=None if impl is None else str(impl),
        executor=str(executor),
        result_shape=[int(v) for v in json.loads(shape)],
        estimate_bytes=int(estimate),
        result_deleted_at=None if deleted is None else float(deleted),
    )
