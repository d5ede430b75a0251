"""``AttributionOptions`` is a plain value: JSON round trip, checked once when built, a clear error per bad field."""

from __future__ import annotations

import json

import pytest

from ntk_service.attribution import DEFAULT_DIM, DEFAULT_RIDGE, AttributionOptions
from ntk_service.errors import InvalidInput
from ntk_service.kernels import MAX_FEATURE_DIM


def test_defaults_and_a_json_round_trip() -> None:
    opts = AttributionOptions()
    assert (opts.loss, opts.features, opts.dim, opts.ridge, opts.ensemble) == (
        "cross_entropy",
        "structured",
        DEFAULT_DIM,
        DEFAULT_RIDGE,
        "trak",
    )
    custom = AttributionOptions(loss="mse", features="gaussian", dim=512, ridge=1, params=["2.*"], dtype="float64")
    stored = json.loads(json.dumps(custom.to_dict()))
    assert AttributionOptions.from_dict(stored) == custom
    assert custom.params == ("2.*",) and isinstance(custom.ridge, float)
    assert custom.replace(dim=64).dim == 64


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"dim": 0}, r"dim must be an integer in \[1, 65536\], got 0"),
        ({"dim": MAX_FEATURE_DIM + 1}, "dim must be an integer"),
        ({"dim": 1.5}, "dim must be an integer"),
        ({"dim": True}, "dim must be an integer"),
        ({"ridge": -1.0}, "ridge must be ≥ 0"),
        ({"ridge": float("nan")}, "ridge must be a finite number"),
        ({"ridge": "0.1"}, "ridge must be a finite number"),
        ({"loss": "hinge"}, r"loss must be one of \['cross_entropy', 'mse'\]"),
        ({"features": "exactly"}, "features must be one of"),
        ({"ensemble": "median"}, "ensemble must be one of"),
        ({"dtype": "float16"}, "dtype must be 'float32' or 'float64'"),
        ({"seed": -1}, "seed must be an integer ≥ 0"),
        ({"params": "head.*"}, "params must be a list of glob strings"),
        ({"memory_budget_bytes": 0}, "memory_budget_bytes must be a positive integer"),
        ({"rows_per_chunk": 2.0}, "rows_per_chunk must be a positive integer"),
    ],
)
def test_each_bad_field_is_refused_by_name(fields: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        AttributionOptions(**fields)  # type: ignore[arg-type]


def test_unknown_stored_fields_are_refused() -> None:
    with pytest.raises(InvalidInput, match=r"unknown field\(s\) \['lambda'\]"):
        AttributionOptions.from_dict({"lambda": 0.1})
