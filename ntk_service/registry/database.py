"""The registry's SQLite file: schema, per-thread connections, write transactions.

One file, ``<data_dir>/registry.sqlite3``, shared by ModelRegistry and DatasetStore. WAL journal (readers never block
the writer), ``synchronous=FULL`` (a committed registration survives power loss), every write in ``BEGIN IMMEDIATE``
(the write lock is taken up front, so two writers never deadlock upgrading read locks). Each thread gets its own
connection (sqlite3 connections must not be used by two threads at once); ``close()`` closes them all.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

from ntk_service.errors import NtkServiceError

__all__ = ["DATABASE_FILENAME", "SCHEMA_VERSION", "Database"]

DATABASE_FILENAME = "registry.sqlite3"
"""The database file inside the data directory."""

SCHEMA_VERSION = 4
"""Bump when the schema changes, and add the migration from the previous version to ``_MIGRATIONS``."""

BUSY_TIMEOUT_S = 30.0
"""How long a writer waits for another writer's lock: a weight upload holds it only for a rename and two inserts."""

_SCHEMA = """
CREATE TABLE models (
    name          TEXT PRIMARY KEY,
    architecture  TEXT NOT NULL,           -- JSON, validated, defaults filled in
    created_at    TEXT NOT NULL,
    paths         TEXT                     -- JSON path report (registry/paths.py), NULL before schema version 4
);
CREATE TABLE model_versions (
    name            TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
    version         INTEGER NOT NULL,
    seed            INTEGER,               -- NULL for uploaded weights
    num_params      INTEGER NOT NULL,
    input_shape     TEXT NOT NULL,         -- JSON list
    input_dtype     TEXT NOT NULL,
    output_dim      INTEGER NOT NULL,
    parameters      TEXT NOT NULL,         -- JSON [[name, [shape]], ...] in named_parameters() order
    weights_sha256  TEXT NOT NULL,         -- weights/<sha256>.safetensors
    created_at      TEXT NOT NULL,         -- upload (or registration) time, UTC ISO 8601
    label           TEXT,                  -- optional, e.g. "epoch 3" (schema version 2)
    inputs          TEXT,                  -- JSON InputSpec of a model with several inputs, else NULL (3)
    PRIMARY KEY (name, version)
);
CREATE INDEX model_versions_by_sha ON model_versions(weights_sha256);
CREATE TABLE datasets (
    id          TEXT PRIMARY KEY,          -- datasets/<id>.npy (one array)
    name        TEXT,
    shape       TEXT NOT NULL,             -- JSON list
    dtype       TEXT NOT NULL,
    sha256      TEXT NOT NULL,
    size_bytes  INTEGER NOT NULL,
    created_at  TEXT NOT NULL,
    arrays      TEXT                       -- JSON [{name, shape, dtype, sha256, size}] of a named data set
                                           -- (files datasets/<id>-<i>.npy), NULL: one array (schema version 3)
);
"""

_MIGRATIONS: dict[int, str] = {
    1: "ALTER TABLE model_versions ADD COLUMN label TEXT",
    2: "ALTER TABLE model_versions ADD COLUMN inputs TEXT; ALTER TABLE datasets ADD COLUMN arrays TEXT",
    3: "ALTER TABLE models ADD COLUMN paths TEXT",
}
"""from_version -> SQL that upgrades it to from_version + 1 (in the write transaction that opens the file, so a
data directory of an older release is upgraded in place, all or nothing)."""


class _Connection(sqlite3.Connection):
    """A plain sqlite3 connection that can be weakly referenced (the base class cannot)."""


class Database:
    """Connections to one SQLite file; creates or upgrades the schema on open.

    Args:
        path (Path): the database file; its directory must exist.

    Raises:
        NtkServiceError: the file was written by a newer ntk-service (schema version above SCHEMA_VERSION).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._lock = threading.Lock()
        # Weak: a thread's connection lives in its threading.local and is closed when the thread ends (worker pools
        # replace idle threads), so connections never pile up; close() closes those still alive.
        self._connections: weakref.WeakSet[sqlite3.Connection] = weakref.WeakSet()
        self._closed = False
        self._ensure_schema()

    def connection(self) -> sqlite3.Connection:
        """This thread's connection (autocommit mode: transactions are explicit)."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            with self._lock:
                if self._closed:
                    raise NtkServiceError(f"registry database {self.path} is closed")
                # check_same_thread=False only so close() may close it from another thread; use stays per thread.
                conn = sqlite3.connect(
                    self.path,
                    timeout=BUSY_TIMEOUT_S,
                    isolation_level=None,
                    check_same_thread=False,
                    factory=_Connection,
                )
                self._connections.add(conn)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
        return conn

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``, or ``ROLLBACK`` if the block raises."""
        conn = self.connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def query(self, sql: str, params: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        """Run one read statement and return all rows (a consistent snapshot)."""
        conn = self.connection()
        conn.row_factory = sqlite3.Row
        return conn.execute(sql, params).fetchall()

    def close(self) -> None:
        """Close every thread's connection; later calls raise NtkServiceError."""
        with self._lock:
            self._closed = True
            for conn in list(self._connections):
                conn.close()
            self._connections.clear()
        self._local = threading.local()

    def _ensure_schema(self) -> None:
        with self.write() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                return
            version = int(row[0])
            if version > SCHEMA_VERSION:
                raise NtkServiceError(
                    f"registry database {self.path} has schema version {version}, newer than this ntk-service "
                    f"understands ({SCHEMA_VERSION}); upgrade ntk-service or point NTK_DATA_DIR elsewhere"
                )
            while version < SCHEMA_VERSION:
                for statement in _MIGRATIONS[version].split(";"):
                    if statement.strip():
                        conn.execute(statement)
                version += 1
            conn.execute("UPDATE schema_version SET version = ?", (version,))
