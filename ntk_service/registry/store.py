"""ModelRegistry: named models, immutable weight versions, persisted in ``<data_dir>`` (SQLite + safetensors files).

    >>> registry = ModelRegistry(Path("/tmp/ntk-data"))
    >>> record = registry.register("mlp-a", {"family": "mlp", "input_dim": 4, "hidden": [8], "output_dim": 2})
    >>> record.version, record.num_params  # (1, 58)
    >>> record, module = registry.load_module("mlp-a")  # eval mode; (N, 4) -> (N, 2)

Layout: ``registry.sqlite3`` (see database.py), ``weights/<sha256>.safetensors``, content-addressed, so versions
with identical weights share one file, and ``programs/<sha256>.checked.pt2``, the torch.export archives of ``exported``
models (programs.py; read only by exported.py's checked loader). Rows <-> records: version_rows.py. Crash safety:
NOTE [crash safety] in files.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ntk_service.errors import InvalidInput, ModelNotFound, NameConflict, NtkServiceError
from ntk_service.registry.architectures import parse_architecture
from ntk_service.registry.cache import ModuleCache
from ntk_service.registry.database import DATABASE_FILENAME, Database
from ntk_service.registry.exported import exported_inputs
from ntk_service.registry.files import FileStore
from ntk_service.registry.paths import model_paths
from ntk_service.registry.programs import ProgramStore, is_exported, load_program, program_sha
from ntk_service.registry.records import ModelRecord, ParameterInfo
from ntk_service.registry.version_rows import SELECT_VERSION, insert_version_row, record_from_row
from ntk_service.registry.weights import (
    canonical_tensors,
    load_tensors,
    parse_safetensors,
    serialize,
)
from ntk_service.registry.zoo import ModelSpec, build_model, build_skeleton, build_uninitialized

__all__ = ["MAX_LABEL_LENGTH", "MODEL_NAME_PATTERN", "ModelRegistry"]

logger = logging.getLogger(__name__)

MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""Model names: safe in URL paths and file names, at most 64 characters."""

DEFAULT_MODULE_CACHE_SIZE = 8
"""Modules kept built in memory (LRU): a kernel request then skips reading and copying the weights file."""

_MAX_NAMES_IN_MESSAGE = 20

MAX_LABEL_LENGTH = 200
"""Longest version label ("epoch 3", "lr=1e-3 step 12000"): a short note shown beside the version, not a document."""


def _check_label(label: object, op: str) -> str | None:
    if label is None:
        return None
    if not isinstance(label, str) or not 1 <= len(label) <= MAX_LABEL_LENGTH or not label.isprintable():
        shown = repr(label)[:60]
        raise InvalidInput(
            f"{op}: a version label must be 1-{MAX_LABEL_LENGTH} printable characters (e.g. 'epoch 3'), got {shown}"
        )
    return label


def _now() -> datetime:
    return datetime.now(UTC)


def _distinct_numel(module: nn.Module) -> int:
    """P, the trained numbers: a weight tied under two names counts once, also where a loaded program holds it as
    two parameter objects over one storage (a Hugging Face model's tied input and output embeddings)."""
    seen = {(p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), p.stride()): p.numel()
            for p in module.parameters()}  # fmt: skip
    return sum(seen.values())


def _parameter_infos(module: nn.Module) -> tuple[ParameterInfo, ...]:
    return tuple(ParameterInfo(n, tuple(p.shape)) for n, p in module.named_parameters())


def _listing(items: list[str]) -> str:
    if not items:
        return "none"
    shown = ", ".join(items[:_MAX_NAMES_IN_MESSAGE])
    return shown + (f", ... ({len(items)} in all)" if len(items) > _MAX_NAMES_IN_MESSAGE else "")


class ModelRegistry:
    """Registered models and their versions; thread-safe.

    Args:
        data_dir (Path): where the database and weight files live (created if missing).
        allowed_factories (frozenset[str]): ``"module:function"`` factories the operator allows. Default: none.
        module_cache_size (int): built modules kept in memory (LRU); 0 disables the cache. Default: 8.
        device (torch.device or str): where cached modules live: each version is moved there once, when it is
            cached, and ``load_module`` returns it there. Default: "cpu".

    Raises:
        NtkServiceError: the database was written by a newer ntk-service.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        allowed_factories: frozenset[str] = frozenset(),
        module_cache_size: int = DEFAULT_MODULE_CACHE_SIZE,
        device: torch.device | str = "cpu",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.allowed_factories = frozenset(allowed_factories)
        self._db = Database(self.data_dir / DATABASE_FILENAME)
        self._files = FileStore(self.data_dir / "weights", ".safetensors")
        self._programs = ProgramStore(self.data_dir)
        self.device = torch.device(device)
        self._cache = ModuleCache(module_cache_size, place=lambda module: module.to(self.device))
        self._sweep()

    # ---------------------------------------------------------------- writes

    def register(
        self, name: str, architecture: dict[str, Any], seed: int = 0, *, label: str | None = None
    ) -> ModelRecord:
        """Create a model and its version 1, with weights initialised from ``seed``.

        Args:
            name (str): ``^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$``.
            architecture (dict): ``{"family": ..., ...config}``, see ``list_architectures()``.
            seed (int): in [0, 2**63). Same architecture + seed -> same weights and weights_sha256. Default: 0.
            label (str | None): a label for version 1, 1-200 printable characters. Default: none.

        Returns:
            The ModelRecord of version 1.

        Raises:
            InvalidInput: bad name, label, architecture, seed, or a model over the size caps.
            PermissionDenied: a factory the operator does not allow.
            NameConflict: a model of this name exists.
        """
        op = f"register {name!r}" if isinstance(name, str) else "register"
        self._check_name(name, op)
        label = _check_label(label, op)
        self._check_free(name, op)
        module, spec = build_model(architecture, seed, allowed_factories=self.allowed_factories, operation=op)
        normalized = parse_architecture(architecture, operation=op).model_dump(mode="json")
        tensors = canonical_tensors(module, operation=op)
        return self._create(name, normalized, module, spec, tensors, seed=seed, label=label, op=op)

    def register_weights(
        self, name: str, architecture: dict[str, Any], safetensors_bytes: bytes, *, label: str | None = None
    ) -> ModelRecord:
        """Create a model whose version 1 is uploaded weights (a trained ``state_dict()``), in one transaction.

        Args:
            name (str): as ``register``.
            architecture (dict): as ``register``; no seeded initialisation is drawn.
            safetensors_bytes (bytes): exactly the tensors of the architecture's ``state_dict()`` (buffers such as
                BatchNorm running statistics included), as ``add_version`` takes them.
            label (str | None): a label for version 1. Default: none.

        Returns:
            The ModelRecord of version 1 (seed None).

        Raises:
            InvalidInput: bad name, label or architecture; missing, unexpected or mismatched tensors (all named).
            MalformedRequest: the bytes are not safetensors.
            NonFiniteInput: NaN or inf in the weights.
            PermissionDenied, NameConflict: as ``register``.
        """
        op = f"register {name!r}" if isinstance(name, str) else "register"
        self._check_name(name, op)
        label = _check_label(label, op)
        self._check_free(name, op)
        config = parse_architecture(architecture, operation=op)
        tensors = parse_safetensors(safetensors_bytes, operation=op)
        module, spec = build_uninitialized(config, allowed_factories=self.allowed_factories, operation=op)
        canonical = canonical_tensors(module, operation=op)
        load_tensors(module, tensors, operation=op)  # the strict check of names, shapes, dtypes and values
        stored = {n: tensors[n].contiguous() for n in canonical}
        normalized = config.model_dump(mode="json")
        return self._create(name, normalized, module.eval(), spec, stored, seed=None, label=label, op=op)

    def register_program(self, name: str, archive: bytes, *, label: str | None = None) -> ModelRecord:
        """Create a model from a ``torch.export.save`` archive; version 1 holds the weights it was exported with.

        The archive is loaded by ``load_exported`` (nothing in it is unpickled or executed; NOTE [archive threat
        model] in exported.py) and stored as ``programs/<sha256>.checked.pt2``, holding only what that loader read
        (NOTE [stored archives] in program_archive.py): the program is fixed per model, later
        versions are weights (``add_version``) checked against its signature.

        Args:
            name (str): as ``register``.
            archive (bytes): the archive; one ExportedProgram whose only input is (N, *input_shape), N dynamic.
            label (str | None): a label for version 1. Default: none.

        Returns:
            The ModelRecord of version 1 (seed None, architecture family "exported").

        Raises:
            InvalidInput, UnsupportedModel, MalformedRequest, PayloadTooLarge: as ``load_exported``; a program
                over MAX_PARAMS parameters or whose forward fails on (2, *input_shape).
            NameConflict: a model of this name exists.
        """
        op = f"register {name!r}" if isinstance(name, str) else "register"
        self._check_name(name, op)
        label = _check_label(label, op)
        self._check_free(name, op)
        module, spec, normalized, stored = load_program(archive, operation=op)
        tensors = canonical_tensors(module, operation=op)
        return self._create(name, normalized, module, spec, tensors, seed=None, label=label, op=op, program=stored)

    def _create(
        self,
        name: str,
        normalized: dict[str, Any],
        module: nn.Module,
        spec: ModelSpec,
        tensors: dict[str, Any],
        *,
        seed: int | None,
        label: str | None,
        op: str,
        program: bytes | None = None,
    ) -> ModelRecord:
        """Store version 1: the weights file (and an exported model's archive), the model row and the version row,
        committed together: files are published inside the write transaction, as NOTE [crash safety] requires."""
        inputs = exported_inputs(normalized)
        paths = model_paths(module, spec, normalized, inputs, operation=op)  # before any file or row is written
        data, sha = serialize(tensors)
        tmp = self._files.write_temp(lambda f: f.write(data))
        archive_sha = str(normalized["program_sha256"]) if program is not None else None
        program_tmp = self._programs.write_temp(program) if program is not None else None
        record = ModelRecord(
            name=name,
            version=1,
            architecture=normalized,
            seed=seed,
            num_params=_distinct_numel(module),
            input_shape=spec.input_shape,
            input_dtype=spec.input_dtype,
            output_dim=spec.output_dim,
            parameters=_parameter_infos(module),
            weights_sha256=sha,
            created_at=_now(),
            label=label,
            inputs=inputs,
            parameter_paths=paths,
        )
        try:
            with self._files.temp_cleanup(tmp):
                try:
                    with self._db.write() as conn:
                        self._check_free(name, op)
                        self._files.publish(tmp, sha)
                        if program_tmp is not None and archive_sha is not None:
                            self._programs.publish(program_tmp, archive_sha)
                        conn.execute(
                            "INSERT INTO models (name, architecture, created_at, paths) VALUES (?, ?, ?, ?)",
                            (name, json.dumps(normalized), record.created_at.isoformat(), json.dumps(paths)),
                        )
                        self._insert_version_row(conn, record)
                except BaseException:
                    self._collect_garbage({sha})
                    if archive_sha is not None:
                        self._collect_programs({archive_sha})
                    raise
        finally:
            if program_tmp is not None:
                program_tmp.unlink(missing_ok=True)  # gone once published
        self._cache.put(record.cache_key, module)
        logger.info("registered model %r (%s, %d params, sha256 %s)", name, spec, record.num_params, sha[:12])
        return record

    def add_version(self, name: str, safetensors_bytes: bytes, *, label: str | None = None) -> ModelRecord:
        """Store uploaded weights as the next version of a model.

        Args:
            name (str): an existing model.
            safetensors_bytes (bytes): a safetensors file with exactly the tensors of the model's ``state_dict()``
                (tied aliases once, see NOTE [tied weights] in weights.py): same names, shapes and dtypes.
            label (str | None): a label for the version, e.g. "epoch 3", 1-200 printable characters. Default: none.

        Returns:
            The new ModelRecord (seed None). The stored file is re-serialized canonically (no metadata), so
            weights_sha256 depends only on the tensors.

        Raises:
            ModelNotFound: no such model.
            MalformedRequest: the bytes are not safetensors.
            InvalidInput: missing, unexpected or mismatched tensors (all named).
            NonFiniteInput: NaN or inf in the weights.
        """
        op = f"add_version {name!r}"
        label = _check_label(label, op)
        latest = self.get(name)
        tensors = parse_safetensors(safetensors_bytes, operation=op)
        module = self._skeleton(latest, op)
        canonical = canonical_tensors(module, operation=op)
        load_tensors(module, tensors, operation=op)  # the strict check of names, shapes, dtypes and values
        data, sha = serialize({n: tensors[n].contiguous() for n in canonical})
        tmp = self._files.write_temp(lambda f: f.write(data))
        with self._files.temp_cleanup(tmp):
            try:
                with self._db.write() as conn:
                    row = conn.execute(
                        "SELECT MAX(v.version), m.architecture FROM models m JOIN model_versions v ON v.name = m.name "
                        "WHERE m.name = ?",
                        (name,),
                    ).fetchone()
                    if row[0] is None or json.loads(row[1]) != latest.architecture:
                        raise ModelNotFound(
                            f"{op}: model {name!r} was deleted (or replaced) while the weights were uploaded; "
                            "check the model and upload again"
                        )
                    record = dataclasses.replace(
                        latest, version=int(row[0]) + 1, seed=None, weights_sha256=sha, created_at=_now(), label=label
                    )
                    self._files.publish(tmp, sha)
                    self._insert_version_row(conn, record)
            except BaseException:
                self._collect_garbage({sha})
                raise
        self._cache.put(record.cache_key, module.eval())
        logger.info("model %r: version %d stored (sha256 %s)", name, record.version, sha[:12])
        return record

    def delete(self, name: str) -> None:
        """Delete a model and all its versions (weight files no other version uses are removed).

        Raises:
            ModelNotFound: no such model.
        """
        with self._db.write() as conn:
            shas = {r[0] for r in conn.execute("SELECT weights_sha256 FROM model_versions WHERE name = ?", (name,))}
            programs = {
                program_sha(r[0]) for r in conn.execute("SELECT architecture FROM models WHERE name = ?", (name,))
            }
            if conn.execute("DELETE FROM models WHERE name = ?", (name,)).rowcount == 0:
                raise ModelNotFound(self._not_found_message(f"delete {name!r}", name))
        self._cache.drop(lambda key: isinstance(key, tuple) and key[0] == name)
        self._collect_garbage(shas)
        self._collect_programs({sha for sha in programs if sha is not None})
        logger.info("deleted model %r", name)

    # ---------------------------------------------------------------- reads

    def get(self, name: str, version: int | None = None) -> ModelRecord:
        """A version's record; the latest when ``version`` is None.

        Raises:
            ModelNotFound: no such model or version (the message lists the known names or versions).
        """
        op = f"get {name!r}"
        if version is None:
            rows = self._db.query(SELECT_VERSION + " WHERE v.name = ? ORDER BY v.version DESC LIMIT 1", (name,))
        else:
            rows = self._db.query(SELECT_VERSION + " WHERE v.name = ? AND v.version = ?", (name, version))
        if rows:
            return record_from_row(rows[0])
        raise ModelNotFound(self._not_found_message(op, name, version))

    def versions(self, name: str) -> list[ModelRecord]:
        """Every version of a model, oldest first.

        Raises:
            ModelNotFound: no such model.
        """
        rows = self._db.query(SELECT_VERSION + " WHERE v.name = ? ORDER BY v.version", (name,))
        if not rows:
            raise ModelNotFound(self._not_found_message(f"versions {name!r}", name))
        return [record_from_row(r) for r in rows]

    def list(self) -> list[ModelRecord]:
        """The latest version of every model, by name."""
        rows = self._db.query(
            SELECT_VERSION
            + " WHERE v.version = (SELECT MAX(version) FROM model_versions w WHERE w.name = v.name) ORDER BY v.name"
        )
        return [record_from_row(r) for r in rows]

    def weights_path(self, name: str, version: int) -> Path:
        """The stored safetensors file of a version (immutable; for streaming responses).

        Raises:
            ModelNotFound: no such model or version.
            NtkServiceError: the file is missing (the data directory was damaged; 500).
        """
        return self._weights_file(self.get(name, version))

    def weights_bytes(self, name: str, version: int) -> bytes:
        """The stored safetensors file of a version.

        Raises:
            ModelNotFound: no such model or version.
        """
        return self.weights_path(name, version).read_bytes()

    def load_module(self, name: str, version: int | None = None) -> tuple[ModelRecord, nn.Module]:
        """The record and its module (eval mode, float32, on ``device``), from an LRU cache or built from the weights
        file.

        The module is shared between callers: do not mutate it (the kernel engine does not).

        Raises:
            ModelNotFound: no such model or version.
            PermissionDenied: a factory model whose factory the operator no longer allows.
        """
        record = self.get(name, version)
        return record, self.module(record)

    def module(self, record: ModelRecord) -> nn.Module:
        """The module of a record already read (``get``): from the LRU cache or built from its weights file,
        without reading the record again. Shared between callers, as ``load_module``'s.

        Raises:
            PermissionDenied: a factory model whose factory the operator no longer allows.
            NtkServiceError: the weights file is missing (the data directory was damaged).
        """

        def build() -> nn.Module:
            op = f"load_module {record.name!r} version {record.version}"
            module = self._skeleton(record, op)
            load_tensors(module, safetensors.torch.load_file(self._weights_file(record)), operation=op)
            return module.eval()

        return self._cache.get_or_build(record.cache_key, build)

    def close(self) -> None:
        """Close the database connections and drop cached modules."""
        self._cache.clear()
        self._db.close()

    # ---------------------------------------------------------------- internals

    def _weights_file(self, record: ModelRecord) -> Path:
        path = self._files.path(record.weights_sha256)
        if not path.is_file():
            raise NtkServiceError(
                f"model {record.name!r} version {record.version}: its weights file {path} is missing; the data "
                "directory was changed outside ntk-service (restore it from a backup, or delete the model)"
            )
        return path

    def _skeleton(self, record: ModelRecord, op: str) -> nn.Module:
        if is_exported(record.architecture):
            return self._programs.module(record, operation=op)
        config = parse_architecture(record.architecture, operation=op)
        return build_skeleton(config, allowed_factories=self.allowed_factories, operation=op)

    def _insert_version_row(self, conn: Any, record: ModelRecord) -> None:
        """Every version row is written here (version_rows.py), the one seam a failed commit is tested through."""
        insert_version_row(conn, record)

    @staticmethod
    def _check_name(name: object, op: str) -> None:
        if not isinstance(name, str) or not MODEL_NAME_PATTERN.fullmatch(name):
            raise InvalidInput(
                f"{op}: invalid model name {name!r}; use 1-64 characters from A-Z a-z 0-9 _ . - "
                "starting with a letter or digit"
            )

    def _check_free(self, name: str, op: str) -> None:
        rows = self._db.query("SELECT version FROM model_versions WHERE name = ? ORDER BY version", (name,))
        if rows or self._db.query("SELECT 1 FROM models WHERE name = ?", (name,)):
            raise NameConflict(
                f"{op}: a model named {name!r} already exists (versions {_listing([str(r[0]) for r in rows])}); "
                "choose another name, upload weights as a new version of it, or delete it first"
            )

    def _not_found_message(self, op: str, name: str, version: int | None = None) -> str:
        versions = [str(r[0]) for r in self._db.query("SELECT version FROM model_versions WHERE name = ?", (name,))]
        if versions and version is not None:
            return f"{op}: model {name!r} has no version {version}; its versions are {_listing(versions)}"
        names = [r[0] for r in self._db.query("SELECT name FROM models ORDER BY name")]
        return f"{op}: no model named {name!r}; registered models: {_listing(names)}"

    def _collect_garbage(self, shas: set[str]) -> None:
        """Remove the weight files among ``shas`` that no row references (inside a write transaction)."""
        if not shas:
            return
        try:
            with self._db.write() as conn:
                for sha in shas:
                    used = conn.execute("SELECT 1 FROM model_versions WHERE weights_sha256 = ? LIMIT 1", (sha,))
                    if used.fetchone() is None:
                        self._files.remove(sha)
        except Exception:  # best effort: the startup sweep removes what is left (NOTE [crash safety])
            logger.warning("could not remove unreferenced weight files %s", sorted(shas), exc_info=True)

    def _collect_programs(self, shas: set[str]) -> None:
        """Remove the program archives among ``shas`` that no model references (best effort, as for weights)."""
        try:
            with self._db.write() as conn:
                self._programs.collect(conn, shas)
        except Exception:  # the startup sweep removes what is left
            logger.warning("could not remove unreferenced program files %s", sorted(shas), exc_info=True)

    def _sweep(self) -> None:
        """Startup: remove weight files without a row and stale temp files (NOTE [crash safety] in files.py)."""
        with self._db.write() as conn:
            referenced = {r[0] for r in conn.execute("SELECT DISTINCT weights_sha256 FROM model_versions")}
            removed, missing = self._files.sweep(referenced)
            self._programs.sweep(conn)
        if removed:
            logger.info("removed %d weight files that no model version references", len(removed))
        if missing:
            logger.error("weight files missing for sha256 %s: those versions cannot be loaded", sorted(missing))
