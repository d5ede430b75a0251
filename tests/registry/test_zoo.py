"""Built-in families (exact semantics, errors, caps, seeds) and operator-allowed factories."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from ntk_service.errors import InvalidInput, PermissionDenied
from ntk_service.registry import build_model, list_architectures
from ntk_service.registry.families import self_attention
from ntk_service.registry.weights import canonical_tensors, serialize

from . import factories

MLP = {"family": "mlp", "input_dim": 3, "hidden": [5, 4], "output_dim": 2, "activation": "tanh"}
CNN = {
    "family": "cnn",
    "input_shape": [2, 7, 6],
    "channels": [3, 4],
    "kernel_size": 3,
    "strides": [1, 2],
    "padding": 1,
    "activation": "gelu",
    "output_dim": 3,
}
TRANSFORMER = {
    "family": "transformer",
    "vocab_size": 7,
    "max_len": 5,
    "d_model": 8,
    "n_heads": 2,
    "n_layers": 2,
    "d_ff": 12,
    "output_dim": 2,
}
FAMILIES = {"mlp": MLP, "cnn": CNN, "transformer": TRANSFORMER}


def _inputs(spec: Any, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.input_dtype == "int64":
        return torch.randint(0, TRANSFORMER["vocab_size"], (n, *spec.input_shape), generator=g)
    return torch.randn((n, *spec.input_shape), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_builds_and_runs(family: str) -> None:
    model, spec = build_model(FAMILIES[family], seed=0)
    assert not model.training
    x = _inputs(spec, 4)
    y = model(x)
    assert y.shape == (4, spec.output_dim) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_spec_of_each_family() -> None:
    assert build_model(MLP, 0)[1].input_shape == (3,)
    _, cnn = build_model(CNN, 0)
    assert (cnn.input_shape, cnn.input_dtype, cnn.output_dim) == ((2, 7, 6), "float32", 3)
    _, tr = build_model(TRANSFORMER, 0)
    assert (tr.input_shape, tr.input_dtype, tr.output_dim) == ((5,), "int64", 2)


@pytest.mark.parametrize("activation", ["relu", "tanh", "gelu", "erf"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_semantics(activation: str, bias: bool) -> None:
    model, _ = build_model({**MLP, "activation": activation, "bias": bias}, seed=1)
    names = [n for n, _ in model.named_parameters()]
    expected = [f"layers.{i}.{k}" for i in range(3) for k in (("weight", "bias") if bias else ("weight",))]
    assert names == expected
    act = {"relu": torch.relu, "tanh": torch.tanh, "gelu": nn.functional.gelu, "erf": torch.erf}[activation]
    x = torch.randn(6, 3)
    h = x
    for i, layer in enumerate(model.layers):
        h = h @ layer.weight.T + (layer.bias if bias else 0)
        if i < 2:
            h = act(h)
    torch.testing.assert_close(model(x), h)


def test_cnn_semantics() -> None:
    model, _ = build_model(CNN, seed=2)
    x = torch.randn(3, 2, 7, 6)
    h = x
    for i, stride in enumerate([1, 2]):
        w, b = model.state_dict()[f"convs.{i}.weight"], model.state_dict()[f"convs.{i}.bias"]
        h = nn.functional.gelu(nn.functional.conv2d(h, w, b, stride=stride, padding=1))
    assert h.shape == (3, 4, 4, 3)  # 7x6 -> 7x6 (stride 1, pad 1) -> 4x3 (stride 2)
    head = model.state_dict()
    expected = h.reshape(3, -1) @ head["head.weight"].T + head["head.bias"]
    assert head["head.weight"].shape == (3, 4 * 4 * 3)
    torch.testing.assert_close(model(x), expected)


def test_transformer_semantics() -> None:
    model, _ = build_model(TRANSFORMER, seed=3)
    tokens = torch.randint(0, 7, (4, 5))
    x = model.token_embedding.weight[tokens] + model.position_embedding.weight[:5]
    for block in model.blocks:
        h = block.norm1(x)
        x = x + block.attn(h, h, h, need_weights=False)[0]  # torch's own MultiheadAttention forward
        x = x + block.fc2(nn.functional.gelu(block.fc1(block.norm2(x))))
    expected = model.head(model.norm(x).mean(dim=1))
    torch.testing.assert_close(model(tokens), expected)
    a = model.blocks[0].attn
    z = torch.randn(2, 5, 8)
    torch.testing.assert_close(self_attention(a, z), a(z, z, z, need_weights=False)[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_per_example_jacobian_under_vmap(family: str) -> None:
    """The engine's path (vmap of jacrev over functional_call) runs on every family without warnings."""
    model, spec = build_model(FAMILIES[family], seed=0)
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = _inputs(spec, 3)

    def f(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f), (None, 0))(params, x)
    assert set(jac) == set(params)
    for name, j in jac.items():
        assert j.shape == (3, spec.output_dim, *params[name].shape)


def test_initialisation_follows_the_documented_rules() -> None:
    model, _ = build_model({**TRANSFORMER, "d_model": 64, "n_heads": 4, "d_ff": 32}, seed=0)
    sd = model.state_dict()
    assert torch.equal(sd["blocks.0.norm1.weight"], torch.ones(64))
    assert torch.equal(sd["blocks.0.attn.in_proj_bias"], torch.zeros(192))
    assert sd["blocks.0.attn.in_proj_weight"].abs().max() <= math.sqrt(6 / (64 + 192))
    assert sd["blocks.0.fc1.weight"].abs().max() <= 1 / math.sqrt(64)
    assert 0.8 < sd["token_embedding.weight"].std() < 1.2


def test_seeds_are_deterministic_and_leave_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    for arch in FAMILIES.values():
        a, _ = build_model(arch, seed=7)
        b, _ = build_model(arch, seed=7)
        c, _ = build_model(arch, seed=8)
        sha_a = serialize(canonical_tensors(a))[1]
        assert sha_a == serialize(canonical_tensors(b))[1]
        assert sha_a != serialize(canonical_tensors(c))[1]
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize(
    ("architecture", "fragments"),
    [
        ([1, 2], ["JSON object", "list"]),
        ({"hidden": [3]}, ["unknown architecture family None", "'cnn'", "'mlp'", "'transformer'"]),
        ({"family": "resnet"}, ["unknown architecture family 'resnet'"]),
        ({"family": "mlp", "input_dim": 3, "output_dim": 1}, ["hidden: Field required"]),
        ({**MLP, "hidden": [4, 0]}, ["hidden.1", "greater than or equal to 1", "got 0"]),
        ({**MLP, "input_dim": "3"}, ["input_dim", "valid integer", "got '3'"]),
        ({**MLP, "activation": "sigmoid"}, ["activation", "'relu', 'tanh', 'gelu' or 'erf'", "'sigmoid'"]),
        ({**MLP, "dropout": 0.1}, ["dropout: Extra inputs are not permitted"]),
        ({**CNN, "strides": [1]}, ["strides has 1 entries but channels has 2"]),
        ({**CNN, "input_shape": [1, 8]}, ["input_shape", "at least 3"]),
        (
            {**CNN, "padding": 0, "channels": [2, 2, 2, 2], "strides": [1, 1, 1, 1]},
            ["conv layer 2", "gets a 3x2 input", "smaller than its kernel"],
        ),
        ({**TRANSFORMER, "n_heads": 3}, ["d_model (8) must be divisible by n_heads (3)", "[1, 2, 4, 8]"]),
        ({**TRANSFORMER, "max_len": 100000}, ["max_len", "less than or equal to 4096"]),
        ({**MLP, "input_dim": 100_000, "hidden": [1000]}, ["100,003,002 parameters", "limit of 50,000,000"]),
        (
            {**CNN, "input_shape": [64, 512, 512], "channels": [64] * 4, "strides": [1] * 4, "output_dim": 1},
            ["167,772,161 activation values", "limit of 67,108,864"],
        ),
    ],
)
def test_bad_architectures_are_explained(architecture: Any, fragments: list[str]) -> None:
    with pytest.raises(InvalidInput) as info:
        build_model(architecture, seed=0)
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message


@pytest.mark.parametrize("seed", [-1, 2**63, True, 1.5, "1"])
def test_bad_seeds_are_refused(seed: Any) -> None:
    with pytest.raises(InvalidInput, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        build_model(MLP, seed=seed)


def _factory(func: str, **extra: Any) -> dict[str, Any]:
    return {"family": "factory", "factory": f"{factories.__name__}:{func}", "input_shape": [3], **extra}


def test_factory_allowed_builds_seeded_model() -> None:
    arch = _factory("tiny_mlp", kwargs={"width": 6, "outputs": 4})
    allowed = frozenset({arch["factory"]})
    model, spec = build_model(arch, seed=5, allowed_factories=allowed)
    again, _ = build_model(arch, seed=5, allowed_factories=allowed)
    assert (spec.input_shape, spec.input_dtype, spec.output_dim) == ((3,), "float32", 4)
    assert not model.training
    assert model(torch.zeros(2, 3)).shape == (2, 4)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True))


def test_factory_refused_unless_allowed() -> None:
    arch = _factory("tiny_mlp")
    with pytest.raises(PermissionDenied, match="not allowed on this server.*NTK_MODEL_FACTORIES"):
        build_model(arch, seed=0)
    with pytest.raises(PermissionDenied, match="not allowed"):
        build_model({**arch, "factory": "os:system"}, seed=0, allowed_factories=frozenset({arch["factory"]}))


@pytest.mark.parametrize(
    ("arch", "fragment"),
    [
        (_factory("not_a_module"), "returned int, expected a torch.nn.Module"),
        (_factory("tiny_mlp", kwargs={"depth": 3}), "failed with kwargs {'depth': 3}: TypeError"),
        (_factory("tiny_mlp", input_shape=[5]), "fails on an input of shape (1, 5) float32"),
        (_factory("missing_func"), "cannot be imported"),
        (_factory("huge_on_meta"), "built a model with 100,010,000 parameters, more than the limit of 50,000,000"),
        ({**_factory("tiny_mlp"), "factory": "os.system"}, "factory: String should match pattern"),
    ],
)
def test_factory_failures_are_explained(arch: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidInput) as info:
        build_model(arch, seed=0, allowed_factories=frozenset({arch["factory"]}))
    assert fragment in info.value.message, info.value.message


def test_list_architectures_describes_every_family() -> None:
    infos = {a.name: a for a in list_architectures(frozenset({"b.m:f", "a.m:f"}))}
    assert list(infos) == ["mlp", "cnn", "transformer", "sequential", "factory"]
    assert infos["factory"].factories == ["a.m:f", "b.m:f"] and infos["mlp"].factories is None
    layers = {layer.type: layer for layer in infos["sequential"].layers or []}
    assert {"Linear", "Conv2d", "BatchNorm2d", "TransformerEncoderLayer", "Residual", "MeanPool"} <= set(layers)
    assert [f.name for f in layers["Residual"].fields] == ["body", "shortcut"]
    assert layers["Residual"].fields[0].type == "list[layer]"
    mlp = {f.name: f for f in infos["mlp"].fields}
    assert mlp["hidden"].type == "list[int]" and mlp["hidden"].required
    assert mlp["activation"].type == "'relu' | 'tanh' | 'gelu' | 'erf'" and mlp["activation"].default == "relu"
    assert mlp["bias"].default is True and not mlp["bias"].required
    cnn = {f.name: f for f in infos["cnn"].fields}
    assert cnn["kernel_size"].default == 3 and cnn["strides"].type == "list[int] | null"
    for info in infos.values():
        assert info.description and all(f.description for f in info.fields)
        if info.name != "factory":
            build_model(info.example, seed=0)  # the examples are valid
    assert infos["factory"].model_dump(mode="json")["example"]["family"] == "factory"
