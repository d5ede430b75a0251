"""compute_ntk_groups: Θ per parameter group against the float64 reference restricted to the group's columns."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from ntk_service.errors import (
    InvalidInput,
    MemoryEstimateExceeded,
    NoMatchingParameters,
    OverlappingGroups,
    UnknownImplementation,
)
from ntk_service.kernels import (
    DerivedMode,
    KernelMode,
    NtkGroupsResult,
    NtkImplementation,
    compute_ntk,
    compute_ntk_groups,
    parameter_groups,
)
from ntk_service.kernels.groups import GroupSpec
from ntk_service.kernels.structured import StructuredOptions
from tests.kernels.zoo import ZOO, TiedAutoencoder, ZooEntry, zoo_case
from tests.reference import assert_matches, reference_columns, reference_jacobian, reference_kernel

GROUP_IMPLEMENTATIONS = [NtkImplementation.JACOBIAN_CONTRACTION, NtkImplementation.STRUCTURED]
MODES: list[KernelMode | DerivedMode] = [*KernelMode, DerivedMode.PSEUDO]


@functools.cache
def _jacobians(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference J (n, k, P) of x1 and of x2 over all parameters."""
    model, x1, x2 = zoo_case(name)
    return reference_jacobian(model, x1), reference_jacobian(model, x2)


def _group_reference(name: str, names: tuple[str, ...], mode: str, with_x2: bool) -> torch.Tensor:
    """The reference kernel of the parameters ``names`` only: J restricted to their columns."""
    model, _, _ = zoo_case(name)
    cols = reference_columns(model, names)
    j1, j2 = _jacobians(name)
    j1 = j1[..., cols]
    return reference_kernel(j1, j2[..., cols] if with_x2 else j1, mode)


# Two groupings of every model: one group per module, and the weights against everything else ("rest"), which
# splits each Linear layer's weight from its bias (the structured path folds a bias into its weight's term).
GROUPINGS: list[tuple[dict[str, list[str]] | str, bool]] = [("modules", False), ({"weights": ["*weight"]}, True)]


_SLOW = {"cnn", "embedding"}  # seconds each under the shared machine's load: the whole product of modes runs there
_ZOO_PARAMS = [pytest.param(e, id=e.name, marks=[pytest.mark.slow] if e.name in _SLOW else []) for e in ZOO]


@pytest.mark.parametrize("entry", _ZOO_PARAMS)
@pytest.mark.parametrize("implementation", GROUP_IMPLEMENTATIONS, ids=str)
def test_group_kernels_match_the_restricted_reference(entry: ZooEntry, implementation: NtkImplementation) -> None:
    model, x1, x2 = zoo_case(entry.name)
    for groups, rest in GROUPINGS:
        for mode in MODES:
            for with_x2 in (True, False) if groups == "modules" else (True,):  # the bias split: either way alike
                result = compute_ntk_groups(
                    model,
                    x1,
                    x2 if with_x2 else None,
                    groups=groups,
                    rest=rest,
                    mode=mode,
                    implementation=implementation,
                    dtype=torch.float64,
                )
                assert result.implementation is implementation and result.mode is mode
                assert list(result.thetas) == list(result.parameters)
                for group, theta in result.thetas.items():
                    expected = _group_reference(entry.name, result.parameters[group], mode.value, with_x2)
                    assert_matches(theta, expected, 1e-10)
                    if not with_x2 and mode.spec.pairs:
                        assert torch.equal(theta, _swap(theta, mode))  # exactly symmetric, as compute_ntk's
                # every parameter is in a group: the groups add up to the whole kernel
                j1, j2 = _jacobians(entry.name)
                whole = reference_kernel(j1, j2 if with_x2 else j1, mode.value)
                assert_matches(result.total(), whole, 1e-10)


def _swap(theta: torch.Tensor, mode: KernelMode | DerivedMode) -> torch.Tensor:
    if mode is KernelMode.FULL:
        return theta.permute(1, 0, 3, 2)
    if mode is KernelMode.OUTPUT_DIAGONAL:
        return theta.permute(1, 0, 2)
    return theta.T


@pytest.mark.parametrize("entry", ZOO, ids=lambda e: e.name)
def test_auto_and_float32_group_kernels(entry: ZooEntry) -> None:
    model, x1, x2 = zoo_case(entry.name)
    result = compute_ntk_groups(model, x1, x2, groups="modules", mode="full")
    assert result.implementation in GROUP_IMPLEMENTATIONS
    for group, theta in result.thetas.items():
        assert theta.dtype == torch.float32
        assert_matches(theta, _group_reference(entry.name, result.parameters[group], "full", True), 1e-4)


def test_groups_equal_compute_ntk_over_their_parameters() -> None:
    """A grouping that leaves parameters out: the groups add up to compute_ntk over the listed ones only."""
    model, x1, x2 = zoo_case("mlp_tanh")
    res = compute_ntk_groups(model, x1, x2, groups={"first": ["0.*"], "last": ["4.weight"]}, dtype=torch.float64)
    assert res.parameters == {"first": ("0.weight", "0.bias"), "last": ("4.weight",)}
    subset = compute_ntk(model, x1, x2, params=["0.*", "4.weight"], dtype=torch.float64).theta
    torch.testing.assert_close(res.total(), subset, rtol=1e-12, atol=1e-12)
    assert_matches(res.thetas["last"], _group_reference("mlp_tanh", ("4.weight",), "full", True), 1e-10)


def test_module_grouping_names_every_module_with_parameters() -> None:
    mlp = parameter_groups(zoo_case("mlp_relu")[0], "modules")
    assert dict(zip(mlp.names, mlp.members, strict=True)) == {
        "0": ("0.weight", "0.bias"),
        "2": ("2.weight", "2.bias"),
        "4": ("4.weight", "4.bias"),
    }
    tied = parameter_groups(TiedAutoencoder(), "modules")  # the tied weight belongs to the first module holding it
    assert dict(zip(tied.names, tied.members, strict=True)) == {
        "encoder": ("encoder.weight", "encoder.bias"),
        "decoder": ("decoder.bias",),
        "head": ("head.weight", "head.bias"),
    }

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))
            self.body = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale * self.body(x)

    scaled = parameter_groups(Scaled(), "modules")
    assert dict(zip(scaled.names, scaled.members, strict=True)) == {
        "<root>": ("scale",),
        "body": ("body.weight", "body.bias"),
    }
    model, x = Scaled().double(), torch.randn(4, 3, dtype=torch.float64)
    res = compute_ntk_groups(model, x, groups="modules", mode="trace")
    j = reference_jacobian(model, x)
    assert_matches(res.thetas["<root>"], reference_kernel(j[..., :1], j[..., :1], "trace"), 1e-12)


def test_tied_weight_answers_to_each_of_its_names() -> None:
    model, x1, x2 = zoo_case("tied")
    res = compute_ntk_groups(model, x1, x2, groups={"dec": ["decoder.weight"]}, dtype=torch.float64)
    assert res.parameters == {"dec": ("encoder.weight",)}
    assert_matches(res.thetas["dec"], _group_reference("tied", ("encoder.weight",), "full", True), 1e-10)
    with pytest.raises(OverlappingGroups, match=re.escape("'encoder.weight' (as 'decoder.weight') is in both group")):
        parameter_groups(model, {"enc": ["encoder.*"], "dec": ["decoder.*"]})


def test_blocked_group_kernels_match_the_reference() -> None:
    """A budget that forces blocks smaller than N: the block runner's mirroring over the group axis."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x1, x2 = torch.randn(12, 3, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    j1, j2 = reference_jacobian(model, x1), reference_jacobian(model, x2)
    for implementation in GROUP_IMPLEMENTATIONS:
        for mode in KernelMode:
            for right in (x2, None):
                res = _blocked(model, x1, right, mode, implementation)
                for group, theta in res.thetas.items():
                    cols = reference_columns(model, res.parameters[group])
                    jr = j1 if right is None else j2
                    assert_matches(theta, reference_kernel(j1[..., cols], jr[..., cols], mode.value), 1e-10)


def _blocked(
    model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, mode: KernelMode, implementation: NtkImplementation
) -> NtkGroupsResult:
    """The group kernels under the largest budget (a fraction of the unblocked estimate) that blocks the examples."""
    kw = {"groups": "modules", "mode": mode, "implementation": implementation}
    whole = compute_ntk_groups(model, x1, x2, **kw)  # type: ignore[arg-type]
    for fraction in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4):
        budget = int(whole.estimate_bytes * fraction)
        try:
            res = compute_ntk_groups(model, x1, x2, memory_budget_bytes=budget, **kw)  # type: ignore[arg-type]
        except MemoryEstimateExceeded:
            break
        if res.block_size < x1.shape[0]:
            return res
    raise AssertionError(f"no budget blocked {implementation} {mode} (unblocked estimate {whole.estimate_bytes})")


def test_memory_estimate_scales_with_the_groups() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    x = torch.randn(64, 3)
    result_bytes = 64 * 64 * 3 * 3 * 4
    single = compute_ntk(model, x, memory_budget_bytes=2 * result_bytes)  # one kernel fits in twice its size
    assert single.estimate_bytes <= 2 * result_bytes
    with pytest.raises(MemoryEstimateExceeded, match="3 parameter groups") as refused:
        compute_ntk_groups(model, x, groups="modules", memory_budget_bytes=2 * result_bytes)
    assert refused.value.estimate_bytes is not None and refused.value.estimate_bytes >= 3 * result_bytes
    fits = compute_ntk_groups(model, x, groups="modules", memory_budget_bytes=8 * result_bytes)
    assert fits.estimate_bytes >= 3 * result_bytes and fits.stacked.shape == (3, 64, 64, 3, 3)


def test_vector_products_are_refused_and_auto_avoids_them() -> None:
    model, x1, _ = zoo_case("mlp_relu")
    with pytest.raises(UnknownImplementation, match="cannot split the kernel by group in one pass"):
        compute_ntk_groups(model, x1, groups="modules", implementation="ntk_vector_products")


def test_bad_groupings_are_refused_with_what_to_fix() -> None:
    model = zoo_case("mlp_relu")[0]
    cases: list[tuple[object, type[Exception], str]] = [
        ({"a": ["0.*"], "b": ["0.bias"]}, OverlappingGroups, "parameter '0.bias' is in both group 'a' and group 'b'"),
        ({"a": ["0.*"], "b": ["nope.*"]}, NoMatchingParameters, "glob 'nope.*' of group 'b' matches no parameter"),
        ({"a": []}, NoMatchingParameters, "group 'a' has no globs"),
        ({"a": "0.*"}, NoMatchingParameters, "write ['0.*']"),
        ({"a": ["0.*", 3]}, NoMatchingParameters, "not a non-empty string"),
        ({"a": [""]}, NoMatchingParameters, "not a non-empty string"),
        ({"": ["0.*"]}, InvalidInput, "group names must be non-empty strings"),
        ({}, InvalidInput, "groups is empty"),
        ("layers", InvalidInput, "is not a grouping; pass 'modules'"),
        (["0.*"], InvalidInput, "groups must be 'modules' or a mapping"),
    ]
    for groups, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            compute_ntk_groups(model, torch.randn(2, 4), groups=groups)  # type: ignore[arg-type]
    with pytest.raises(NoMatchingParameters, match="every parameter is already in a group"):
        compute_ntk_groups(model, torch.randn(2, 4), groups="modules", rest=True)
    with pytest.raises(InvalidInput, match="a group is called 'rest'"):
        compute_ntk_groups(model, torch.randn(2, 4), groups={"rest": ["0.*"]}, rest=True)


@pytest.mark.parametrize("groups", ["modules", {"weights": ["*weight"], "biases": ["*bias"]}], ids=["modules", "split"])
def test_structured_groups_with_and_without_the_fused_finish_match_the_reference(groups: GroupSpec) -> None:
    """FULL groups fuse each group's last plain factored term into the pass that writes its block (a group of one
    term, a bias apart from its weight, several terms); with ``fused_finish`` off every group is finished plainly."""
    model, x1, x2 = zoo_case("mlp_tanh")
    resolved = parameter_groups(model, groups)
    for options in (StructuredOptions(), StructuredOptions().without("fused_finish")):
        for with_x2 in (True, False):
            result = compute_ntk_groups(
                model,
                x1,
                x2 if with_x2 else None,
                groups=groups,
                implementation="structured",
                dtype=torch.float64,
                structured_options=options,
            )
            assert list(result.thetas) == list(resolved.names)
            for group, theta in result.thetas.items():
                expected = _group_reference(
                    "mlp_tanh", dict(zip(resolved.names, resolved.members, strict=True))[group], "full", with_x2
                )
                assert_matches(theta, expected, 1e-10)
