"""The torch.export programs of ``exported`` models: ``<data_dir>/programs/<sha256>.checked.pt2``.

    >>> loaded = load_program(archive_bytes, operation="register 'g'")  # checked, no pickle
    >>> programs = ProgramStore(data_dir)
    >>> programs.module(record, operation="load_module 'g'")   # the stored archive, loaded the same checked way

A model's program is fixed (its architecture names the uploaded archive by ``program_sha256``); what is stored
under that name is the rewritten archive of only what the checked loader read (NOTE [stored archives] in
program_archive.py), so models whose uploads are identical share one file. Files are published inside the
registry's write transaction and removed when no ``models`` row names them any more (NOTE [crash safety] in
files.py). Every read goes through exported.py's checked loader (NOTE [archive threat model] there), never
``torch.export.load``. Archives stored whole by earlier versions (``<sha256>.pt2``) are rewritten at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn

from ntk_service.errors import NtkServiceError
from ntk_service.registry.archive import ArchiveLimits
from ntk_service.registry.exported import EXPORTED_FAMILY, exported_architecture, load_exported, probe_output_dim
from ntk_service.registry.files import FileStore
from ntk_service.registry.program_archive import checked_archive
from ntk_service.registry.records import ModelRecord
from ntk_service.registry.zoo import MAX_PARAMS, ModelSpec

__all__ = ["LoadedProgram", "ProgramStore", "is_exported", "load_program", "program_sha"]

_LEGACY_SUFFIX = ".pt2"
"""Archives stored whole, as uploaded, before NOTE [stored archives]."""

logger = logging.getLogger(__name__)


def is_exported(architecture: dict[str, Any]) -> bool:
    """Whether a (validated) architecture is an exported program's."""
    return architecture.get("family") == EXPORTED_FAMILY


def program_sha(architecture_json: str) -> str | None:
    """The archive an ``architecture`` column names: its sha256, or None for the other families."""
    architecture = json.loads(architecture_json)
    return str(architecture["program_sha256"]) if isinstance(architecture, dict) and is_exported(architecture) else None


class LoadedProgram(NamedTuple):
    """A client's archive, checked and loaded: what ``register_program`` stores."""

    module: nn.Module
    """The graph module in eval mode with the weights it was exported with."""
    spec: ModelSpec
    """Input shape and dtype, and output_dim from a probe forward on (2, *input_shape)."""
    architecture: dict[str, Any]
    """The ``exported`` architecture, naming the uploaded archive by its sha256."""
    stored: bytes
    """The archive to store: only what the loader read (NOTE [stored archives] in program_archive.py)."""


def load_program(archive: bytes, *, operation: str) -> LoadedProgram:
    """A client's archive, checked and loaded (``load_exported`` under the default limits and MAX_PARAMS).

    Args:
        archive (bytes): a ``torch.export.save`` archive; one program whose only input is (N, *input_shape).
        operation (str): prefix of error messages.

    Returns:
        LoadedProgram: the module, its ModelSpec, the architecture, and the archive to store.

    Raises:
        InvalidInput, UnsupportedModel, MalformedRequest, PayloadTooLarge: as ``load_exported``; a program over
            MAX_PARAMS parameters or whose forward fails on (2, *input_shape).
    """
    program = load_exported(archive, operation=operation, limits=ArchiveLimits(), max_params=MAX_PARAMS)
    spec = ModelSpec(
        tuple(int(n) for n in program.input_shape),  # type: ignore[arg-type]
        program.input_dtype,  # type: ignore[arg-type]
        probe_output_dim(program, operation=operation),
    )
    architecture = exported_architecture(program, hashlib.sha256(archive).hexdigest(), operation=operation)
    return LoadedProgram(program.module.eval(), spec, architecture, checked_archive(program))


class ProgramStore:
    """The stored archives, by sha256; the registry owns the transactions that reference them.

    Args:
        data_dir (Path): the registry's data directory (archives in its ``programs/``).
    """

    def __init__(self, data_dir: Path) -> None:
        self._files = FileStore(Path(data_dir) / "programs", ".checked.pt2")

    def write_temp(self, archive: bytes) -> Path:
        """The archive to store (``LoadedProgram.stored``) written to a temporary file, to ``publish`` inside the
        write transaction."""
        return self._files.write_temp(lambda f: f.write(archive))

    def publish(self, tmp: Path, sha: str) -> None:
        """Move a temporary file to ``programs/<sha>.pt2`` (an identical archive already there is kept)."""
        self._files.publish(tmp, sha)

    def module(self, record: ModelRecord, *, operation: str) -> nn.Module:
        """The graph module of an exported model's stored archive (eval mode, the weights it was exported with).

        Raises:
            NtkServiceError: the archive is missing (the data directory was damaged; 500).
        """
        path = self._files.path(str(record.architecture["program_sha256"]))
        if not path.is_file() and self._legacy(str(record.architecture["program_sha256"])).is_file():
            raise NtkServiceError(
                f"model {record.name!r}: its program was stored by an earlier ntk-service and could not be "
                "rewritten at start-up (the log says why): delete the model and register it again"
            )
        if not path.is_file():
            raise NtkServiceError(
                f"model {record.name!r}: its program file {path} is missing; the data directory was changed "
                "outside ntk-service (restore it from a backup, or delete the model)"
            )
        return load_exported(path.read_bytes(), operation=operation).module.eval()

    def collect(self, conn: sqlite3.Connection, shas: set[str]) -> None:
        """Remove the archives among ``shas`` that no ``models`` row names (inside a write transaction)."""
        referenced = {program_sha(r[0]) for r in conn.execute("SELECT architecture FROM models")}
        for sha in shas - referenced:
            self._files.remove(sha)

    def sweep(self, conn: sqlite3.Connection) -> None:
        """Startup: rewrite archives stored whole by earlier versions, remove archives no ``models`` row names, and
        stale temporary files."""
        referenced = {sha for r in conn.execute("SELECT architecture FROM models") if (sha := program_sha(r[0]))}
        self._rewrite_legacy(referenced)
        self._files.sweep(referenced)

    def _legacy(self, sha: str) -> Path:
        return self._files.directory / f"{sha}{_LEGACY_SUFFIX}"

    def _rewrite_legacy(self, referenced: set[str]) -> None:
        """Archives stored whole (``<sha>.pt2``) become ``<sha>.checked.pt2`` of what the loader reads; one the
        loader now refuses stays, logged, so that nothing is lost (its model cannot be loaded: ``module`` says so)."""
        for path in sorted(self._files.directory.glob(f"*{_LEGACY_SUFFIX}")):
            sha = path.name.removesuffix(_LEGACY_SUFFIX)
            if path.name.endswith(self._files.suffix) or path.name.startswith(".") or len(sha) != 64:
                continue
            if sha in referenced and not self._files.path(sha).is_file():
                try:
                    stored = checked_archive(load_exported(path.read_bytes(), operation=f"program {sha[:12]}"))
                except NtkServiceError as exc:
                    logger.error("program %s stored by an earlier version could not be rewritten: %s", sha, exc)
                    continue
                self._files.publish(self.write_temp(stored), sha)
                logger.info("program %s: rewritten to the entries the checked loader reads", sha[:12])
            path.unlink()
