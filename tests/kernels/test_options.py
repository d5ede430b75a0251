"""NtkOptions: the frozen value of how to compute, and its one rule with the loose keywords (NOTE [loose keywords])."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, UnknownDevice, UnknownImplementation
from ntk_service.kernels import NtkImplementation, NtkOptions, StructuredOptions, compute_ntk, compute_ntk_groups
from tests.reference import assert_matches, reference_ntk


def _case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    return model, torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)


def test_fields_are_normalised_once_when_built() -> None:
    options = NtkOptions(implementation="structured", dtype="float64", memory_budget_bytes=2.0**30, device="cpu")
    assert options.implementation is NtkImplementation.STRUCTURED
    assert options.dtype is torch.float64
    assert options.memory_budget_bytes == 2**30 and isinstance(options.memory_budget_bytes, int)
    assert options.device == torch.device("cpu")
    assert options.structured == StructuredOptions()
    assert NtkOptions(structured=None).structured == StructuredOptions()  # type: ignore[arg-type]
    assert hash(options) == hash(
        NtkOptions(
            implementation="structured", dtype=torch.float64, memory_budget_bytes=2**30, device=torch.device("cpu")
        )
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dtype = torch.float32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "error", "needle"),
    [
        ({"implementation": "fastest"}, UnknownImplementation, "unknown implementation 'fastest'"),
        ({"dtype": "float16"}, InvalidInput, "dtype 'float16' is not supported"),
        ({"dtype": torch.int64}, InvalidInput, "expected 'float32' or 'float64'"),
        ({"memory_budget_bytes": 0}, InvalidInput, "memory_budget_bytes must be a positive number"),
        ({"memory_budget_bytes": True}, InvalidInput, "memory_budget_bytes must be a positive number"),
        ({"memory_budget_bytes": "1GB"}, InvalidInput, "memory_budget_bytes must be a positive number"),
        ({"device": "tpu"}, UnknownDevice, "device 'tpu' is not supported"),
        ({"allow_tf32": "yes"}, InvalidInput, "allow_tf32 must be True or False"),
        ({"structured": {"chain": False}}, InvalidInput, "structured must be a StructuredOptions, got dict"),
    ],
)
def test_bad_fields_are_refused_when_built(fields: dict[str, object], error: type[Exception], needle: str) -> None:
    with pytest.raises(error, match=needle):
        NtkOptions(**fields)  # type: ignore[arg-type]


def test_replace_changes_a_copy_and_refuses_unknown_fields() -> None:
    base = NtkOptions(dtype="float64")
    changed = base.replace(implementation="jacobian_contraction")
    assert base.implementation is NtkImplementation.AUTO
    assert changed.implementation is NtkImplementation.JACOBIAN_CONTRACTION and changed.dtype is torch.float64
    with pytest.raises(InvalidInput, match=r"NtkOptions.replace: unknown fields \['budget'\]"):
        base.replace(budget=10)
    with pytest.raises(InvalidInput, match="dtype 'half'"):
        base.replace(dtype="half")


@pytest.mark.parametrize("implementation", ["jacobian_contraction", "ntk_vector_products", "structured", "auto"])
def test_compute_ntk_with_options_matches_the_reference(implementation: str) -> None:
    model, x1, x2 = _case()
    options = NtkOptions(implementation=implementation, dtype="float64", device="cpu")
    result = compute_ntk(model, x1, x2, mode="full", options=options)
    assert_matches(result.theta, reference_ntk(model, x1, x2, "full"))
    if implementation != "auto":
        assert result.implementation.value == implementation


def test_the_options_budget_is_the_one_planned_for() -> None:
    model, x1, x2 = _case()
    with pytest.raises(MemoryEstimateExceeded) as refused:
        compute_ntk(model, x1, x2, options=NtkOptions(memory_budget_bytes=64))
    assert refused.value.budget_bytes == 64


def test_the_options_dtype_is_the_one_computed_in() -> None:
    model, x1, _ = _case()
    result = compute_ntk(model.float(), x1.float(), mode="trace", options=NtkOptions(dtype="float64"))
    assert result.theta.dtype is torch.float64


@pytest.mark.parametrize(
    "loose",
    [
        {"implementation": "structured"},
        {"dtype": torch.float64},
        {"memory_budget_bytes": 2**30},
        {"device": "cpu"},
        {"allow_tf32": False},
        {"structured_options": StructuredOptions().without("chain")},
    ],
    ids=lambda loose: next(iter(loose)),
)
def test_a_loose_keyword_beside_options_is_refused(loose: dict[str, object]) -> None:
    model, x1, _ = _case()
    (name,) = loose
    with pytest.raises(InvalidInput, match=rf"compute_ntk: {name} given together with options=; pass one or the other"):
        compute_ntk(model, x1, options=NtkOptions(), **loose)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=rf"compute_ntk_groups: {name} given together with options="):
        compute_ntk_groups(model, x1, groups="modules", options=NtkOptions(), **loose)  # type: ignore[arg-type]


def test_loose_keywords_alone_are_the_shorthand_for_options() -> None:
    model, x1, x2 = _case()
    result = compute_ntk(model, x1, x2, mode="trace", implementation="ntk_vector_products", dtype="float64")
    assert result.implementation is NtkImplementation.NTK_VECTOR_PRODUCTS
    assert_matches(result.theta, reference_ntk(model, x1, x2, "trace"))


def test_options_of_the_wrong_type_are_refused() -> None:
    model, x1, _ = _case()
    with pytest.raises(InvalidInput, match="compute_ntk: options must be an NtkOptions, got dict"):
        compute_ntk(model, x1, options={"dtype": "float64"})  # type: ignore[arg-type]


def test_compute_ntk_groups_takes_the_options() -> None:
    model, x1, x2 = _case()
    options = NtkOptions(implementation="structured", dtype="float64")
    result = compute_ntk_groups(model, x1, x2, groups={"head": ["2.*"]}, mode="full", options=options)
    assert result.implementation is NtkImplementation.STRUCTURED
    assert_matches(result.thetas["head"], reference_ntk(model, x1, x2, "full", ["2.*"]))
