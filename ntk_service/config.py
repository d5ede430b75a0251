"""Service configuration: one ``Settings`` object, read from ``NTK_*`` environment variables.

Nothing here runs at import time: the server, the CLI and the tests build ``Settings(...)`` explicitly and
pass it down (``create_app(settings)``). Every field can be set by its upper-case env name with the ``NTK_``
prefix, e.g. ``NTK_DATA_DIR=/srv/ntk NTK_API_KEYS="alice-key:write,bob-key:read"``.

    >>> s = Settings(api_keys="k1:read,k2:write", compute_concurrency=2)
    >>> s.api_key_scopes()
    {'k1': 'read', 'k2': 'write'}
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "LOOPBACK_HOSTS",
    "SCOPES",
    "Scope",
    "Settings",
    "default_compute_concurrency",
    "parse_api_keys",
]

Scope = Literal["read", "write"]
SCOPES: tuple[Scope, ...] = ("read", "write")
"""``read`` lists and computes kernels; ``write`` also registers, uploads and deletes (write implies read)."""

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
"""Hosts an open server (no API keys) may bind: only this machine can reach it."""

DEFAULT_MAX_BODY_BYTES = 256 * 2**20
"""256 MiB: a float32 data set of 64k examples × 1k features fits; anything bigger belongs in several
uploads."""

DEFAULT_MAX_JSON_RESPONSE_BYTES = 16 * 2**20
"""16 MiB of JSON takes ~0.5 s to encode and much longer to parse client-side; bigger results go binary."""

DEFAULT_MAX_BINARY_RESPONSE_BYTES = 1 * 2**30
"""1 GiB: a job result sent in one piece (safetensors) is built in the server's memory; bigger ones stream as .npy."""

DEFAULT_STREAM_BLOCK_BYTES = 32 * 2**20
"""32 MiB: what a streamed job result download holds at a time (one read, at least one entry), however large."""

DEFAULT_SIDE_CACHE_BYTES = 512 * 2**20
"""512 MiB of cached per-side intermediates (Jacobians, activations) shared by all requests."""

_DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")
"""The device strings ``NTK_DEVICE`` accepts; whether the device exists is checked when the server starts."""

DEFAULT_MAX_QUEUE = 4
"""Requests allowed to wait for a compute slot before the server answers 429: a short queue keeps latency
honest."""


def default_compute_concurrency() -> int:
    """Concurrent kernel computations: 1 on machines with ≤ 2 cores (torch already uses every core), else
    cores // 2."""
    cores = os.cpu_count() or 1
    return 1 if cores <= 2 else cores // 2


def parse_api_keys(text: str, *, source: str = "NTK_API_KEYS") -> dict[str, Scope]:
    """Parse ``"key:scope,key:scope"`` (commas or newlines) into ``{key: scope}``.

    Args:
        text: the key list; blank entries and lines starting with ``#`` are skipped.
        source: where the text came from, for the error message. Default: ``"NTK_API_KEYS"``.

    Returns:
        dict mapping each key to ``"read"`` or ``"write"``.

    Raises:
        ValueError: an entry is not ``key:scope`` with scope ``read`` or ``write``, or its key has a character an
            HTTP header cannot carry (non-ASCII, control characters).
    """
    keys: dict[str, Scope] = {}
    entries = (raw.strip() for raw in text.replace("\n", ",").split(","))
    for number, entry in enumerate((e for e in entries if e and not e.startswith("#")), start=1):
        key, sep, scope = entry.rpartition(":")
        key, scope = key.strip(), scope.strip()
        if not sep or not key or scope not in SCOPES:
            shown = entry if len(entry) <= 12 else entry[:4] + "…"
            raise ValueError(
                f"{source}: entry {shown!r} is not 'key:scope' with scope 'read' or 'write'; "
                "write keys as e.g. 'my-secret-key:write'"
            )
        bad = next((i for i, char in enumerate(key) if not " " <= char <= "~"), None)
        if bad is not None:  # HTTP header values are ASCII: no client could ever send this key
            raise ValueError(
                f"{source}: the key of entry {number} has a non-ASCII or control character at position "
                f"{bad + 1}; API keys travel in the Authorization header, which carries only printable ASCII: "
                "use letters, digits and punctuation (e.g. from secrets.token_urlsafe())"
            )
        keys[key] = scope
    return keys


class Settings(BaseSettings):
    """Everything the service can be configured with (env prefix ``NTK_``)."""

    model_config = SettingsConfigDict(env_prefix="NTK_", env_nested_delimiter="__", extra="ignore")

    host: str = Field("127.0.0.1", description="Interface to bind. Without API keys only loopback is allowed.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    data_dir: Path = Field(Path("data"), description="Registry, weights and data sets live here (SQLite + files).")
    api_keys: str = Field("", description="API keys as 'key:scope,...' with scope read|write. Empty: open server.")
    api_key_file: Path | None = Field(None, description="File with one 'key:scope' per line (merged with api_keys).")
    model_factories: str = Field(
        "", description="Comma-separated 'module:function' factories clients may register models from."
    )
    memory_budget_bytes: int | None = Field(
        None,
        gt=0,
        description="Peak memory one kernel may plan for. Default: the engine's fraction of free RAM.",
    )
    compute_concurrency: int = Field(
        default_factory=default_compute_concurrency, ge=1, description="Kernel computations running at once."
    )
    compute_threads: int | None = Field(
        None, ge=1, description="torch threads per computation. Default: cores // compute_concurrency."
    )
    max_queue: int = Field(DEFAULT_MAX_QUEUE, ge=0, description="Kernel requests that may wait before 429.")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0, description="Largest request body (413 above).")
    max_json_response_bytes: int = Field(
        DEFAULT_MAX_JSON_RESPONSE_BYTES,
        gt=0,
        description="Largest JSON kernel response (406 above: use binary).",
    )
    max_binary_response_bytes: int = Field(
        DEFAULT_MAX_BINARY_RESPONSE_BYTES,
        gt=0,
        description="Largest job result sent in one piece (safetensors; 406 above: stream it as .npy).",
    )
    job_stream_block_bytes: int = Field(
        DEFAULT_STREAM_BLOCK_BYTES,
        gt=0,
        description="A streamed .npy job result is read and sent in pieces of at most this many bytes.",
    )
    side_cache_bytes: int = Field(DEFAULT_SIDE_CACHE_BYTES, ge=0, description="LRU of per-side intermediates.")
    reuse_large_buffers: bool = Field(
        False,
        description="Keep the large buffers of CPU kernels in malloc's heap for later kernels (fewer page faults per "
        "call) instead of returning them to the OS; the process then holds about its largest kernel's peak.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="Log level.")
    executor: Literal["local", "ray"] = Field(
        "local", description="Where job tiles run: in this process, or on Ray (needs ntk-service[ray])."
    )
    ray_address: str | None = Field(
        None, description="Ray cluster for executor=ray ('auto', 'ray://head:10001'). Default: a local Ray."
    )
    ray_num_gpus: float = Field(0, ge=0, description="GPUs reserved per Ray tile task (> 0 runs tiles on CUDA).")
    device: str = Field(
        "cpu",
        description="Where kernels and local job tiles run: 'cpu', 'cuda' or 'cuda:N' (checked at startup).",
    )
    allow_tf32: bool = Field(False, description="Let float32 kernels on CUDA use TF32 tensor cores (less precise).")
    job_tile_size: int = Field(
        256, ge=1, description="Examples per tile side when a job names none (a 256² FULL tile, k=10: 26 MB)."
    )
    job_panel_seconds: float = Field(
        4.0, gt=0, le=3600, description="Work a job's panel (its unit of work) targets, by the cost model's estimate."
    )
    job_side_cache_bytes: int | None = Field(
        None, ge=0, description="Side cache per running job (per Ray actor). Default: a quarter of the memory budget."
    )
    job_disk_budget_bytes: int | None = Field(
        None, gt=0, description="Disk all stored job results may take (413 above). Default: 90% of the free space."
    )
    shutdown_timeout_s: int = Field(
        30, ge=0, le=3600, description="On SIGTERM, how long in-flight requests may take to finish before cancelled."
    )
    job_results_dir: Path | None = Field(
        None, description="Job results (Zarr); shared storage for Ray clusters. Default: <data_dir>/jobs."
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: object) -> object:
        text = value.strip().lower() if isinstance(value, str) else value
        if not isinstance(text, str) or not _DEVICE_PATTERN.match(text):
            raise ValueError(f"NTK_DEVICE: {value!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'")
        return text

    @model_validator(mode="after")
    def _check_keys(self) -> Settings:
        self.api_key_scopes()  # fail at construction, not on the first request
        return self

    def api_key_scopes(self) -> dict[str, Scope]:
        """All configured keys, from ``api_keys`` and ``api_key_file``: ``{key: "read" | "write"}``.

        Raises:
            ValueError: a malformed entry, or an ``api_key_file`` that cannot be read.
        """
        keys = parse_api_keys(self.api_keys)
        if self.api_key_file is not None:
            try:
                text = self.api_key_file.read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"NTK_API_KEY_FILE: cannot read {str(self.api_key_file)!r}: {exc}") from exc
            keys.update(parse_api_keys(text, source=f"NTK_API_KEY_FILE {str(self.api_key_file)!r}"))
        return keys

    @property
    def is_open(self) -> bool:
        """True when no API key is configured: every request is allowed, so only loopback may be bound."""
        return not self.api_key_scopes()

    @property
    def allowed_factories(self) -> frozenset[str]:
        """The operator's allow-list of ``module:function`` model factories."""
        return frozenset(f.strip() for f in self.model_factories.split(",") if f.strip())

    def torch_threads(self) -> int:
        """torch intra-op threads per computation, so that threads × concurrent computations ≈ cores."""
        if self.compute_threads is not None:
            return self.compute_threads
        return max(1, (os.cpu_count() or 1) // self.compute_concurrency)
