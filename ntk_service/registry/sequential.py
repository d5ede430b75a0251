"""The ``sequential`` family as an ``nn.Sequential``: a validated spec built, sized and shape-checked on meta.

    >>> plan = plan_sequential(config, max_params=10**6)   # no memory allocated for parameters
    >>> plan.num_params, plan.output_dim, plan.activations            # P, k, values per example
    >>> module = plan.module                                          # on the meta device; zoo.py materialises it

Each layer of the spec becomes the ``torch.nn`` class of its ``type`` (or the ``ntk_service.layers`` combinator)
with exactly its keyword arguments, nested ``Residual`` bodies and ``Sequential`` layers as ``nn.Sequential``, so
parameter and buffer names are those of the user's own ``nn.Sequential`` (``0.weight``, ``3.body.0.weight``,
``3.shortcut.1.running_mean``, ``4.0.body.0.weight`` for a block inside a nested ``nn.Sequential``).
Two exceptions keep the math and the names but change how the forward is computed:

- ``Linear``/``Conv*`` with ``parameterization: "ntk"`` are ``ntk_service.layers.NtkLinear``/``NtkConv*``.
- ``TransformerEncoderLayer`` is ``ExplicitTransformerEncoderLayer``: the same parameters and function, with the
  attention written out (NOTE [explicit attention] in families.py), since the stock layer's fused eval fast path
  (``aten::_transformer_encoder_layer_fwd``) has no forward-mode AD and its SDPA call no vmap batching rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ntk_service.errors import InvalidInput
from ntk_service.layers import MeanPool, NtkConv1d, NtkConv2d, NtkLinear, PositionEmbedding, Residual
from ntk_service.registry.architectures import SequentialConfig
from ntk_service.registry.families import self_attention
from ntk_service.registry.layer_specs import (
    BatchNorm1dSpec,
    BatchNorm2dSpec,
    Conv1dSpec,
    Conv2dSpec,
    EmbeddingSpec,
    FlattenSpec,
    LayerSpec,
    LinearSpec,
    MeanPoolSpec,
    ResidualSpec,
    SequentialSpec,
    TransformerEncoderLayerSpec,
)

__all__ = ["ExplicitTransformerEncoderLayer", "SequentialPlan", "build_meta", "plan_sequential"]


class ExplicitTransformerEncoderLayer(nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` (batch_first, no mask, eval) with its attention computed explicitly.

    Same parameters (``self_attn.in_proj_weight``, ``self_attn.out_proj.*``, ``linear1/2.*``, ``norm1/2.*``) and
    the same function as the stock layer (tests/registry/test_sequential.py compares them):
    norm_first:  x = x + sa(norm1(x));  x = x + ff(norm2(x))
    otherwise:   x = norm1(x + sa(x));  x = norm2(x + ff(x))
    with sa = attention (families.self_attention) and ff = linear2(activation(linear1(x))); dropout is off in eval.
    """

    def forward(self, src: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        x = src
        if self.norm_first:
            x = x + self.dropout1(self_attention(self.self_attn, self.norm1(x)))
            out: torch.Tensor = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self.dropout1(self_attention(self.self_attn, x)))
            out = self.norm2(x + self._ff_block(x))
        return out


@dataclass(frozen=True)
class SequentialPlan:
    """A validated ``sequential`` spec, built on the meta device.

    Attributes:
        module: the ``nn.Sequential`` with meta parameters and buffers (nothing allocated).
        num_params: P, counted from the meta module.
        output_dim: k = prod(output shape per example).
        activations: values one example produces across all layer outputs (for the activation cap).
    """

    module: nn.Sequential
    num_params: int
    output_dim: int
    activations: int


def _where(path: str, spec: LayerSpec) -> str:
    return f"layer {path} ({spec.type})"


def _tuple(value: int | list[int] | str | None) -> int | tuple[int, ...] | str | None:
    return tuple(value) if isinstance(value, list) else value


def _kwargs(spec: LayerSpec, *, drop: tuple[str, ...] = ()) -> dict[str, object]:
    skip = {"type", "parameterization", "w_std", "b_std", *drop}
    return {k: _tuple(v) for k, v in spec.model_dump().items() if k not in skip}


def _make_layer(spec: LayerSpec, path: str) -> nn.Module:
    """The module of one layer spec (on the current default device), refusing what eval inference cannot run."""
    if isinstance(spec, ResidualSpec):
        body = nn.Sequential(*_make_layers(spec.body, f"{path}.body"))
        shortcut = None
        if spec.shortcut is not None:
            shortcut = nn.Sequential(*_make_layers(spec.shortcut, f"{path}.shortcut"))
        return Residual(body, shortcut)
    if isinstance(spec, SequentialSpec):
        return nn.Sequential(*_make_layers(spec.layers, f"{path}.layers"))
    if isinstance(spec, BatchNorm1dSpec | BatchNorm2dSpec) and not spec.track_running_stats:
        raise InvalidInput(
            detail=f"{_where(path, spec)}: track_running_stats=false normalises every batch with its own "
            "statistics, so one example's kernel would depend on the others; keep track_running_stats=true (the "
            "default) and upload the layer's running_mean and running_var with the weights"
        )
    if isinstance(spec, LinearSpec | Conv1dSpec | Conv2dSpec) and spec.parameterization == "standard":
        if (spec.w_std, spec.b_std) != (1.0, 1.0):
            raise InvalidInput(
                detail=f"{_where(path, spec)}: w_std and b_std apply only to parameterization 'ntk' (got "
                f"w_std={spec.w_std}, b_std={spec.b_std} with 'standard'); set parameterization to 'ntk' or drop them"
            )
    try:
        return _construct(spec)
    except (ValueError, AssertionError, RuntimeError, TypeError) as exc:  # torch's own argument checks
        raise InvalidInput(detail=f"{_where(path, spec)} cannot be built: {exc or type(exc).__name__}") from exc


def _construct(spec: LayerSpec) -> nn.Module:
    if isinstance(spec, LinearSpec | Conv1dSpec | Conv2dSpec) and spec.parameterization == "ntk":
        cls: type[nn.Module] = {LinearSpec: NtkLinear, Conv1dSpec: NtkConv1d, Conv2dSpec: NtkConv2d}[type(spec)]
        return cls(**_kwargs(spec), w_std=spec.w_std, b_std=spec.b_std)
    if isinstance(spec, EmbeddingSpec):
        # _weight skips Embedding's init: normal_ on the meta device imports torch's compiler stack (seconds).
        weight = torch.empty(spec.num_embeddings, spec.embedding_dim)
        return nn.Embedding(spec.num_embeddings, spec.embedding_dim, padding_idx=spec.padding_idx, _weight=weight)
    if isinstance(spec, TransformerEncoderLayerSpec):
        return ExplicitTransformerEncoderLayer(**_kwargs(spec))  # type: ignore[arg-type]
    if isinstance(spec, MeanPoolSpec):
        return MeanPool(spec.dim)
    if spec.type == "PositionEmbedding":
        return PositionEmbedding(**_kwargs(spec))  # type: ignore[arg-type]
    torch_cls: type[nn.Module] = getattr(nn, spec.type)  # the torch.nn class of the allow-listed type
    return torch_cls(**_kwargs(spec))


def _make_layers(specs: Sequence[LayerSpec], path: str) -> list[nn.Module]:
    return [_make_layer(spec, f"{path}.{i}") for i, spec in enumerate(specs)]


def _batch_dim(dim: int, ndim: int) -> bool:
    return -ndim <= dim < ndim and dim % ndim == 0


class _Trace:
    """Runs a meta input through the layers one by one, naming the first layer that fails."""

    def __init__(self) -> None:
        self.activations = 0

    def run(self, layers: nn.Sequential, specs: Sequence[LayerSpec], x: torch.Tensor, path: str) -> torch.Tensor:
        for i, (layer, spec) in enumerate(zip(layers, specs, strict=True)):
            x = self.step(layer, spec, x, f"{path}.{i}")
            self.activations += x.numel()
        return x

    def step(self, layer: nn.Module, spec: LayerSpec, x: torch.Tensor, path: str) -> torch.Tensor:
        shape = tuple(x.shape)
        if isinstance(spec, SequentialSpec):
            assert isinstance(layer, nn.Sequential)
            return self.run(layer, spec.layers, x, f"{path}.layers")
        if isinstance(spec, ResidualSpec):
            assert isinstance(layer, Residual)
            body = self.run(layer.body, spec.body, x, f"{path}.body")
            skip = x if layer.shortcut is None or spec.shortcut is None else None
            if skip is None:
                assert layer.shortcut is not None and spec.shortcut is not None
                skip = self.run(layer.shortcut, spec.shortcut, x, f"{path}.shortcut")
            if body.shape != skip.shape:
                what = "shortcut" if spec.shortcut is not None else "input (identity shortcut)"
                raise InvalidInput(
                    detail=f"{_where(path, spec)}: its body maps {shape} to {tuple(body.shape)} but its "
                    f"{what} is {tuple(skip.shape)}; body(x) + shortcut(x) needs equal shapes (add a shortcut, "
                    "e.g. a 1x1 Conv2d with the body's stride and channels)"
                )
            return body + skip
        self._check_input(spec, x, path)
        try:
            out = layer(x)
        except Exception as exc:  # torch's shape checks; the spec is what is wrong, so it is the client's error
            raise InvalidInput(
                detail=f"{_where(path, spec)} fails on its input of shape {shape} (batch of one example "
                f"of input_shape): {str(exc).strip() or type(exc).__name__}"
            ) from exc
        if not isinstance(out, torch.Tensor):
            raise InvalidInput(detail=f"{_where(path, spec)} returned {type(out).__name__}, not a tensor")
        return out

    def _check_input(self, spec: LayerSpec, x: torch.Tensor, path: str) -> None:
        where, shape = _where(path, spec), tuple(x.shape)
        if isinstance(spec, EmbeddingSpec) != (x.dtype == torch.int64):
            need = "int64 token ids" if isinstance(spec, EmbeddingSpec) else "a float tensor"
            raise InvalidInput(
                detail=f"{where} needs {need} but gets a {str(x.dtype).removeprefix('torch.')} tensor of shape "
                f"{shape}; int64 inputs (input_dtype 'int64') go into an Embedding first, and only there"
            )
        if isinstance(spec, FlattenSpec) and _batch_dim(spec.start_dim, x.ndim):
            raise InvalidInput(
                detail=f"{where}: start_dim={spec.start_dim} is the batch dimension of its input {shape}; flattening "
                "it would mix examples (use start_dim=1)"
            )
        if isinstance(spec, MeanPoolSpec) and (not -x.ndim <= spec.dim < x.ndim or _batch_dim(spec.dim, x.ndim)):
            raise InvalidInput(
                detail=f"{where}: dim={spec.dim} is "
                + ("the batch dimension" if -x.ndim <= spec.dim < x.ndim else "out of range")
                + f" of its input {shape}; pool over a dimension in 1..{x.ndim - 1} (e.g. 1 for (B, T, d) tokens)"
            )


def build_meta(config: SequentialConfig) -> nn.Sequential:
    """The spec's ``nn.Sequential`` on the meta device, in eval mode, without any check of shapes (a skeleton for
    stored weights of a spec ``plan_sequential`` accepted at registration).

    Raises:
        InvalidInput: a layer that cannot be built (as ``plan_sequential``).
    """
    with torch.device("meta"):
        return nn.Sequential(*_make_layers(config.layers, "layers")).eval()  # eval: as kernels run it


def plan_sequential(config: SequentialConfig, *, max_params: int) -> SequentialPlan:
    """Build the spec on the meta device, count its parameters, then check every layer on the declared input.

    Args:
        config (SequentialConfig): the validated spec.
        max_params (int): the parameter cap, checked on the meta module before the shapes are traced.

    Returns:
        The SequentialPlan (meta module, P, k, activations per example).

    Raises (with ``detail=``: the caller's boundary names the operation, NOTE [operation names] in errors.py):
        InvalidInput: a layer that cannot be built (e.g. d_model not divisible by nhead), BatchNorm without
            running statistics, more than ``max_params`` parameters (with the count), a layer that fails on the
            shape it gets from the declared input (naming the layer and the shapes), or an output that is not a
            floating tensor (1, *out).
    """
    module = build_meta(config)
    num_params = sum(p.numel() for p in module.parameters())
    if num_params > max_params:
        raise InvalidInput(
            detail=f"this sequential model has {num_params:,} parameters, more than the server's limit of "
            f"{max_params:,} (counted before allocating anything); use narrower or fewer layers"
        )
    dtype = torch.int64 if config.input_dtype == "int64" else torch.float32
    x = torch.empty((1, *config.input_shape), dtype=dtype, device="meta")
    trace = _Trace()
    with torch.no_grad():
        out = trace.run(module, config.layers, x, "layers")
    if not out.is_floating_point() or out.ndim < 1 or out[0].numel() == 0:
        raise InvalidInput(
            detail=f"the model's output for one example is a {str(out.dtype).removeprefix('torch.')} tensor "
            f"of shape {tuple(out.shape)}; it must be a non-empty floating tensor (1, *out)"
        )
    return SequentialPlan(module, num_params, math.prod(out.shape[1:]), trace.activations)
