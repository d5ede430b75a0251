"""The built-in model families as nn.Modules, with their exact forward semantics and initialisation.

Parameter names are part of the contract (uploads of weights are checked against them):

    MLP          layers.{i}.weight (out, in), layers.{i}.bias (out,)
    CNN          convs.{i}.weight (C_out, C_in, K, K), convs.{i}.bias (C_out,), head.weight, head.bias
    Transformer  token_embedding.weight (vocab_size, d_model), position_embedding.weight (max_len, d_model),
                 blocks.{i}.norm1.{weight,bias}, blocks.{i}.attn.{in_proj_weight, in_proj_bias,
                 out_proj.weight, out_proj.bias}, blocks.{i}.norm2.{weight,bias}, blocks.{i}.fc1.{weight,bias},
                 blocks.{i}.fc2.{weight,bias}, norm.{weight,bias}, head.{weight,bias}

See NOTE [seeded initialisation] in ``initialize_parameters`` for how seeds become weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ntk_service.layers import NtkConv1d, NtkConv2d, NtkLinear
from ntk_service.registry.architectures import CnnConfig, MlpConfig, TransformerConfig

__all__ = [
    "CNN",
    "MLP",
    "Erf",
    "Transformer",
    "cnn_spatial_sizes",
    "initialize_parameters",
    "make_activation",
    "self_attention",
]


class Erf(nn.Module):
    """The error function as a module: ``torch.erf(x)``, elementwise (the NNGP/NTK-friendly sigmoid)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erf(x)


def make_activation(name: str) -> nn.Module:
    """``relu`` -> nn.ReLU, ``tanh`` -> nn.Tanh, ``gelu`` -> nn.GELU() (exact, erf form), ``erf`` -> Erf."""
    activations: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "erf": Erf}
    return activations[name]()


class MLP(nn.Module):
    """``layers.0 -> act -> layers.1 -> act -> ... -> layers.L`` (no activation after the last Linear).

    Input (B, input_dim) float32, output (B, output_dim). With ``parameterization="ntk"`` the layers are
    ``NtkLinear(w_std, b_std)`` (NOTE [NTK parameterization] in ntk_service/layers.py), same parameter names.
    """

    ntk_fixed_pipeline = True
    """The forward calls the same modules in the same order every time: the structured engine may trace it once
    and capture it in closed form (NOTE [sequential chains] in ``ntk_service/kernels/structured/chain.py``)."""

    def __init__(self, config: MlpConfig) -> None:
        super().__init__()
        dims = [config.input_dim, *config.hidden, config.output_dim]
        pairs = zip(dims, dims[1:], strict=False)
        if config.parameterization == "ntk":
            self.layers = nn.ModuleList(
                NtkLinear(a, b, bias=config.bias, w_std=config.w_std, b_std=config.b_std) for a, b in pairs
            )
        else:
            self.layers = nn.ModuleList(nn.Linear(a, b, bias=config.bias) for a, b in pairs)
        self.activation = make_activation(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i:
                x = self.activation(x)
            x = layer(x)
        return x


def cnn_spatial_sizes(config: CnnConfig) -> list[tuple[int, int]]:
    """(H, W) of the input and after each conv layer: ``floor((H + 2·padding - kernel_size) / stride) + 1``.

    A layer whose input is smaller than the kernel gives size 0 there (build_model refuses such configs).
    """
    assert config.strides is not None
    _, h, w = config.input_shape
    sizes = [(h, w)]
    for stride in config.strides:
        h, w = (max(0, (s + 2 * config.padding - config.kernel_size) // stride + 1) for s in (h, w))
        sizes.append((h, w))
        if h == 0 or w == 0:
            break
    return sizes


class CNN(nn.Module):
    """``convs.0 -> act -> ... -> convs.L -> act -> flatten -> head``.

    Conv layers are nn.Conv2d(kernel_size, stride=strides[i], padding, bias=True); the flatten is over (C, H, W) in
    that order. Input (B, C, H, W) float32, output (B, output_dim).
    """

    def __init__(self, config: CnnConfig) -> None:
        super().__init__()
        assert config.strides is not None
        chans = [config.input_shape[0], *config.channels]
        self.convs = nn.ModuleList(
            nn.Conv2d(a, b, config.kernel_size, stride=s, padding=config.padding)
            for a, b, s in zip(chans[:-1], chans[1:], config.strides, strict=True)
        )
        self.activation = make_activation(config.activation)
        h, w = cnn_spatial_sizes(config)[-1]
        self.head = nn.Linear(chans[-1] * h * w, config.output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = self.activation(conv(x))
        out: torch.Tensor = self.head(x.flatten(1))
        return out


class _Block(nn.Module):
    """Pre-norm block: ``x = x + attn(norm1(x))``, then ``x = x + fc2(gelu(fc1(norm2(x))))``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=0.0, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self_attention(self.attn, self.norm1(x))
        out: torch.Tensor = x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))
        return out


def self_attention(attn: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """``attn(x, x, x)[0]`` written out: (B, T, d) -> (B, T, d), no mask, no dropout.

    NOTE [explicit attention]
    nn.MultiheadAttention's forward goes through scaled_dot_product_attention, which has no vmap batching rule on CPU
    (torch warns "performance drop" and falls back to a loop) and hides out_proj from forward hooks. The kernel engine
    vmaps and hooks, so the blocks keep nn.MultiheadAttention as the holder of the parameters (and their names) but
    compute the same function explicitly: q, k, v = split(x in_proj_weightᵀ + in_proj_bias) into n_heads heads of
    d/n_heads, softmax(q kᵀ / sqrt(d/n_heads)) v, heads concatenated, then ``out_proj`` (called as a module).
    tests/registry/test_zoo.py checks it against ``attn(x, x, x)``.
    """
    *batch, t, d = x.shape
    heads = attn.num_heads
    qkv = nn.functional.linear(x, attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = (z.reshape(*batch, t, heads, d // heads).transpose(-3, -2) for z in qkv.chunk(3, dim=-1))
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // heads), dim=-1)
    out = (weights @ v).transpose(-3, -2).reshape(*batch, t, d)
    projected: torch.Tensor = attn.out_proj(out)
    return projected


class Transformer(nn.Module):
    """Token ids (B, T) int64, T <= max_len -> (B, output_dim).

    ``x = token_embedding(ids) + position_embedding(0..T-1)``; the blocks (no attention mask: every position attends
    to every position); ``norm``; mean over the T positions; ``head``. LayerNorms use eps=1e-5; GELU is exact.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        # _weight skips Embedding.reset_parameters: its normal_ on the meta device imports torch._dynamo (seconds),
        # and initialize_parameters draws these weights anyway.
        self.token_embedding = nn.Embedding(
            config.vocab_size, config.d_model, _weight=torch.empty(config.vocab_size, config.d_model)
        )
        self.position_embedding = nn.Embedding(
            config.max_len, config.d_model, _weight=torch.empty(config.max_len, config.d_model)
        )
        self.blocks = nn.ModuleList(_Block(config.d_model, config.n_heads, config.d_ff) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.output_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x).mean(dim=-2))
        return out


def _uniform(t: torch.Tensor, bound: float, generator: torch.Generator) -> None:
    t.uniform_(-bound, bound, generator=generator)


def initialize_parameters(module: nn.Module, generator: torch.Generator) -> None:
    """Fill every parameter of a built-in model from ``generator``, in ``named_modules()`` order.

    NOTE [seeded initialisation]
    The rules are PyTorch's defaults written out, so they do not depend on the global RNG (which other threads may
    draw from) nor on a future PyTorch changing its defaults:
      Linear, Conv1d/2d  weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in_features or
                       C_in/groups·prod(kernel) (= kaiming_uniform_(a=sqrt(5)), PyTorch's default)
      NtkLinear, NtkConv*  weight and bias ~ N(0, 1) (NTK parameterization: the forward scales them)
      Embedding        weight ~ N(0, 1)
      LayerNorm, RMSNorm, GroupNorm, BatchNorm  weight = 1, bias = 0; BatchNorm running_mean = 0, running_var = 1,
                       num_batches_tracked = 0
      MultiheadAttention  in_proj_weight ~ xavier_uniform U(±sqrt(6 / (d + 3d))), in_proj_bias = 0,
                       out_proj.weight as a Linear, out_proj.bias = 0
    Same config + same seed -> bit-identical weights (and the same weights_sha256).

    Raises:
        AssertionError: a parameter no rule covers (a programming error in this module, not a user error).
    """
    done: set[int] = set()
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.MultiheadAttention):
                d = sub.embed_dim
                _uniform(sub.in_proj_weight, math.sqrt(6.0 / (d + 3 * d)), generator)
                _uniform(sub.out_proj.weight, 1.0 / math.sqrt(d), generator)
                for bias in (sub.in_proj_bias, sub.out_proj.bias):
                    if bias is not None:
                        bias.zero_()
                done.update(id(p) for p in sub.parameters())
            elif isinstance(sub, NtkLinear | NtkConv1d | NtkConv2d):
                for p in sub.parameters(recurse=False):
                    p.normal_(0.0, 1.0, generator=generator)
                    done.add(id(p))
            elif isinstance(sub, nn.Linear | nn.Conv1d | nn.Conv2d):
                if id(sub.weight) in done:  # the out_proj of an attention layer, done above
                    continue
                bound = 1.0 / math.sqrt(sub.weight[0].numel())
                _uniform(sub.weight, bound, generator)
                if sub.bias is not None:
                    _uniform(sub.bias, bound, generator)
                done.update(id(p) for p in sub.parameters(recurse=False))
            elif isinstance(sub, nn.Embedding):
                sub.weight.normal_(0.0, 1.0, generator=generator)
                done.add(id(sub.weight))
            elif isinstance(sub, nn.LayerNorm | nn.RMSNorm | nn.GroupNorm | nn.modules.batchnorm._BatchNorm):
                for key, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
                    tensor = getattr(sub, key, None)
                    if isinstance(tensor, torch.Tensor):
                        tensor.fill_(value)
                        done.add(id(tensor))
                tracked = getattr(sub, "num_batches_tracked", None)
                if isinstance(tracked, torch.Tensor):
                    tracked.zero_()
    missed = [name for name, p in module.named_parameters() if id(p) not in done]
    assert not missed, f"initialize_parameters: no rule for {missed}"
