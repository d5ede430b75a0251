"""The ``sequential`` family: every refusal and its message, names identical to the user's ``nn.Sequential``, the
explicit encoder layer against torch's, and the engine on a ResNet and a transformer spec against the reference."""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from ntk_service.client._module_spec import SUPPORTED_TYPES, describe_module
from ntk_service.errors import InvalidInput
from ntk_service.kernels.api import compute_ntk
from ntk_service.layers import NtkConv1d, NtkConv2d, NtkLinear, Residual
from ntk_service.registry import ModelRegistry, build_model
from ntk_service.registry.layer_specs import LAYER_SPECS
from ntk_service.registry.limits import MAX_NESTING
from ntk_service.registry.sequential import ExplicitTransformerEncoderLayer
from ntk_service.registry.zoo import MAX_PARAMS
from tests.reference import assert_matches, reference_ntk
from tests.registry.sequential_models import (
    RESNET_INPUT,
    TRANSFORMER_LEN,
    TRANSFORMER_VOCAB,
    nested_resnet,
    small_resnet,
    small_transformer,
    train_steps,
)

IMPLEMENTATIONS = ("structured", "jacobian_contraction", "ntk_vector_products", "auto")


def _seq(*layers: dict[str, Any], input_shape: list[int] | None = None, dtype: str = "float32") -> dict[str, Any]:
    return {"family": "sequential", "input_shape": input_shape or [4], "input_dtype": dtype, "layers": list(layers)}


def _refused(architecture: dict[str, Any]) -> str:
    with pytest.raises(InvalidInput) as info:
        build_model(architecture, seed=0, operation="register 'r'")
    return info.value.message


# ---------------------------------------------------------------- refusals, each with its message


def test_unknown_layer_type_is_named_with_the_allowed_ones() -> None:
    message = _refused(_seq({"type": "Linear", "in_features": 4, "out_features": 4}, {"type": "Bilinear"}))
    assert "layer layers.1: unknown layer type 'Bilinear'" in message
    assert "Conv2d" in message and "TransformerEncoderLayer" in message and "operator factory" in message


def test_a_keyword_that_is_not_allowed_is_named() -> None:
    bad = {"type": "Embedding", "num_embeddings": 5, "embedding_dim": 3, "max_norm": 1.0}
    message = _refused(_seq(bad, input_shape=[2], dtype="int64"))
    assert "layer layers.0 (Embedding): keyword 'max_norm' not allowed" in message
    assert "Embedding takes num_embeddings, embedding_dim, padding_idx" in message
    nested = {"type": "Residual", "body": [{"type": "ReLU", "inplace": True}]}
    assert "layer layers.0.body.0 (ReLU): keyword 'inplace' not allowed" in _refused(_seq(nested))


def test_a_bad_value_is_named_with_its_path() -> None:
    message = _refused(_seq({"type": "Linear", "in_features": "4", "out_features": 2}))
    assert "layers.0.Linear.in_features: Input should be a valid integer (got '4')" in message


def test_too_many_parameters_are_refused_before_anything_is_allocated() -> None:
    # 2**40 float32 parameters would be 4 TiB: the count comes from the meta device, and fast.
    started = time.perf_counter()
    message = _refused(_seq({"type": "Linear", "in_features": 1 << 20, "out_features": 1 << 20}, input_shape=[1 << 20]))
    assert time.perf_counter() - started < 10
    assert f"has {(1 << 40) + (1 << 20):,} parameters, more than the server's limit of {MAX_PARAMS:,}" in message
    assert "counted before allocating anything" in message


def test_batchnorm_without_running_statistics_is_refused() -> None:
    layers = [{"type": "Conv2d", "in_channels": 1, "out_channels": 2, "kernel_size": 1}]
    bn = {"type": "BatchNorm2d", "num_features": 2, "track_running_stats": False}
    message = _refused(_seq(*layers, bn, input_shape=[1, 3, 3]))
    assert "layer layers.1 (BatchNorm2d): track_running_stats=false normalises every batch" in message
    assert "upload the layer's running_mean and running_var" in message
    local = nn.Sequential(nn.BatchNorm1d(3, track_running_stats=False))
    with pytest.raises(InvalidInput, match=r"module at 0 is a BatchNorm with track_running_stats=False"):
        describe_module(local, input_shape=(3,))


def test_weights_without_running_statistics_are_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    spec = describe_module(model, input_shape=(3,))
    state = {k: v for k, v in model.state_dict().items() if k not in {"1.running_mean", "1.running_var"}}
    registry = ModelRegistry(tmp_path)
    with pytest.raises(InvalidInput) as info:
        registry.register_weights("bn", spec, safetensors.torch.save(state))
    assert "missing tensors: 1.running_mean, 1.running_var" in info.value.message


def test_weights_missing_extra_or_misshapen_are_all_named(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    spec = describe_module(model, input_shape=(3,))
    registry = ModelRegistry(tmp_path)
    registry.register_weights("m", spec, safetensors.torch.save(model.state_dict()))
    state = dict(model.state_dict())
    del state["0.bias"]
    state["extra.weight"] = torch.zeros(2)
    state["2.weight"] = torch.zeros(2, 5)
    with pytest.raises(InvalidInput) as info:
        registry.add_version("m", safetensors.torch.save(state))
    message = info.value.message
    assert "missing tensors: 0.bias" in message and "unexpected tensors: extra.weight" in message
    assert "mismatched tensors: 2.weight (expected [2, 4] float32, got [2, 5] float32)" in message
    assert [r.version for r in registry.versions("m")] == [1]


def test_nesting_beyond_the_limit_is_refused() -> None:
    layer: dict[str, Any] = {"type": "ReLU"}
    for _ in range(MAX_NESTING + 1):
        layer = {"type": "Residual", "body": [layer]}
    message = _refused(_seq(layer))
    path = "layers.0" + ".body.0" * MAX_NESTING
    assert f"layer {path} (Residual) is nested {MAX_NESTING + 1} deep, more than the limit of {MAX_NESTING}" in message
    ok: dict[str, Any] = {"type": "ReLU"}
    for _ in range(MAX_NESTING):
        ok = {"type": "Residual", "body": [ok]}
    build_model(_seq(ok), seed=0)  # exactly at the limit is fine


def test_nested_sequentials_count_towards_the_nesting_limit() -> None:
    layer: dict[str, Any] = {"type": "ReLU"}
    for depth in range(MAX_NESTING + 1):
        even = depth % 2 == 0  # the outermost (depth 4) and the innermost are Sequential
        layer = {"type": "Sequential", "layers": [layer]} if even else {"type": "Residual", "body": [layer]}
    message = _refused(_seq(layer))
    assert f"(Sequential) is nested {MAX_NESTING + 1} deep, more than the limit of {MAX_NESTING}" in message
    assert "layer layers.0.layers.0.body.0.layers.0.body.0 (Sequential)" in message
    local = nn.ReLU()
    for _ in range(MAX_NESTING + 1):
        local = nn.Sequential(local)
    with pytest.raises(InvalidInput, match=r"layer layers(\.0\.layers)+\.0 \(Sequential\) is nested 5 deep"):
        build_model(describe_module(nn.Sequential(local), input_shape=(2,)), seed=0)


def test_a_nested_sequential_is_checked_like_the_outer_one() -> None:
    inner = {"type": "Sequential", "layers": [{"type": "Linear", "in_features": 5, "out_features": 2}]}
    message = _refused(_seq({"type": "Linear", "in_features": 4, "out_features": 4}, inner))
    assert "layer layers.1.layers.0 (Linear) fails on its input of shape (1, 4)" in message
    assert "layer layers.0.layers.0 (ReLU): keyword 'inplace' not allowed" in _refused(
        _seq({"type": "Sequential", "layers": [{"type": "ReLU", "inplace": True}]})
    )
    assert "layers.0.Sequential.layers: List should have at least 1 item" in _refused(
        _seq({"type": "Sequential", "layers": []})
    )


def test_a_sequential_with_named_children_is_refused_with_the_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(OrderedDict(fc=nn.Linear(2, 2), act=nn.ReLU())))
    with pytest.raises(InvalidInput) as info:
        describe_module(model, input_shape=(2,))
    assert "the module at 1.fc is named 'fc', not '0'" in info.value.message
    assert "build the nn.Sequential from a list of layers" in info.value.message


@pytest.mark.parametrize(
    ("layers", "input_shape", "dtype", "fragments"),
    [
        (
            [{"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel_size": 5}],
            [3, 4, 4],
            "float32",
            ["layer layers.0 (Conv2d) fails on its input of shape (1, 3, 4, 4)", "Kernel size can't be greater"],
        ),
        (
            [{"type": "Linear", "in_features": 5, "out_features": 2}],
            [4],
            "float32",
            ["layer layers.0 (Linear) fails on its input of shape (1, 4)", "[1, 4] X [5, 2]"],
        ),
        (
            [
                {"type": "Conv2d", "in_channels": 2, "out_channels": 2, "kernel_size": 1},
                {
                    "type": "Residual",
                    "body": [{"type": "Conv2d", "in_channels": 2, "out_channels": 4, "kernel_size": 3, "stride": 2}],
                },
            ],
            [2, 5, 5],
            "float32",
            [
                "layer layers.1 (Residual): its body maps (1, 2, 5, 5) to (1, 4, 2, 2)",
                "(identity shortcut) is (1, 2, 5, 5)",
            ],
        ),
        (
            [{"type": "Linear", "in_features": 4, "out_features": 2}],
            [4],
            "int64",
            ["layer layers.0 (Linear) needs a float tensor but gets a int64 tensor of shape (1, 4)"],
        ),
        (
            [{"type": "Flatten", "start_dim": 0}],
            [4],
            "float32",
            ["layer layers.0 (Flatten): start_dim=0 is the batch dimension of its input (1, 4)"],
        ),
        (
            [{"type": "MeanPool", "dim": -3}],
            [4, 2],
            "float32",
            ["layer layers.0 (MeanPool): dim=-3 is the batch dimension of its input (1, 4, 2)"],
        ),
        (
            [{"type": "TransformerEncoderLayer", "d_model": 6, "nhead": 4, "batch_first": True}],
            [3, 6],
            "float32",
            ["layer layers.0 (TransformerEncoderLayer) cannot be built: embed_dim must be divisible by num_heads"],
        ),
    ],
)
def test_a_spec_that_fails_on_the_declared_input_names_the_layer_and_shapes(
    layers: list[dict[str, Any]], input_shape: list[int], dtype: str, fragments: list[str]
) -> None:
    message = _refused(_seq(*layers, input_shape=input_shape, dtype=dtype))
    for fragment in fragments:
        assert fragment in message


def test_w_std_without_ntk_parameterization_is_refused() -> None:
    message = _refused(_seq({"type": "Linear", "in_features": 4, "out_features": 2, "w_std": 2.0}))
    assert "layer layers.0 (Linear): w_std and b_std apply only to parameterization 'ntk'" in message


def test_a_module_the_family_cannot_express_is_named_by_its_path() -> None:
    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = nn.Sequential(nn.Linear(2, 2), Residual(nn.Sequential(nn.ReLU(), Block())))
    with pytest.raises(InvalidInput) as info:
        describe_module(model, input_shape=(2,))
    assert "the module at 1.body.1 is a tests.registry.test_sequential." in info.value.message
    assert "Block, which the 'sequential' architecture does not support" in info.value.message
    assert "factory" in info.value.message
    with pytest.raises(InvalidInput, match="expected a torch.nn.Sequential, got torch.nn.modules.linear.Linear"):
        describe_module(nn.Linear(2, 2), input_shape=(2,))


def test_nested_sequentials_keep_the_users_names_and_function() -> None:
    torch.manual_seed(3)
    model = nested_resnet()
    train_steps(model, torch.randn(6, *RESNET_INPUT), 2)  # BatchNorm running statistics move off 0 and 1
    spec = describe_module(model, input_shape=RESNET_INPUT)
    assert [layer["type"] for layer in spec["layers"]] == ["Sequential"] * 4
    built, info = build_model(spec, seed=0)
    assert info.output_dim == 3
    names = [(k, v.shape) for k, v in model.state_dict().items()]
    assert [(k, v.shape) for k, v in built.state_dict().items()] == names
    assert "1.0.body.0.weight" in dict(names) and "2.0.shortcut.1.running_var" in dict(names)
    built.load_state_dict(model.state_dict())  # the user's own state_dict, unchanged
    x = torch.randn(4, *RESNET_INPUT, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(built.double()(x), copy.deepcopy(model).double()(x), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- same names, same function


def test_client_and_server_agree_on_the_allowed_layer_types() -> None:
    assert set(SUPPORTED_TYPES) == set(LAYER_SPECS)


def _every_layer_model() -> tuple[nn.Sequential, tuple[int, ...]]:
    """One of every supported module, with non-default keywords, on (B, 2, 6, 6) inputs."""
    return (
        nn.Sequential(
            nn.Conv2d(2, 4, (3, 2), stride=(1, 2), padding=(1, 0), dilation=1, bias=False, padding_mode="reflect"),
            NtkConv2d(4, 4, 1, w_std=1.5, b_std=0.2),
            nn.BatchNorm2d(4, eps=1e-3, momentum=None),
            nn.GroupNorm(2, 4, eps=1e-4),
            nn.LeakyReLU(0.2),
            nn.MaxPool2d(2, stride=1, padding=1, ceil_mode=True),
            nn.AvgPool2d(2, count_include_pad=False),
            nn.AdaptiveAvgPool2d((2, 2)),
            nn.Flatten(2),  # (B, 4, 4)
            nn.Conv1d(4, 3, 3, padding="same"),
            NtkConv1d(3, 3, 1, bias=False, w_std=0.5),
            nn.ELU(0.5),
            nn.LayerNorm(4, elementwise_affine=False),
            nn.RMSNorm([3, 4], eps=1e-6),
            nn.Flatten(),
            nn.BatchNorm1d(12),
            nn.Dropout(0.3),
            NtkLinear(12, 8, w_std=2.0, b_std=0.1),
            nn.GELU("tanh"),
            Residual(nn.Sequential(nn.Linear(8, 8), nn.SiLU()), shortcut=nn.Sequential(nn.Identity())),
            nn.Softplus(2.0, 10.0),
            nn.Linear(8, 6),
            nn.Sigmoid(),
            nn.Identity(),
            nn.Tanh(),
            nn.ReLU(),
            nn.Linear(6, 3),
        ),
        (2, 6, 6),
    )


def test_every_layer_round_trips_with_the_same_names_and_function() -> None:
    torch.manual_seed(0)
    model, shape = _every_layer_model()
    train_steps(model, torch.randn(5, *shape), 1)
    spec = describe_module(model, input_shape=shape)
    built, info = build_model(spec, seed=0)
    assert info.output_dim == 3
    assert [(k, v.shape) for k, v in built.state_dict().items()] == [
        (k, v.shape) for k, v in model.state_dict().items()
    ]
    built.load_state_dict(model.state_dict())
    x = torch.randn(4, *shape, dtype=torch.float64)
    with torch.no_grad():
        expected = copy.deepcopy(model).double()(x)
        assert torch.allclose(built.double()(x), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("norm_first", "activation", "bias"), [(True, "gelu", True), (False, "relu", False)])
def test_explicit_encoder_layer_computes_torchs_function(norm_first: bool, activation: str, bias: bool) -> None:
    torch.manual_seed(1)
    kwargs: dict[str, Any] = dict(
        dropout=0.1, activation=activation, batch_first=True, norm_first=norm_first, bias=bias, dtype=torch.float64
    )
    stock = nn.TransformerEncoderLayer(8, 2, 16, **kwargs).eval()
    explicit = ExplicitTransformerEncoderLayer(8, 2, 16, **kwargs).eval()
    explicit.load_state_dict(stock.state_dict())
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    assert torch.allclose(explicit(x), stock(x), rtol=0, atol=1e-12)
    assert [n for n, _ in explicit.named_parameters()] == [n for n, _ in stock.named_parameters()]


def test_seeded_sequential_models_are_reproducible() -> None:
    spec = describe_module(small_resnet(), input_shape=RESNET_INPUT)
    a, _ = build_model(spec, seed=3)
    b, _ = build_model(spec, seed=3)
    c, _ = build_model(spec, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["0.weight"], sc["0.weight"])
    assert torch.equal(sa["1.running_var"], torch.ones(4)) and torch.equal(sa["1.running_mean"], torch.zeros(4))


# ---------------------------------------------------------------- the engine sees through the layers


@pytest.mark.slow
@pytest.mark.parametrize("which", ["resnet", "nested_resnet", "transformer"])
def test_engine_matches_the_reference_on_the_registry_models(which: str) -> None:
    torch.manual_seed(2)
    if which in ("resnet", "nested_resnet"):
        local, shape, dtype = (small_resnet() if which == "resnet" else nested_resnet()), RESNET_INPUT, "float32"
        x = torch.randn(6, *shape)
    else:
        local, shape, dtype = small_transformer(), (TRANSFORMER_LEN,), "int64"
        x = torch.randint(0, TRANSFORMER_VOCAB, (6, *shape))
    train_steps(local, x, 1)
    built, _ = build_model(describe_module(local, input_shape=shape, input_dtype=dtype), seed=0)
    built.load_state_dict(local.state_dict())
    x1, x2 = x[:2], x[2:4]
    expected = reference_ntk(built, x1, x2)
    for implementation in IMPLEMENTATIONS:
        result = compute_ntk(built, x1, x2, implementation=implementation, dtype=torch.float64)
        assert_matches(result.theta, expected)
