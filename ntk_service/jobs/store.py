"""The one SQLite store of jobs of every kind, and their tiles (WAL mode, ``BEGIN IMMEDIATE`` for every write).

One file, ``<data_dir>/jobs/jobs.sqlite3``, two tables:

- ``jobs``: one row per job: its kind, its spec, checkpoint and result as JSON, status, times, error, what the
  engine's AUTO choices resolved to.
- ``tiles``: one row per planned tile (the units a job records as done: a kernel's tiles, a chunk of features'
  rows, a solve's solution): ``state`` pending | running | done, ``attempts`` (how many times a computation of the
  tile started: the compute count that proves no tile is computed twice needlessly), ``elapsed_s``.

Records come out typed: each kind (``jobs/kinds``) turns its spec, checkpoint and result into JSON and back, here
and only here. A tile is ``done`` only after what it stands for is written and then ``mark_tiles_done`` is called;
completion is never inferred from the files (an all-zero chunk is not stored at all). Every call opens its own short
connection, so the store is safe to share between threads; WAL keeps readers from blocking the writer. WAL does not
work on network filesystems: keep this file on a local disk even when the results live on a shared one. See NOTE
[resume] in ``manager.py`` for how ``running`` tiles are handled after a crash, and ``migrations.py`` for the stores
of earlier versions this one opens.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from ntk_service.errors import JobNotFound
from ntk_service.jobs.kinds import JOB_KINDS
from ntk_service.jobs.kinds.base import JobKind
from ntk_service.jobs.migrations import migrate_schema
from ntk_service.jobs.records import TERMINAL_STATUSES, JobRecord, JobStatus

__all__ = ["BUSY_TIMEOUT_S", "JOBS_DB", "JobStore"]

BUSY_TIMEOUT_S = 30.0
"""How long a writer waits for the lock; tile writes are tiny, so only a stalled disk ever reaches this."""

JOBS_DB = "jobs.sqlite3"
"""The store's file name in ``<data_dir>/jobs``."""

_JOB_COLUMNS = (
    "id, kind, spec, status, executor, tiles_total, result_shape, estimate_bytes, created_at, started_at, "
    "finished_at, error, implementation_used, result_deleted_at, checkpoint, result, "
    "(SELECT COUNT(*) FROM tiles t WHERE t.job_id = jobs.id AND t.state = 'done')"
)


class JobStore:
    """Jobs of every kind and their tiles in one SQLite file.

    Args:
        path (Path): the database file; its directory is created if missing. A file of an earlier version is
            brought up to this one in place (``migrations.migrate_schema``).
        kinds (Mapping[str, JobKind]): how each kind's values are stored, by kind name. Default: ``JOB_KINDS``.

    Examples:
        >>> store = JobStore(tmp_path / "jobs.sqlite3")          # doctest: +SKIP
        >>> store.create_job(record, tile_ids=[0, 1, 3])         # doctest: +SKIP
        >>> store.claim_tiles(record.id, [0]); store.mark_tiles_done(record.id, [0], elapsed_s=0.1)  # doctest: +SKIP
    """

    def __init__(self, path: Path, *, kinds: Mapping[str, JobKind[Any, Any, Any, Any]] = JOB_KINDS) -> None:
        self.path = Path(path)
        self.kinds = kinds
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            migrate_schema(conn)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        # NORMAL under WAL loses nothing when the process dies (only on power loss), and is far faster than FULL.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A connection inside ``BEGIN IMMEDIATE`` … ``COMMIT`` (rolled back on any exception)."""
        with closing(self._connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def kind(self, name: str) -> JobKind[Any, Any, Any, Any]:
        """The kind named ``name``. Raises JobNotFound for a kind this version does not know."""
        kind = self.kinds.get(name)
        if kind is None:
            raise JobNotFound(
                f"jobs: the store holds a job of kind {name!r}, which this version does not know ({sorted(self.kinds)})"
            )
        return kind

    # -- jobs -------------------------------------------------------------------------------------------------------

    def create_job(self, record: JobRecord[Any, Any, Any], *, tile_ids: Sequence[int]) -> None:
        """Insert a job and its pending tiles in one transaction (a crash leaves either both or neither)."""
        kind = self.kind(record.kind)
        with self.transaction() as conn:
            conn.execute(
                "INSERT INTO jobs (id, kind, spec, status, executor, tiles_total, result_shape, estimate_bytes,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.kind,
                    json.dumps(kind.encode_spec(record.spec)),
                    record.status.value,
                    record.executor,
                    record.tiles_total,
                    json.dumps(record.result_shape),
                    record.estimate_bytes,
                    record.created_at,
                ),
            )
            conn.executemany("INSERT INTO tiles (job_id, tile_id) VALUES (?, ?)", [(record.id, t) for t in tile_ids])

    def get_job(self, job_id: str) -> JobRecord[Any, Any, Any]:
        """The job's current record. Raises JobNotFound."""
        with closing(self._connect()) as conn:
            row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(f"jobs: no job with id {job_id!r}; list jobs with GET /v1/jobs")
        return self._record(row)

    def list_jobs(
        self, *, statuses: Sequence[JobStatus] | None = None, kind: str | None = None
    ) -> list[JobRecord[Any, Any, Any]]:
        """All jobs (of ``kind``, when given), newest first, optionally only those with one of ``statuses``."""
        where, args = [], []
        if statuses:
            where.append(f"status IN ({','.join('?' * len(statuses))})")
            args += [s.value for s in statuses]
        if kind is not None:
            where.append("kind = ?")
            args.append(kind)
        query = f"SELECT {_JOB_COLUMNS} FROM jobs" + (f" WHERE {' AND '.join(where)}" if where else "")
        with closing(self._connect()) as conn:
            rows = conn.execute(query + " ORDER BY created_at DESC, id", args).fetchall()
        return [self._record(r) for r in rows]

    def set_status(
        self,
        job_id: str,
        status: JobStatus,
        *,
        error: str | None = None,
        only_from: Sequence[JobStatus] = (),
        result: Any = None,
    ) -> bool:
        """Move a job to ``status`` unless it is already finished (or not in ``only_from``, when given).

        Sets ``started_at`` on the first RUNNING and ``finished_at`` on a terminal status; stores ``result`` (the
        kind's result summary) in the same transaction when given.

        Returns:
            True when the row changed; False when the job was already finished or in another state.
        """
        allowed = [s.value for s in (only_from or [s for s in JobStatus if s not in TERMINAL_STATUSES])]
        now = time.time()
        stored = None if result is None else json.dumps(self.kind(self._kind_of(job_id)).encode_result(result))
        with self.transaction() as conn:
            cur = conn.execute(
                "UPDATE jobs SET status = ?, error = COALESCE(?, error), result = COALESCE(?, result),"
                " started_at = CASE WHEN ? = 'running' THEN COALESCE(started_at, ?) ELSE started_at END,"
                " finished_at = CASE WHEN ? THEN ? ELSE finished_at END"
                f" WHERE id = ? AND status IN ({','.join('?' * len(allowed))})",
                (status.value, error, stored, status.value, now, status in TERMINAL_STATUSES, now, job_id, *allowed),
            )
            return cur.rowcount == 1

    def set_checkpoint(self, job_id: str, checkpoint: Any) -> None:
        """Record the job's progress value (the kind's), or clear it with None."""
        stored = None if checkpoint is None else self.kind(self._kind_of(job_id)).encode_progress(checkpoint)
        with self.transaction() as conn:
            conn.execute(
                "UPDATE jobs SET checkpoint = ? WHERE id = ?", (None if stored is None else json.dumps(stored), job_id)
            )

    def set_implementation_used(self, job_id: str, implementation: str) -> None:
        """Record what the engine's AUTO choices resolved to (comma-separated)."""
        with self.transaction() as conn:
            conn.execute("UPDATE jobs SET implementation_used = ? WHERE id = ?", (implementation, job_id))

    def mark_result_deleted(self, job_id: str) -> bool:
        """Record that a job's result was removed (the record is kept). False if it already was (or no such job)."""
        with self.transaction() as conn:
            cur = conn.execute(
                "UPDATE jobs SET result_deleted_at = ? WHERE id = ? AND result_deleted_at IS NULL",
                (time.time(), job_id),
            )
            return cur.rowcount == 1

    def delete_job(self, job_id: str) -> bool:
        """Remove a job and its tiles. Returns False when there was no such job."""
        with self.transaction() as conn:
            return conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount == 1

    def _kind_of(self, job_id: str) -> str:
        with closing(self._connect()) as conn:
            row = conn.execute("SELECT kind FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(f"jobs: no job with id {job_id!r}; list jobs with GET /v1/jobs")
        return str(row[0])

    # -- tiles ------------------------------------------------------------------------------------------------------

    def pending_tile_ids(self, job_id: str) -> list[int]:
        """Ids of tiles not done (pending or running), in id order."""
        with closing(self._connect()) as conn:
            rows = conn.execute(
                "SELECT tile_id FROM tiles WHERE job_id = ? AND state != 'done' ORDER BY tile_id", (job_id,)
            ).fetchall()
        return [r[0] for r in rows]

    def done_tile_ids(self, job_id: str) -> set[int]:
        """Ids of tiles whose result is written and recorded."""
        with closing(self._connect()) as conn:
            rows = conn.execute("SELECT tile_id FROM tiles WHERE job_id = ? AND state = 'done'", (job_id,)).fetchall()
        return {r[0] for r in rows}

    def claim_tile(self, job_id: str, tile_id: int) -> bool:
        """Mark a tile running and count the attempt. Returns False if it is already done (nothing to compute)."""
        return bool(self.claim_tiles(job_id, [tile_id]))

    def claim_tiles(self, job_id: str, tile_ids: Sequence[int]) -> list[int]:
        """Claim a unit's tiles in one transaction: mark those not done running and count their attempt.

        Args:
            job_id: the job. tile_ids: the tiles (a kernel panel's, a features chunk's).

        Returns:
            The ids claimed (those not done), in the order given; empty when all are done.
        """
        if not tile_ids:
            return []
        marks = ",".join("?" * len(tile_ids))
        with self.transaction() as conn:
            rows = conn.execute(
                f"UPDATE tiles SET state = 'running', attempts = attempts + 1"
                f" WHERE job_id = ? AND tile_id IN ({marks}) AND state != 'done' RETURNING tile_id",
                (job_id, *tile_ids),
            ).fetchall()
        claimed = {r[0] for r in rows}
        return [t for t in tile_ids if t in claimed]

    def mark_tiles_done(self, job_id: str, tile_ids: Sequence[int], *, elapsed_s: float) -> None:
        """Record tiles as done in one transaction; call only after what they stand for is written.

        Args:
            job_id: the job. tile_ids: the tiles written. elapsed_s: the unit's compute seconds, shared out
                evenly over its tiles (so ``tile_seconds`` still sums to the compute time).
        """
        if not tile_ids:
            return
        share, now = elapsed_s / len(tile_ids), time.time()
        with self.transaction() as conn:
            conn.executemany(
                "UPDATE tiles SET state = 'done', elapsed_s = ?, finished_at = ? WHERE job_id = ? AND tile_id = ?",
                [(share, now, job_id, t) for t in tile_ids],
            )

    def mark_tile_done(self, job_id: str, tile_id: int, *, elapsed_s: float) -> None:
        """Record a tile as done; call only after what it stands for is written."""
        self.mark_tiles_done(job_id, [tile_id], elapsed_s=elapsed_s)

    def release_running_tiles(self, job_id: str, *, uncount: bool = False) -> int:
        """Put tiles left ``running`` (by a process that died or stopped) back to pending; returns how many.

        Args:
            job_id: the job. uncount: also take back the attempt their claim counted (a computation given up
                by a clean stop, NOTE [stop timeout] in manager.py). Default: False (a crash's tiles keep it).
        """
        attempts = ", attempts = MAX(attempts - 1, 0)" if uncount else ""
        with self.transaction() as conn:
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

    # -- the boundary -----------------------------------------------------------------------------------------------

    def _record(self, row: tuple[Any, ...]) -> JobRecord[Any, Any, Any]:
        (job_id, kind_name, spec, status, executor, total, shape, estimate, created, started, finished, error, impl,
         deleted, checkpoint, result, done) = row  # fmt: skip
        kind = self.kind(str(kind_name))
        return JobRecord(
            id=str(job_id),
            spec=kind.decode_spec(json.loads(spec)),
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
            kind=kind.name,
            checkpoint=None if checkpoint is None else kind.decode_progress(json.loads(checkpoint)),
            result=None if result is None else kind.decode_result(json.loads(result)),
        )
