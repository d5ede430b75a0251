"""NTK parameterization: the kernel of ``mlp`` and ``sequential`` layers with ``parameterization: "ntk"`` equals
the closed form written out by hand from y = (w_std/√fan_in)·x Wᵀ + b_std·b (neural-tangents' stax.Dense(
parameterization="ntk")), for every implementation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from ntk_service.errors import InvalidInput
from ntk_service.kernels.api import compute_ntk
from ntk_service.registry import build_model

IMPLEMENTATIONS = ("structured", "jacobian_contraction", "ntk_vector_products", "auto")
W_STD, B_STD = 1.7, 0.3
D, N_HIDDEN, K = 3, 5, 2


def _two_layer_ntk(
    w1: torch.Tensor, w2: torch.Tensor, b1: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor
) -> torch.Tensor:
    """Θ_cd(x, x') of f(x) = (σw/√n) W2 tanh(z) + σb b2, z = (σw/√d) W1 x + σb b1, by hand: (N, M, k, k).

    ∂f_c/∂W2[c', j] = δ_cc' (σw/√n) tanh(z_j)            ∂f_c/∂b2[c'] = δ_cc' σb
    ∂f_c/∂W1[j, i] = (σw/√n) W2[c, j] tanh'(z_j) (σw/√d) x_i    ∂f_c/∂b1[j] = (σw/√n) W2[c, j] tanh'(z_j) σb
    """
    n, d = w1.shape

    def z(x: torch.Tensor) -> torch.Tensor:
        return (W_STD / math.sqrt(d)) * x @ w1.T + B_STD * b1  # (N, n)

    z1, z2 = z(x1), z(x2)
    h1, h2 = torch.tanh(z1), torch.tanh(z2)
    g1, g2 = 1 - h1**2, 1 - h2**2
    eye = torch.eye(w2.shape[0], dtype=x1.dtype)
    top = (W_STD**2 / n) * (h1 @ h2.T) + B_STD**2  # (N, M)
    inner = (W_STD**2 / d) * (x1 @ x2.T) + B_STD**2  # (N, M)
    # Σ_j W2[c, j] W2[d, j] g1[N, j] g2[M, j]
    mixed = torch.einsum("cj,dj,aj,bj->abcd", w2, w2, g1, g2) * (W_STD**2 / n)
    return top[:, :, None, None] * eye + mixed * inner[:, :, None, None]


@pytest.mark.parametrize("family", ["mlp", "sequential"])
def test_ntk_parameterized_mlp_matches_the_kernel_written_out_by_hand(family: str) -> None:
    if family == "mlp":
        architecture = {
            "family": "mlp", "input_dim": D, "hidden": [N_HIDDEN], "output_dim": K, "activation": "tanh",
            "parameterization": "ntk", "w_std": W_STD, "b_std": B_STD,
        }  # fmt: skip
        first, second = "layers.0", "layers.1"
    else:
        ntk = {"parameterization": "ntk", "w_std": W_STD, "b_std": B_STD}
        architecture = {
            "family": "sequential",
            "input_shape": [D],
            "layers": [
                {"type": "Linear", "in_features": D, "out_features": N_HIDDEN, **ntk},
                {"type": "Tanh"},
                {"type": "Linear", "in_features": N_HIDDEN, "out_features": K, **ntk},
            ],
        }
        first, second = "0", "2"
    model, _ = build_model(architecture, seed=4)
    state = {k: v.double() for k, v in model.state_dict().items()}
    # NTK parameterization draws every parameter from N(0, 1): none is at PyTorch's U(±1/√fan_in) scale.
    assert state[f"{first}.weight"].abs().max() > 1 / math.sqrt(D)
    x1 = torch.randn(4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x2 = torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w1, b1, w2, b2 = (
        state[f"{first}.weight"],
        state[f"{first}.bias"],
        state[f"{second}.weight"],
        state[f"{second}.bias"],
    )
    z = (W_STD / math.sqrt(D)) * x1 @ w1.T + B_STD * b1
    by_hand = (W_STD / math.sqrt(N_HIDDEN)) * torch.tanh(z) @ w2.T + B_STD * b2
    with torch.no_grad():
        assert torch.allclose(model.double()(x1), by_hand, rtol=0, atol=1e-12)
    expected = _two_layer_ntk(w1, w2, b1, x1, x2)
    for implementation in IMPLEMENTATIONS:
        theta = compute_ntk(model, x1, x2, implementation=implementation, dtype=torch.float64).theta
        err = (theta - expected).abs().max().item()
        assert err <= 1e-10 * expected.abs().max().item(), (implementation, err)


def test_ntk_parameterized_conv_matches_the_kernel_written_out_by_hand() -> None:
    """f = flatten(conv(x)) with one NtkConv2d: Θ[(c,p), (d,q)] = δ_cd ((σw²/fan_in) patch_p(x)·patch_q(x') + σb²)."""
    c_in, c_out, size, kernel = 2, 2, 4, 3
    ntk = {"parameterization": "ntk", "w_std": W_STD, "b_std": B_STD}
    architecture = {
        "family": "sequential",
        "input_shape": [c_in, size, size],
        "layers": [
            {"type": "Conv2d", "in_channels": c_in, "out_channels": c_out, "kernel_size": kernel, **ntk},
            {"type": "Flatten"},
        ],
    }
    model, spec = build_model(architecture, seed=1)
    positions = (size - kernel + 1) ** 2
    assert spec.output_dim == c_out * positions
    generator = torch.Generator().manual_seed(2)
    x1 = torch.randn(3, c_in, size, size, dtype=torch.float64, generator=generator)
    x2 = torch.randn(2, c_in, size, size, dtype=torch.float64, generator=generator)
    p1, p2 = F.unfold(x1, kernel), F.unfold(x2, kernel)  # (N, c_in·k·k, positions)
    fan_in = c_in * kernel * kernel
    per_position = (W_STD**2 / fan_in) * torch.einsum("nfp,mfq->nmpq", p1, p2) + B_STD**2  # (N, M, P, P)
    eye = torch.eye(c_out, dtype=torch.float64)
    expected = torch.einsum("cd,nmpq->nmcpdq", eye, per_position).reshape(3, 2, c_out * positions, c_out * positions)
    for implementation in IMPLEMENTATIONS:
        theta = compute_ntk(model, x1, x2, implementation=implementation, dtype=torch.float64).theta
        err = (theta - expected).abs().max().item()
        assert err <= 1e-10 * expected.abs().max().item(), (implementation, err)


def test_scales_without_the_ntk_parameterization_are_refused() -> None:
    architecture = {"family": "mlp", "input_dim": 2, "hidden": [], "output_dim": 1, "w_std": 2.0}
    with pytest.raises(InvalidInput, match="w_std and b_std apply only to parameterization 'ntk'"):
        build_model(architecture, seed=0)
