"""KernelSpec: the frozen value of what to compute, its JSON form, and the seven public functions taking it and
``options=`` (NOTE [loose keywords])."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, NoMatchingParameters, UnknownMode
from ntk_service.kernels import (
    DerivedMode,
    KernelMode,
    KernelSpec,
    NtkOptions,
    StructuredOptions,
    compute_nngp,
    compute_ntk,
    compute_ntk_groups,
    dataset_operator,
    feature_kernel,
    monte_carlo_ntk,
    ntk_features,
    ntk_operator,
)
from tests.reference import assert_matches, reference_ntk


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)


def test_every_spelling_is_normalised_once_when_built() -> None:
    spec = KernelSpec(mode="trace", params=["2.*"], output=None, groups=None)
    assert spec.mode is KernelMode.TRACE and spec.params == ("2.*",)
    assert KernelSpec(mode=DerivedMode.PSEUDO).mode is DerivedMode.PSEUDO
    assert spec == KernelSpec(mode=KernelMode.TRACE, params=("2.*",))
    assert hash(spec) == hash(KernelSpec(mode=KernelMode.TRACE, params=("2.*",)))
    grouped = KernelSpec(groups={"a": ["0.*"], "b": ("2.weight",)}, rest=True)
    assert grouped.groups == (("a", ("0.*",)), ("b", ("2.weight",)))
    assert grouped.group_mapping == {"a": ["0.*"], "b": ["2.weight"]}
    assert KernelSpec(groups="modules").group_mapping == "modules"
    parsed = KernelSpec(output="logits[:, 0]").output_path
    assert parsed is not None and parsed.text == "logits[:, 0]"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.mode = KernelMode.FULL  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "error", "needle"),
    [
        ({"mode": "diag"}, UnknownMode, "unknown mode 'diag'; expected one of 'full', 'trace'"),
        ({"params": "0.*"}, NoMatchingParameters, "params must be a list of glob strings"),
        ({"params": []}, NoMatchingParameters, "params=[] selects nothing"),
        ({"output": 3}, InvalidInput, "output must be a string path"),
        ({"output": "logits[:"}, InvalidInput, "output path 'logits[:'"),
        ({"groups": "layers"}, InvalidInput, "is not a grouping"),
        ({"groups": {"a": "0.*"}}, NoMatchingParameters, "write ['0.*']"),
        ({"rest": True}, InvalidInput, "rest=True needs groups"),
        ({"rest": "yes", "groups": "modules"}, InvalidInput, "rest must be True or False"),
        ({"layer": 3}, InvalidInput, "layer must be a module name"),
    ],
)
def test_bad_fields_are_refused_when_built(fields: dict[str, object], error: type[Exception], needle: str) -> None:
    with pytest.raises(error) as info:
        KernelSpec(**fields)  # type: ignore[arg-type]
    assert needle in str(info.value)


def test_json_round_trip_is_plain_json() -> None:
    specs = [
        KernelSpec(),
        KernelSpec(mode="pseudo", params=["0.*", "2.bias"], output="logits[..., 1:3]"),
        KernelSpec(mode="output_diagonal", groups={"a": ["0.*"], "b": ["2.*"]}, rest=True),
        KernelSpec(groups="modules", layer="1"),
    ]
    for spec in specs:
        text = json.dumps(spec.to_json())  # plain JSON: no enums or tuples left
        again = KernelSpec.from_json(json.loads(text))
        assert again == spec and hash(again) == hash(spec)
        assert again.output_path == spec.output_path
    with pytest.raises(InvalidInput, match=r"unknown fields \['colour'\]"):
        KernelSpec.from_json({"mode": "full", "colour": "red"})


def test_options_json_round_trip() -> None:
    options = NtkOptions(
        implementation="structured",
        dtype="float64",
        memory_budget_bytes=2**30,
        device="cpu",
        allow_tf32=True,
        structured=StructuredOptions(chain=False, form="factored"),
    )
    data = json.loads(json.dumps(options.to_json()))
    assert data["structured"] == {"form": "factored", "chain": False}  # only what differs from the defaults
    assert NtkOptions.from_json(data) == options
    assert NtkOptions.from_json(NtkOptions().to_json()) == NtkOptions()
    with pytest.raises(InvalidInput, match="structured must be an object of StructuredOptions fields"):
        NtkOptions.from_json({"structured": {"turbo": True}})
    with pytest.raises(InvalidInput, match=r"unknown fields \['colour'\]"):
        NtkOptions.from_json({"colour": "red"})


def test_spec_gives_the_reference_kernel() -> None:
    model, (x1, x2) = _model(), _inputs()
    spec = KernelSpec(mode="trace", params=["2.*"])
    theta = compute_ntk(model, x1, x2, spec=spec, options=NtkOptions(implementation="structured")).theta
    assert_matches(theta, reference_ntk(model, x1, x2, mode="trace", params=["2.*"]))
    grouped = compute_ntk_groups(model, x1, x2, spec=KernelSpec(mode="full", groups={"head": ["2.*"]}))
    assert_matches(grouped.thetas["head"], reference_ntk(model, x1, x2, mode="full", params=["2.*"]))


def test_loose_keywords_or_spec_never_both() -> None:
    model, (x1, _) = _model(), _inputs()
    with pytest.raises(
        InvalidInput, match=r"compute_ntk: mode given together with spec=; .*spec\.replace\(mode=\.\.\.\)"
    ):
        compute_ntk(model, x1, spec=KernelSpec(), mode="trace")
    with pytest.raises(InvalidInput, match="compute_nngp: spec must be a KernelSpec, got dict"):
        compute_nngp(model, x1, spec={"mode": "trace"})  # type: ignore[arg-type]
    with pytest.raises(UnknownMode, match="ntk_operator: unknown mode 'diag'"):
        ntk_operator(model, x1, mode="diag")


def test_fields_a_function_does_not_use_are_refused() -> None:
    model, (x1, _) = _model(), _inputs()
    with pytest.raises(InvalidInput, match="compute_ntk: groups=.* is not used here; it is for compute_ntk_groups"):
        compute_ntk(model, x1, spec=KernelSpec(groups="modules"))
    with pytest.raises(InvalidInput, match="compute_ntk_groups: groups is required"):
        compute_ntk_groups(model, x1, mode="trace")
    with pytest.raises(InvalidInput, match="compute_nngp: params=.* is not used here"):
        compute_nngp(model, x1, spec=KernelSpec(params=["0.*"]))
    with pytest.raises(InvalidInput, match="ntk_features: mode=.* is not used here"):
        ntk_features(model, x1, dim=8, spec=KernelSpec(mode="trace"))
    with pytest.raises(InvalidInput, match="dataset_operator: output='logits' is not used"):
        dataset_operator(model, x1.numpy(), spec=KernelSpec(output="logits"))


def test_every_public_function_takes_spec_and_options() -> None:
    """The seven public functions with ``spec=`` and ``options=`` give the kernels of their keyword forms, which the
    float64 reference checks where the function is exact."""
    model, (x1, x2) = _model(), _inputs()
    trace = KernelSpec(mode="trace")
    options = NtkOptions(dtype="float64", memory_budget_bytes=2**28, implementation="jacobian_contraction")
    expected = reference_ntk(model, x1, x2, mode="trace")

    assert_matches(compute_ntk(model, x1, x2, spec=trace, options=options).theta, expected)
    groups = compute_ntk_groups(model, x1, x2, spec=trace.replace(groups="modules"), options=options)
    assert_matches(groups.total(), expected)
    op = ntk_operator(model, x1, x2, spec=trace, options=options)
    v = torch.randn(3, dtype=torch.float64)
    assert_matches(op.matvec(v), expected @ v)
    streamed = dataset_operator(model, x1.numpy(), x2.numpy(), spec=trace, options=options)
    assert_matches(streamed.matvec(v), expected @ v)

    nngp = compute_nngp(model, x1, x2, spec=trace, options=options)
    f1, f2 = model(x1), model(x2)
    assert_matches(nngp.theta, (f1 @ f2.T).detach())

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()

    mc = monte_carlo_ntk(build, x1, x2, seeds=[0, 1], spec=trace, options=options)
    mean = (reference_ntk(build(0), x1, x2, mode="trace") + reference_ntk(build(1), x1, x2, mode="trace")) / 2
    assert_matches(mc.mean, mean)

    phi = ntk_features(model, x1, dim=4096, seed=0, spec=KernelSpec(params=["2.*"]), options=options)
    sketched = feature_kernel(phi, mode="trace")
    exact = reference_ntk(model, x1, mode="trace", params=["2.*"])
    # unbiased, error ~ 1/√D (NOTE [sketch error]): a loose bound far from the rounding floor
    assert np.abs((sketched - exact).numpy()).max() <= 0.5 * exact.abs().max().item()


def test_options_reach_every_function() -> None:
    """A budget in ``options`` is the one each function plans against (its refusal carries it; Monte Carlo's
    fallback plans one model against what its accumulators leave of it)."""
    model, (x1, x2) = _model(), _inputs()
    tiny = NtkOptions(memory_budget_bytes=64)
    for call in (
        lambda: compute_ntk(model, x1, x2, options=tiny),
        lambda: compute_nngp(model, x1, x2, options=tiny),
        lambda: ntk_operator(model, x1, x2, options=tiny),
        lambda: dataset_operator(model, x1.numpy(), options=tiny),
        lambda: ntk_features(model, x1, dim=8, options=tiny),
        lambda: monte_carlo_ntk(lambda s: _model(), x1, seeds=[0], options=tiny),
    ):
        with pytest.raises(MemoryEstimateExceeded) as info:
            call()
        assert info.value.budget_bytes is not None and 1 <= info.value.budget_bytes <= 64
    with pytest.raises(InvalidInput, match="memory_budget_bytes given together with options="):
        ntk_features(model, x1, dim=8, options=tiny, memory_budget_bytes=10)


def test_a_device_other_than_the_models_is_refused_where_the_model_computes() -> None:
    """Functions that keep a copy of the model (or build one per seed) compute where it is: ``options.device``
    naming another device is refused, not ignored. (A model on ``meta`` stands in for a second device here.)"""
    model, (x1, _) = _model(), _inputs()
    elsewhere = copy.deepcopy(model).to("meta")
    options = NtkOptions(device="cpu")
    for call in (
        lambda: ntk_operator(elsewhere, x1, options=options),
        lambda: dataset_operator(elsewhere, x1.numpy(), options=options),
        lambda: ntk_features(elsewhere, x1, dim=8, options=options),
        lambda: monte_carlo_ntk(lambda s: copy.deepcopy(elsewhere), x1, seeds=[0], options=options),
    ):
        with pytest.raises(InvalidInput, match="options.device is 'cpu' but the model is on 'meta'"):
            call()
    assert ntk_operator(model, x1, options=options).shape == (8, 8)  # the model's own device is fine
