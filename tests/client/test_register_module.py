"""End to end against the real server: a user's own ResNet and transformer, built as ``nn.Sequential`` and trained
a few steps (the nested ResNet with stages as nn.Sequential, names like ``1.0.body.0.weight``), registered with
``register_module``, a second checkpoint uploaded; the kernels of both versions over
HTTP equal ``compute_ntk`` on the user's local modules and the float64 reference loop."""

from __future__ import annotations

import copy
import uuid

import pytest
import torch
from torch import nn

from ntk_service.client import Client
from ntk_service.errors import InvalidInput
from ntk_service.kernels.api import compute_ntk
from tests.conftest import LiveServer
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


def _inputs(which: str, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if which != "transformer":
        return torch.randn(n, *RESNET_INPUT, generator=generator)
    return torch.randint(0, TRANSFORMER_VOCAB, (n, TRANSFORMER_LEN), generator=generator)


@pytest.mark.slow
# The user's own nn.TransformerEncoderLayer calls scaled_dot_product_attention, which torch runs under vmap with a
# "performance drop" warning (no batching rule); the server's copy computes the attention explicitly.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("which", ["resnet", "nested_resnet", "transformer"])
def test_register_module_versions_and_kernels(live_server: LiveServer, which: str) -> None:
    torch.manual_seed(0)
    model = {"resnet": small_resnet, "nested_resnet": nested_resnet, "transformer": small_transformer}[which]()
    shape, dtype = (RESNET_INPUT, "float32") if which != "transformer" else ((TRANSFORMER_LEN,), "int64")
    train_x = _inputs(which, 8, seed=1)
    train_steps(model, train_x, 2, seed=1)
    epoch0 = copy.deepcopy(model)
    name = f"own-{which}-{uuid.uuid4().hex[:6]}"

    with Client(live_server.url, api_key=live_server.write_key) as client:
        first = client.register_module(name, model, input_shape=shape, input_dtype=dtype, label="epoch 0")
        assert (first["version"], first["label"], first["seed"]) == (1, "epoch 0", None)
        assert [p["name"] for p in first["parameters"]] == [n for n, _ in model.named_parameters()]
        assert first["num_params"] == sum(p.numel() for p in model.parameters())
        assert first["architecture"]["family"] == "sequential" and first["input_dtype"] == dtype

        train_steps(model, train_x, 1, seed=2)
        second = client.upload_weights(name, model.state_dict(), label="epoch 1")
        assert (second["version"], second["label"]) == (2, "epoch 1")

        versions = client.list_versions(name)
        assert [(v["version"], v["label"]) for v in versions] == [(1, "epoch 0"), (2, "epoch 1")]
        assert versions[0]["created_at"] < versions[1]["created_at"]
        assert client.get_model(name, version=1)["weights_sha256"] == first["weights_sha256"]
        assert client.get_model(name)["version"] == 2

        downloaded = client.download_weights(name, 1, as_torch=True)
        assert sorted(downloaded) == sorted(epoch0.state_dict())  # buffers (running statistics) included
        for key, tensor in epoch0.state_dict().items():
            assert torch.equal(downloaded[key], tensor), key

        x1, x2 = _inputs(which, 2, seed=3), _inputs(which, 2, seed=4)
        thetas = []
        for version, local in ((1, epoch0), (2, model)):
            theta = client.ntk(name, x1.numpy(), x2.numpy(), dtype="float64", version=version, as_torch=True)
            here = compute_ntk(local, x1, x2, implementation="jacobian_contraction", dtype=torch.float64).theta
            assert_matches(theta, here.double())
            assert_matches(theta, reference_ntk(local, x1, x2))
            thetas.append(theta)
        # the checkpoints' kernels differ, so serving the wrong version would fail the comparisons above
        assert (thetas[0] - thetas[1]).abs().max() > 1e-3 * thetas[0].abs().max()


def test_register_module_exports_what_the_family_cannot_express(live_server: LiveServer) -> None:
    class Twice(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    model = nn.Sequential(nn.Linear(3, 3), Twice())
    name = f"twice-{uuid.uuid4().hex[:6]}"
    with Client(live_server.url, api_key=live_server.write_key) as client:
        record = client.register_module(name, model, input_shape=(3,))  # a module of its own: exported
        assert record["architecture"]["family"] == "exported"
        assert record["architecture"]["operators"] == ["torch.ops.aten.linear.default", "torch.ops.aten.mul.Tensor"]
        # A spec the server refuses comes back with its message: the layer and the shapes.
        with pytest.raises(InvalidInput, match=r"layer layers\.0 \(Linear\) fails on its input of shape \(1, 4\)"):
            client.register_module("never", model[:1], input_shape=(4,))
        assert "never" not in {m["name"] for m in client.list_models()}
