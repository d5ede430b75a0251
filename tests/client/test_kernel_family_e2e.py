"""The client's kernel-family methods against a real server, in both answer formats, checked against the float64
reference on the model rebuilt from the downloaded weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ntk_service.client import Client, MonteCarloKernel, NngpKernel
from ntk_service.errors import InvalidInput, UnknownLayer
from ntk_service.registry.zoo import build_model
from tests.conftest import LiveServer
from tests.reference import reference_ntk
from tests.server.support import TINY_ARCHITECTURES, sample_inputs

NAME = "client-family-mlp"


@pytest.fixture(scope="module")
def model(live_server: LiveServer) -> torch.nn.Module:
    """The registered model (version 1 is seeded: the same weights as build_model with its seed)."""
    with Client(live_server.url, api_key=live_server.write_key, timeout=60) as writer:
        writer.register_model(NAME, TINY_ARCHITECTURES["mlp"], seed=3)
    return build_model(TINY_ARCHITECTURES["mlp"], 3)[0]


@pytest.mark.parametrize("transport_format", ["json", "safetensors"])
def test_nngp_monte_carlo_matvec_and_pseudo_from_the_client(
    live_server: LiveServer, model: torch.nn.Module, transport_format: str
) -> None:
    record = {"input_shape": [4], "input_dtype": "float32"}
    x1, x2 = sample_inputs(record, 3, seed=1), sample_inputs(record, 2, seed=2)
    t1, t2 = torch.from_numpy(x1), torch.from_numpy(x2)
    with Client(live_server.url, api_key=live_server.read_key, transport_format=transport_format) as client:
        result = client.nngp_result(NAME, x1, x2, layer="activation", mode="trace", dtype="float64")
        assert isinstance(result, NngpKernel) and result.layer == "activation" and result.features == 8
        with torch.no_grad():
            phi1, phi2 = torch.tanh(model.double().layers[0](t1.double())), torch.tanh(model.layers[0](t2.double()))
        np.testing.assert_allclose(result.kernel, (phi1 @ phi2.T).numpy(), rtol=1e-9)

        mc = client.monte_carlo(NAME, x1, seeds=[4, 5], mode="pseudo", dtype="float64", as_torch=True)
        assert isinstance(mc, MonteCarloKernel) and isinstance(mc.mean, torch.Tensor)
        samples = torch.stack([reference_ntk(build_model(TINY_ARCHITECTURES["mlp"], s)[0], t1) for s in (4, 5)])
        np.testing.assert_allclose(mc.mean.numpy(), (samples.sum(dim=(3, 4)) / 3).mean(0).numpy(), rtol=1e-9)

        full = reference_ntk(model, t1, t2)
        v = np.random.default_rng(0).standard_normal((2, 3))
        product = client.matvec(NAME, x1, x2, v=v, dtype="float64")
        np.testing.assert_allclose(product, torch.einsum("nmab,mb->na", full, torch.from_numpy(v)).numpy(), rtol=1e-9)

        pseudo = client.ntk(NAME, x1, x2, mode="pseudo", dtype="float64")
        np.testing.assert_allclose(pseudo, (full.sum(dim=(2, 3)) / 3).numpy(), rtol=1e-9)

        with pytest.raises(UnknownLayer, match="layer 'head' is not a module"):
            client.nngp(NAME, x1, layer="head")
        with pytest.raises(InvalidInput, match="seeds is empty"):
            client.monte_carlo(NAME, x1, seeds=[])
        for bad in (1.5, np.float64(2.5), "7", True):  # never truncated or coerced into a seed on the way
            with pytest.raises(InvalidInput, match=r"seeds\.0: Input should be a valid integer"):
                client.monte_carlo(NAME, x1, seeds=[bad, 9])
        assert client.monte_carlo(NAME, x1, seeds=np.array([4, 5]), mode="trace").n_samples == 2
