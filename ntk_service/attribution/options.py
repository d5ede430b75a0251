"""``AttributionOptions``: how attribution scores are computed, as one frozen value of plain fields.

Every field is a string, a number, None or a tuple of strings, so a job can store the value as JSON
(``to_dict`` / ``from_dict``) and a server can build it from a request body; it is checked once, when built.

NOTE [ridge choice]: the ridge is relative: λ = ``ridge`` × the mean diagonal of the training kernel K = G Gᵀ of the
output-function gradients G (the mean ‖g_n‖² over the rows of G; for the sketch, ‖Φ g_n‖², its unbiased estimate).
So one number means the same for any model scale, for sketched and exact features alike, and for both the feature
space (D × D) and the kernel space (N × N) forms of the solve, which agree by the push-through identity only when
λ is the same absolute number. ``DEFAULT_RIDGE`` is chosen on the digits benchmark (docs/attribution.md, "Choosing
the ridge"): LDS rises steeply from ridge 0 (TRAK's default, no ridge) to a broad plateau around 0.1-1 and falls
slowly after it towards the plain gradient dot product (ridge → ∞); the default sits on the plateau.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ntk_service.errors import InvalidInput
from ntk_service.kernels.sketch.features import MAX_FEATURE_DIM

__all__ = [
    "DEFAULT_DIM",
    "DEFAULT_RIDGE",
    "AttributionLoss",
    "AttributionOptions",
    "Ensemble",
    "FeatureKind",
]


class AttributionLoss(StrEnum):
    """The training loss: it decides the output function, its Hessian rows and the loss-gradient weights."""

    CROSS_ENTROPY = "cross_entropy"
    """Labels are class indices (N,); the output function is TRAK's margin log(p_y / (1 − p_y)), one row per
    example, and the loss weight is 1 − p_y (module docstring of ``targets.py``)."""

    MSE = "mse"
    """Targets are (N, *out) floats; the Hessian rows are all k outputs (the Gauss-Newton matrix of ½‖f − y‖²) and
    the loss weights are the residuals y − f."""


class FeatureKind(StrEnum):
    """Where the features Φ come from."""

    STRUCTURED = "structured"
    """``ntk_features(sketch="structured")``: a Kronecker sketch of δ ⊗ a, D columns; the default."""

    GAUSSIAN = "gaussian"
    """``ntk_features(sketch="gaussian")``: J R / √D by forward-mode products; for models the structured sketch
    refuses."""

    EXACT = "exact"
    """The exact kernel from ``compute_ntk`` and its eigenvectors (no sketch, no ``dim``): N·c × N·c float64, for
    training sets whose kernel fits in memory."""


class Ensemble(StrEnum):
    """How scores of several checkpoints are combined."""

    TRAK = "trak"
    """TRAK's rule (Park et al. 2023, eq. 17): the mean over checkpoints of the unweighted scores, times the mean
    over checkpoints of the loss weights."""

    MEAN = "mean"
    """The mean over checkpoints of each checkpoint's weighted scores."""


DEFAULT_DIM = 2048
"""D of the sketch: TRAK's default projection size, so results compare at equal D; the structured sketch's cost per
column is small (docs/benchmarks.md), and the scores' error against the exact kernel's falls like 1/√D
(docs/attribution.md, "Exactness")."""

DEFAULT_RIDGE = 0.3
"""λ / mean diagonal of the training kernel: the top of the plateau of the LDS-vs-ridge curves of the digits
benchmark, sketched (D = 2048) and exact (NOTE [ridge choice]; the curves are in docs/attribution.md)."""


def _kind(value: object, enum: type[StrEnum], field: str) -> Any:
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return enum(value)
    except ValueError:
        raise InvalidInput(
            f"AttributionOptions: {field} must be one of {[v.value for v in enum]}, got {value!r}"
        ) from None


@dataclass(frozen=True)
class AttributionOptions:
    """How to compute attribution scores; every field has the default a plain call uses.

    Example::

        >>> opts = AttributionOptions(loss="mse", dim=4096)
        >>> AttributionOptions.from_dict(opts.to_dict()) == opts
        True

    Attributes:
        loss: "cross_entropy" (class indices) or "mse" (float targets) (``AttributionLoss``). Default:
            "cross_entropy".
        features: "structured", "gaussian" or "exact" (``FeatureKind``). Default: "structured".
        dim: D, the sketch size, in [1, ``MAX_FEATURE_DIM``]; ignored for "exact". Default: ``DEFAULT_DIM``.
        ridge: λ relative to the mean diagonal of the training kernel (NOTE [ridge choice]), a finite number ≥ 0;
            0 is TRAK's default and takes the pseudo-inverse. Default: ``DEFAULT_RIDGE``.
        ensemble: how checkpoints combine (``Ensemble``). Default: "trak".
        seed: the sketch of checkpoint c uses seed + c (independent sketches average out over an ensemble).
            Default: 0.
        params: glob patterns over parameter names: attribute through that subset only. Default: None (all).
        dtype: "float32" or "float64": the dtype the features are computed in (solves are always float64).
            Default: None, the model's dtype.
        memory_budget_bytes: peak memory of a call. Default: None, half the available memory.
        rows_per_chunk: training examples per chunk of the feature pass. Default: None (as many as fit the budget,
            at most 4096).

    Raises:
        InvalidInput: an unknown loss, feature kind or ensemble; dim outside [1, MAX_FEATURE_DIM]; a negative or
            non-finite ridge; a dtype other than float32 / float64; a budget or chunk size that is not a positive
            integer; params that are not strings.
    """

    loss: AttributionLoss = AttributionLoss.CROSS_ENTROPY
    features: FeatureKind = FeatureKind.STRUCTURED
    dim: int = DEFAULT_DIM
    ridge: float = DEFAULT_RIDGE
    ensemble: Ensemble = Ensemble.TRAK
    seed: int = 0
    params: tuple[str, ...] | None = None
    dtype: str | None = None
    memory_budget_bytes: int | None = None
    rows_per_chunk: int | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "loss", _kind(self.loss, AttributionLoss, "loss"))
        set_(self, "features", _kind(self.features, FeatureKind, "features"))
        set_(self, "ensemble", _kind(self.ensemble, Ensemble, "ensemble"))
        if not _is_int(self.dim) or not 1 <= self.dim <= MAX_FEATURE_DIM:
            raise InvalidInput(
                f"AttributionOptions: dim must be an integer in [1, {MAX_FEATURE_DIM}], got {self.dim!r}; the scores' "
                "error falls like 1/√dim, so a few thousand columns usually suffice"
            )
        if isinstance(self.ridge, bool) or not isinstance(self.ridge, numbers.Real) or not math.isfinite(self.ridge):
            raise InvalidInput(f"AttributionOptions: ridge must be a finite number ≥ 0, got {self.ridge!r}")
        if self.ridge < 0:
            raise InvalidInput(f"AttributionOptions: ridge must be ≥ 0, got {self.ridge}")
        set_(self, "ridge", float(self.ridge))
        if not _is_int(self.seed) or self.seed < 0:
            raise InvalidInput(f"AttributionOptions: seed must be an integer ≥ 0, got {self.seed!r}")
        if self.params is not None:
            if isinstance(self.params, str) or not all(isinstance(p, str) for p in self.params):
                raise InvalidInput(
                    f"AttributionOptions: params must be a list of glob strings, e.g. ['head.*'], got {self.params!r}"
                )
            set_(self, "params", tuple(self.params))
        if self.dtype not in (None, "float32", "float64"):
            raise InvalidInput(f"AttributionOptions: dtype must be 'float32' or 'float64', got {self.dtype!r}")
        for field in ("memory_budget_bytes", "rows_per_chunk"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or value < 1):
                raise InvalidInput(f"AttributionOptions: {field} must be a positive integer, got {value!r}")

    def replace(self, **changes: Any) -> AttributionOptions:
        """A copy with ``changes`` applied and checked again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values: enums as their strings, params as a list."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("loss", "features", "ensemble"):
            out[name] = out[name].value
        out["params"] = None if self.params is None else list(self.params)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AttributionOptions:
        """The value ``to_dict`` wrote (or a request body's fields).

        Raises:
            InvalidInput: an unknown field name, or a field ``__post_init__`` refuses.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidInput(f"AttributionOptions: unknown field(s) {unknown}; expected some of {sorted(known)}")
        return cls(**values)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
