"""The job stores of earlier versions, opened by this one: nothing a data directory holds is lost.

- **Schema.** ``jobs.sqlite3`` of the first versions had only kernel jobs (and, earlier still, no
  ``result_deleted_at``). ``migrate_schema`` adds what is missing in place (``kind`` defaults to "kernel") and
  stamps ``PRAGMA user_version`` with ``SCHEMA_VERSION``.
- **The solve and features jobs' own store.** Before issue 40 they lived in ``solve_jobs.sqlite3`` beside it (one
  row per job: kind, spec, status, progress, result as JSON), results in ``<results_dir>/solve/<id>/``, where they
  stay. ``import_legacy_jobs`` copies every row into the one store, in one transaction, with the tiles its kind plans
  for it (done for a succeeded job), then renames the old file to ``solve_jobs.sqlite3.imported`` (kept, never
  deleted). A crash between the two leaves rows that the next start skips (``INSERT OR IGNORE``), so running it again
  is safe. An unfinished job keeps its status and resumes at the next start like any other.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ntk_service.jobs.store import JobStore

__all__ = ["LEGACY_SOLVE_DB", "SCHEMA_VERSION", "import_legacy_jobs", "migrate_schema"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
"""1: kernel jobs only; 2: jobs of every kind (``kind``, ``checkpoint``, ``result``)."""

LEGACY_SOLVE_DB = "solve_jobs.sqlite3"
"""The solve and features jobs' store of versions before 2, in ``<data_dir>/jobs``."""

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
    result_deleted_at REAL,
    kind TEXT NOT NULL DEFAULT 'kernel',
    checkpoint TEXT,
    result TEXT
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

_ADDED_COLUMNS = (
    ("result_deleted_at", "REAL"),
    ("kind", "TEXT NOT NULL DEFAULT 'kernel'"),
    ("checkpoint", "TEXT"),
    ("result", "TEXT"),
)
"""Columns added since the first version, in order; a database lacking one gains it with its default."""


def migrate_schema(conn: sqlite3.Connection) -> None:
    """Create the tables, or bring those of an earlier version up to ``SCHEMA_VERSION`` in place."""
    conn.executescript(_SCHEMA)
    if conn.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
        return
    columns = {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}
    for name, declaration in _ADDED_COLUMNS:
        if name not in columns:
            conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")
    conn.execute("CREATE INDEX IF NOT EXISTS jobs_by_kind ON jobs (kind, created_at)")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def import_legacy_jobs(store: JobStore, jobs_dir: Path) -> list[str]:
    """Copy the jobs of ``<jobs_dir>/solve_jobs.sqlite3`` (if any) into ``store`` and set the old file aside.

    Returns:
        The ids imported (none when there is no old store).

    Raises:
        JobNotFound: a row of a kind this version does not know (the file is left as it is).
    """
    legacy = jobs_dir / LEGACY_SOLVE_DB
    if not legacy.exists():
        return []
    with closing(sqlite3.connect(legacy, isolation_level=None)) as old:
        old.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # rows a killed server left in the WAL are read, then kept
        rows = old.execute(
            "SELECT id, job, status, spec, progress, result, error, created_at, started_at, finished_at "
            "FROM solve_jobs ORDER BY created_at"
        ).fetchall()
    imported = [row[0] for row in rows if _import(store, row)]
    os.replace(legacy, legacy.with_name(LEGACY_SOLVE_DB + ".imported"))
    for suffix in ("-wal", "-shm"):
        Path(f"{legacy}{suffix}").unlink(missing_ok=True)
    logger.info("jobs: imported %d solve and features job(s) from %s", len(imported), legacy)
    return imported


def _import(store: JobStore, row: tuple[Any, ...]) -> bool:
    """Insert one old row with the tiles its kind plans (done when it succeeded); False if it was there already."""
    job_id, kind_name, status, spec, progress, result, error, created, started, finished = row
    kind = store.kind(str(kind_name))
    typed = kind.decode_spec(json.loads(spec))
    layout = kind.layout(typed)
    done = status == "succeeded"
    with store.transaction() as conn:
        cur = conn.execute(
            "INSERT OR IGNORE INTO jobs (id, kind, spec, status, executor, tiles_total, result_shape, estimate_bytes,"
            " created_at, started_at, finished_at, error, checkpoint, result)"
            " VALUES (?, ?, ?, ?, 'local', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job_id,
                kind.name,
                json.dumps(kind.encode_spec(typed)),
                status,
                len(layout.tile_ids),
                json.dumps(list(layout.result_shape)),
                layout.estimate_bytes,
                created,
                started,
                finished,
                error,
                progress if progress not in (None, "null") else None,
                result,
            ),
        )
        if cur.rowcount == 1:
            conn.executemany(
                "INSERT INTO tiles (job_id, tile_id, state, attempts) VALUES (?, ?, ?, ?)",
                [(job_id, t, "done" if done else "pending", 1 if done else 0) for t in layout.tile_ids],
            )
        return cur.rowcount == 1
