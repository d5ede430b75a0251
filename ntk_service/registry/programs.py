"""The torch.export programs of ``exported`` models: ``<data_dir>/programs/<sha256>.pt2``, content-addressed.

    >>> module, spec, architecture = load_program(archive_bytes, operation="register 'g'")  # checked, no pickle
    >>> programs = ProgramStore(data_dir)
    >>> programs.module(record, operation="load_module 'g'")   # the stored archive, loaded the same checked way

A model's program is fixed (its architecture names it by ``program_sha256``); models whose archives are identical
share one file. Files are published inside the registry's write transaction and removed when no ``models`` row
names them any more (NOTE [crash safety] in files.py). Every read goes through exported.py's checked loader (NOTE
[archive threat model] there), never ``torch.export.load``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

from torch import nn

from ntk_service.errors import NtkServiceError
from ntk_service.registry.archive import ArchiveLimits
from ntk_service.registry.exported import EXPORTED_FAMILY, exported_architecture, load_exported, probe_output_dim
from ntk_service.registry.files import FileStore
from ntk_service.registry.records import ModelRecord
from ntk_service.registry.zoo import MAX_PARAMS, ModelSpec

__all__ = ["ProgramStore", "is_exported", "load_program", "program_sha"]

logger = logging.getLogger(__name__)


def is_exported(architecture: dict[str, Any]) -> bool:
    """Whether a (validated) architecture is an exported program's."""
    return architecture.get("family") == EXPORTED_FAMILY


def program_sha(architecture_json: str) -> str | None:
    """The archive an ``architecture`` column names: its sha256, or None for the other families."""
    architecture = json.loads(architecture_json)
    return str(architecture["program_sha256"]) if isinstance(architecture, dict) and is_exported(architecture) else None


def load_program(archive: bytes, *, operation: str) -> tuple[nn.Module, ModelSpec, dict[str, Any]]:
    """A client's archive, checked and loaded (``load_exported`` under the default limits and MAX_PARAMS).

    Args:
        archive (bytes): a ``torch.export.save`` archive; one program whose only input is (N, *input_shape).
        operation (str): prefix of error messages.

    Returns:
        (module, spec, architecture): the graph module in eval mode with the weights it was exported with, its
        ModelSpec (output_dim from a probe forward on (2, *input_shape)), and the ``exported`` architecture dict
        naming the archive by its sha256.

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
    return program.module.eval(), spec, architecture


class ProgramStore:
    """The stored archives, by sha256; the registry owns the transactions that reference them.

    Args:
        data_dir (Path): the registry's data directory (archives in its ``programs/``).
    """

    def __init__(self, data_dir: Path) -> None:
        self._files = FileStore(Path(data_dir) / "programs", ".pt2")

    def write_temp(self, archive: bytes) -> Path:
        """The archive written to a temporary file, to ``publish`` inside the write transaction."""
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
        """Startup: remove archives no ``models`` row names, and stale temporary files."""
        referenced = {program_sha(r[0]) for r in conn.execute("SELECT architecture FROM models")}
        self._files.sweep({sha for sha in referenced if sha is not None})
