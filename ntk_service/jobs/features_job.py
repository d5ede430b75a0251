"""Features: sketched NTK features Φ (N, k, D) of a data set's rows (``ntk_features``), stored as a zarr array.

Rows are read from the data set's memory map ``rows_per_chunk`` at a time; each chunk's Φ is one ``ntk_features``
call with the job's seed, D, params and sketch kind, written to its own zarr chunk (a Zarr v3 group
``features.zarr`` holding the array ``phi`` with ``dimension_names`` ("example", "output", "feature"), so xarray
opens it directly). The sketch's draws depend only on (seed, D, params, sketch), never on the chunking (NOTE
[sketch determinism] in ``kernels/sketch/sketch_draws.py``): the same spec gives the same Φ on any worker, and on any
chunk size to float rounding (BLAS may sum in another order for another batch size). A chunk is the unit a features
job records as done (``jobs/kinds/features.py``), so a resumed job computes only the chunks it lacks.

A spec stored before the ``sketch`` field existed reads as "gaussian", the only sketch of that time, so such a job
reruns to the same Φ; a new job takes the library's ``DEFAULT_SKETCH`` unless it names one.

``feature_block`` forms Φ1 Φ2ᵀ for row ranges of two feature arrays block by block, so a kernel from features reads
only the rows it returns.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch import nn

from ntk_service.errors import InvalidInput, ShapeMismatch
from ntk_service.kernels.sketch.features import MAX_FEATURE_DIM, SketchKind, feature_kernel, ntk_features

__all__ = [
    "FEATURES_ARRAY",
    "PAIRED_FIELDS",
    "FeaturesSpec",
    "RowChunks",
    "check_pairable",
    "compute_chunk",
    "create_features",
    "feature_block",
    "open_features",
]

FEATURES_ARRAY = "phi"
"""The array's name inside ``features.zarr``."""

CHUNK_BYTES = 8 * 2**20
"""Target size of one stored chunk (rows_per_chunk rows of k·D numbers): large enough that zarr's per-chunk cost
is small, small enough that a chunk is one modest ``ntk_features`` call."""

_OPERATION = "features job"


class RowChunks:
    """Rows stored (and computed) in chunks of ``rows_per_chunk``, the last one shorter: a mixin for a spec with
    ``n`` rows (each chunk is a tile of its job)."""

    __slots__ = ()
    n: int
    rows_per_chunk: int

    @property
    def chunks(self) -> int:
        """How many chunks: ⌈n / rows_per_chunk⌉."""
        return math.ceil(self.n / self.rows_per_chunk)

    def chunk_rows(self, chunk: int) -> tuple[int, int]:
        """The rows ``[lo, hi)`` of chunk ``chunk`` (relative to the spec's first row)."""
        lo = chunk * self.rows_per_chunk
        return lo, min(self.n, lo + self.rows_per_chunk)


@dataclass(frozen=True, slots=True)
class FeaturesSpec(RowChunks):
    """What a features job computes.

    Attributes:
        model, version: the model version. dataset, start, n: the rows ``[start, start + n)``. k: outputs.
        dim: D. seed: the sketch's seed. params: parameter globs (None: all). dtype: "float32" / "float64".
        rows_per_chunk: rows per ``ntk_features`` call and per stored chunk. memory_budget_bytes: per call.
        sketch (SketchKind): "structured" or "gaussian" (a wire value is accepted); "gaussian" for a spec stored
            without it.
    """

    model: str
    version: int
    dataset: str
    start: int
    n: int
    k: int
    dim: int
    seed: int = 0
    params: tuple[str, ...] | None = None
    dtype: str = "float32"
    rows_per_chunk: int = 256
    memory_budget_bytes: int | None = None
    sketch: SketchKind = SketchKind.GAUSSIAN

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "sketch", SketchKind(self.sketch))
        set_field(self, "params", None if self.params is None else tuple(self.params))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeaturesSpec:
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The stored (JSON) form: the sketch's wire value, params as a list."""
        data = asdict(self)
        data["sketch"] = self.sketch.value
        data["params"] = None if self.params is None else list(self.params)
        return data


def check_dim(dim: int) -> int:
    """D as an int in [1, MAX_FEATURE_DIM].

    Raises:
        InvalidInput: D outside the limits.
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_FEATURE_DIM:
        raise InvalidInput(f"{_OPERATION}: dim D must be an integer in [1, {MAX_FEATURE_DIM}], got {dim!r}")
    return dim


def default_rows_per_chunk(k: int, dim: int, itemsize: int) -> int:
    """Rows per chunk so that one chunk is about ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (k * dim * itemsize))


def create_features(spec: FeaturesSpec, path: Path) -> zarr.Array[Any]:
    """Create the (empty) group and array of Φ (n, k, D) at ``path``, one chunk per ``rows_per_chunk`` rows;
    overwrites what is there."""
    group = zarr.open_group(str(path), mode="w", attributes={"spec": spec.to_dict()})
    return group.create_array(
        FEATURES_ARRAY,
        shape=(spec.n, spec.k, spec.dim),
        chunks=(spec.rows_per_chunk, spec.k, spec.dim),
        dtype=np.float64 if spec.dtype == "float64" else np.float32,
        dimension_names=("example", "output", "feature"),
    )


def compute_chunk(spec: FeaturesSpec, module: nn.Module, rows: Any, chunk: int) -> np.ndarray:
    """Φ of chunk ``chunk``'s rows, (rows, k, D) in the spec's dtype: one ``ntk_features`` call.

    Raises:
        InvalidInput, MemoryEstimateExceeded, UnsupportedModel: from ``ntk_features``.
    """
    lo, hi = spec.chunk_rows(chunk)
    x = torch.from_numpy(np.array(rows[lo:hi]))
    phi = ntk_features(
        module,
        x,
        dim=spec.dim,
        seed=spec.seed,
        params=spec.params,
        dtype=spec.dtype,
        memory_budget_bytes=spec.memory_budget_bytes,
        sketch=spec.sketch,
    )
    return phi.detach().cpu().numpy().astype(np.float64 if spec.dtype == "float64" else np.float32, copy=False)


def open_features(path: Path, *, writable: bool = False) -> zarr.Array[Any]:
    """The stored Φ (n, k, D): read only, or open for writing chunks (``writable``)."""
    return zarr.open_group(str(path), mode="r+" if writable else "r")[FEATURES_ARRAY]  # type: ignore[return-value]


PAIRED_FIELDS = ("model", "version", "dim", "seed", "params", "sketch")
"""What two features jobs must share for Φ1 Φ2ᵀ to estimate Θ: one model version and one draw of the sketch."""


def check_pairable(spec1: dict[str, Any], spec2: dict[str, Any]) -> None:
    """Raises InvalidInput naming every field of ``PAIRED_FIELDS`` in which two stored features specs differ
    (a spec stored without ``sketch`` reads as "gaussian")."""
    one, two = (FeaturesSpec(**spec).to_dict() for spec in (spec1, spec2))
    differ = [f"{name} {one[name]!r} vs {two[name]!r}" for name in PAIRED_FIELDS if one[name] != two[name]]
    if differ:
        raise InvalidInput(
            f"kernel from features: the two jobs differ in {', '.join(differ)}; Φ1 Φ2ᵀ estimates Θ only for "
            "features of one model version drawn with the same sketch (dim, seed, params and sketch alike)"
        )


def feature_block(
    phi1: zarr.Array[Any],
    phi2: zarr.Array[Any],
    rows: tuple[int, int],
    cols: tuple[int, int],
    *,
    mode: str,
    block_rows: int = 256,
) -> np.ndarray:
    """Φ1[rows] Φ2[cols]ᵀ in float64: (r, c, k, k) FULL or (r, c) TRACE, reading Φ1 ``block_rows`` rows at a time.

    Raises:
        ShapeMismatch: feature arrays of different (k, D) (different models, D, or params).
    """
    if tuple(phi1.shape[1:]) != tuple(phi2.shape[1:]):
        raise ShapeMismatch(
            f"kernel from features: the feature arrays have shapes {tuple(phi1.shape)} and {tuple(phi2.shape)}; "
            "both need the same k and D (features jobs of the same model, dim and params, with the same seed)"
        )
    right = torch.from_numpy(np.asarray(phi2[cols[0] : cols[1]], dtype=np.float64))
    parts = []
    for lo in range(rows[0], rows[1], block_rows):
        left = torch.from_numpy(np.asarray(phi1[lo : min(rows[1], lo + block_rows)], dtype=np.float64))
        parts.append(feature_kernel(left, right, mode=mode).numpy())
    return np.concatenate(parts)
