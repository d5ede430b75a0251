"""A directory of immutable files written atomically: temp file + fsync, then ``os.replace`` + directory fsync.

NOTE [crash safety]
A record is committed in this order: (1) write the bytes to ``.tmp-<random>`` in the same directory and fsync it,
outside any lock; (2) in the SQLite write transaction, ``os.replace`` it to its final name and fsync the directory;
(3) insert the row and COMMIT. A crash before (3) leaves at most a file without a row: harmless, and removed by the
startup sweep, which runs inside a write transaction so it never races a writer between (2) and (3). A row never
points to a missing or half-written file. Deleting goes the other way: rows first (committed), then, in another write
transaction, the files no row references any more.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["TEMP_FILE_GRACE_S", "FileStore"]

TEMP_FILE_GRACE_S = 3600.0
"""Temp files older than this are leftovers of a crashed upload and are swept at startup; younger ones may belong to
an upload in progress in another process sharing the data directory."""

_TEMP_PREFIX = ".tmp-"


class FileStore:
    """Files ``<directory>/<key><suffix>``, created once and never modified.

    Args:
        directory (Path): created if missing.
        suffix (str): e.g. ".safetensors".
    """

    def __init__(self, directory: Path, suffix: str) -> None:
        self.directory = directory
        self.suffix = suffix
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """Where the file for ``key`` lives (keys are hex digests or generated ids, never client paths)."""
        return self.directory / f"{key}{self.suffix}"

    def write_temp(self, write: Callable[[BinaryIO], object]) -> Path:
        """Write a temp file with ``write(file)``, fsync it and return its path (removed again if ``write`` fails)."""
        tmp = self.directory / f"{_TEMP_PREFIX}{secrets.token_hex(8)}{self.suffix}"
        try:
            with open(tmp, "xb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def publish(self, tmp: Path, key: str) -> Path:
        """Atomically move a temp file to its final name (replacing an identical one) and make the rename durable."""
        final = self.path(key)
        os.replace(tmp, final)
        self._fsync_directory()
        return final

    def remove(self, key: str) -> None:
        """Delete the file of ``key`` if it exists."""
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> set[str]:
        """Keys of all published files."""
        return {
            p.name.removesuffix(self.suffix)
            for p in self.directory.iterdir()
            if p.name.endswith(self.suffix) and not p.name.startswith(_TEMP_PREFIX)
        }

    def sweep(self, referenced: set[str]) -> tuple[set[str], set[str]]:
        """Remove published files whose key is not in ``referenced`` and stale temp files (call it inside the write
        transaction that read ``referenced``, see NOTE [crash safety]).

        Returns:
            (removed keys, referenced keys without a file).
        """
        present = self.keys()
        removed = present - referenced
        for key in removed:
            self.remove(key)
        self.sweep_temps()
        return removed, referenced - present

    def sweep_temps(self, *, older_than_s: float = TEMP_FILE_GRACE_S) -> int:
        """Remove leftover temp files older than ``older_than_s`` seconds; returns how many."""
        now = time.time()
        removed = 0
        for p in self.directory.glob(f"{_TEMP_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):
                if now - p.stat().st_mtime >= older_than_s:
                    p.unlink()
                    removed += 1
        return removed

    @contextlib.contextmanager
    def temp_cleanup(self, tmp: Path) -> Iterator[None]:
        """Remove ``tmp`` if the block raises (after ``publish`` it no longer exists, so this is a no-op)."""
        try:
            yield
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
