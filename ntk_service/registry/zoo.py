"""Build a model from an architecture dict: validate, check the size caps, initialise from a seed.

    >>> model, spec = build_model({"family": "mlp", "input_dim": 4, "hidden": [8], "output_dim": 2}, seed=0)
    >>> spec
    ModelSpec(input_shape=(4,), input_dtype='float32', output_dim=2)
    >>> model(torch.zeros(5, *spec.input_shape)).shape  # (N, k)
    torch.Size([5, 2])

Built-in families are sized from their config *before* any memory is allocated (MAX_PARAMS,
MAX_ACTIVATIONS_PER_EXAMPLE), so registering a huge model is refused with the count instead of exhausting the server;
``sequential`` specs are built and traced on the meta device first (sequential.py), which allocates nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ntk_service.errors import InvalidInput, operation_name
from ntk_service.registry.architectures import (
    ArchitectureConfig,
    CnnConfig,
    FactoryConfig,
    MlpConfig,
    SequentialConfig,
    TransformerConfig,
    parse_architecture,
)
from ntk_service.registry.factory import call_factory, probe_output_dim
from ntk_service.registry.families import CNN, MLP, Transformer, cnn_spatial_sizes, initialize_parameters
from ntk_service.registry.sequential import SequentialPlan, build_meta, plan_sequential

__all__ = [
    "MAX_ACTIVATIONS_PER_EXAMPLE",
    "MAX_PARAMS",
    "ModelSpec",
    "build_model",
    "build_skeleton",
    "build_uninitialized",
    "count_params",
]

MAX_PARAMS = 50_000_000
"""Most parameters a registered model may have (200 MB of float32): one module of this size, a few cached versions
and the Jacobians of a small batch still fit a lab server; bigger models are refused with their count."""

MAX_ACTIVATIONS_PER_EXAMPLE = 1 << 26
"""Most activation values one example may produce in a forward pass of a built-in model (256 MiB of float32): a
kernel request holds these for a batch under vmap, so wider/deeper nets are refused at registration."""

InputDtype = Literal["float32", "int64"]


@dataclass(frozen=True)
class ModelSpec:
    """What a model takes and gives: inputs (N, *input_shape) of input_dtype -> outputs (N, output_dim)."""

    input_shape: tuple[int, ...]
    input_dtype: InputDtype
    output_dim: int


_SEED_LOCK = threading.Lock()
"""Factories draw from the global RNG; the lock keeps concurrent seeded builds from interleaving their draws."""


def count_params(config: MlpConfig | CnnConfig | TransformerConfig) -> int:
    """Exact parameter count of a built-in family, from its config alone (no allocation)."""
    if isinstance(config, MlpConfig):
        dims = [config.input_dim, *config.hidden, config.output_dim]
        return sum(a * b + (b if config.bias else 0) for a, b in zip(dims, dims[1:], strict=False))
    if isinstance(config, CnnConfig):
        chans = [config.input_shape[0], *config.channels]
        convs = sum(a * b * config.kernel_size**2 + b for a, b in zip(chans, chans[1:], strict=False))
        h, w = cnn_spatial_sizes(config)[-1]
        return convs + (chans[-1] * h * w + 1) * config.output_dim
    d, f = config.d_model, config.d_ff
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)
    return (config.vocab_size + config.max_len) * d + config.n_layers * block + 2 * d + (d + 1) * config.output_dim


def _count_activations(config: MlpConfig | CnnConfig | TransformerConfig) -> int:
    if isinstance(config, MlpConfig):
        return config.input_dim + 2 * sum(config.hidden) + config.output_dim
    if isinstance(config, CnnConfig):
        sizes = cnn_spatial_sizes(config)
        chans = [config.input_shape[0], *config.channels]
        return sum(c * h * w * 2 for c, (h, w) in zip(chans, sizes, strict=False)) + config.output_dim
    t, d = config.max_len, config.d_model
    per_block = t * (8 * d + 2 * config.d_ff) + config.n_heads * t * t
    return t * d * 2 + config.n_layers * per_block + config.output_dim


def _check_size(config: MlpConfig | CnnConfig | TransformerConfig) -> None:
    if isinstance(config, CnnConfig):
        sizes = cnn_spatial_sizes(config)
        if sizes[-1][0] == 0 or sizes[-1][1] == 0:
            layer = len(sizes) - 2
            h, w = sizes[-2]
            raise InvalidInput(
                detail=f"cnn conv layer {layer} (kernel_size {config.kernel_size}, stride "
                f"{config.strides[layer] if config.strides else 1}, padding {config.padding}) gets a {h}x{w} input, "
                f"smaller than its kernel, so its output would be empty; use fewer layers, smaller strides or "
                f"kernel_size, more padding, or a larger input_shape"
            )
    n = count_params(config)
    if n > MAX_PARAMS:
        raise InvalidInput(
            detail=f"this {config.family} has {n:,} parameters, more than the limit of {MAX_PARAMS:,}; "
            "use smaller widths or fewer layers"
        )
    acts = _count_activations(config)
    if acts > MAX_ACTIVATIONS_PER_EXAMPLE:
        raise InvalidInput(
            detail=f"one example of this {config.family} produces about {acts:,} activation values, more than "
            f"the limit of {MAX_ACTIVATIONS_PER_EXAMPLE:,}; use a smaller input, fewer channels or a shorter max_len"
        )


BuiltinConfig = MlpConfig | CnnConfig | TransformerConfig | SequentialConfig
"""The families built here (everything but operator factories)."""


def _plan_sequential(config: SequentialConfig) -> SequentialPlan:
    """Plan a sequential spec on the meta device (parameter cap first, then shapes, then activations)."""
    plan = plan_sequential(config, max_params=MAX_PARAMS)
    if plan.activations > MAX_ACTIVATIONS_PER_EXAMPLE:
        raise InvalidInput(
            detail=f"one example of this sequential model produces about {plan.activations:,} activation "
            f"values, more than the limit of {MAX_ACTIVATIONS_PER_EXAMPLE:,}; use a smaller input or narrower layers"
        )
    return plan


def _spec_of(config: ArchitectureConfig, output_dim: int | None = None) -> ModelSpec:
    if isinstance(config, MlpConfig):
        return ModelSpec((config.input_dim,), "float32", config.output_dim)
    if isinstance(config, CnnConfig):
        return ModelSpec(tuple(config.input_shape), "float32", config.output_dim)
    if isinstance(config, TransformerConfig):
        return ModelSpec((config.max_len,), "int64", config.output_dim)
    assert output_dim is not None
    if isinstance(config, SequentialConfig):
        return ModelSpec(tuple(config.input_shape), config.input_dtype, output_dim)
    return ModelSpec(tuple(config.input_shape), config.input_dtype, output_dim)


def _construct_meta(config: BuiltinConfig) -> nn.Module:
    if isinstance(config, SequentialConfig):
        return build_meta(config)
    cls: type[nn.Module] = {MlpConfig: MLP, CnnConfig: CNN, TransformerConfig: Transformer}[type(config)]
    with torch.device("meta"):
        return cls(config)


def _materialize(model: nn.Module) -> nn.Module:
    """A meta module with uninitialised float32 CPU parameters (and zero buffers) in place of its meta tensors.

    Built on the meta device (so PyTorch's default init draws nothing from the global RNG and costs nothing), then
    each parameter and buffer is replaced by ``torch.empty`` / ``torch.zeros``; ``Module.to_empty`` would do the
    same but its meta-tensor path imports torch's compiler stack on first use (seconds). Built-in families have no
    tied parameters or buffers.
    """
    for sub in model.modules():
        for key, p in list(sub.named_parameters(recurse=False)):
            sub.register_parameter(key, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
        for key, b in list(sub.named_buffers(recurse=False)):
            persistent = key not in sub._non_persistent_buffers_set
            sub.register_buffer(key, torch.zeros(b.shape, dtype=b.dtype), persistent=persistent)
    return model


def _validate_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InvalidInput(detail=f"seed must be an integer in [0, 2**63), got {seed!r}")
    return seed


def _build_factory(config: FactoryConfig, seed: int, allowed_factories: frozenset[str]) -> tuple[nn.Module, ModelSpec]:
    with _SEED_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = call_factory(config, allowed_factories)
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMS:
        raise InvalidInput(
            detail=f"factory {config.factory!r} built a model with {n:,} parameters, more than the limit of "
            f"{MAX_PARAMS:,}; pass smaller sizes in kwargs"
        )
    model.eval()
    return model, _spec_of(config, probe_output_dim(model, config))


def build_model(
    architecture: dict[str, object],
    seed: int,
    *,
    allowed_factories: frozenset[str] = frozenset(),
    operation: str = "build_model",
) -> tuple[nn.Module, ModelSpec]:
    """Validate an architecture dict and build its model, initialised deterministically from ``seed``.

    Args:
        architecture (dict): ``{"family": "mlp" | "cnn" | "transformer" | "sequential" | "factory", ...config}``; see
            ``list_architectures()`` and docs/architectures.md.
        seed (int): in [0, 2**63). Built-in families draw from a private ``torch.Generator`` seeded with it (see
            NOTE [seeded initialisation] in families.py); factories run under ``torch.manual_seed(seed)`` inside a
            ``fork_rng``, so the caller's global RNG state is untouched.
        allowed_factories (frozenset[str]): ``"module:function"`` strings the operator allows. Default: none.
        operation (str): prefix of error messages. Default: "build_model".

    Returns:
        (model, spec): the float32 nn.Module in eval mode, mapping (N, *spec.input_shape) inputs of spec.input_dtype
        to (N, spec.output_dim) outputs, and its ModelSpec.

    Raises:
        InvalidInput: bad architecture (every bad field named), a CNN whose feature map would be empty, a
            sequential layer that fails on the declared input (layer and shapes named), a model over MAX_PARAMS or
            MAX_ACTIVATIONS_PER_EXAMPLE, a bad seed, or a factory that fails.
        PermissionDenied: a factory not in ``allowed_factories``.
    """
    with operation_name(operation):  # the checks below raise their details; this names them
        seed = _validate_seed(seed)
        config = parse_architecture(architecture, operation=operation)
        if isinstance(config, FactoryConfig):
            return _build_factory(config, seed, allowed_factories)
        model, spec = _checked_skeleton(config)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    initialize_parameters(model, generator)
    return model, spec


def build_uninitialized(
    config: ArchitectureConfig, *, allowed_factories: frozenset[str], operation: str
) -> tuple[nn.Module, ModelSpec]:
    """Like ``build_model`` with every check, but parameters left uninitialised (factories: seed 0), for weights
    that are about to be loaded into it.

    Raises:
        InvalidInput, PermissionDenied: as ``build_model``.
    """
    with operation_name(operation):
        if isinstance(config, FactoryConfig):
            return _build_factory(config, 0, allowed_factories)
        return _checked_skeleton(config)


def _checked_skeleton(config: BuiltinConfig) -> tuple[nn.Module, ModelSpec]:
    meta: nn.Module
    if isinstance(config, SequentialConfig):
        plan = _plan_sequential(config)
        meta, output_dim = plan.module, plan.output_dim
    else:
        _check_size(config)
        meta, output_dim = _construct_meta(config), None
    return _materialize(meta).eval(), _spec_of(config, output_dim)


def build_skeleton(
    config: ArchitectureConfig, *, allowed_factories: frozenset[str], operation: str = "load_module"
) -> nn.Module:
    """A model of the architecture with uninitialised (built-in) or seed-0 (factory) weights, to load weights into.

    Raises:
        PermissionDenied: a factory no longer allowed by the operator.
        InvalidInput: a factory that now fails.
    """
    with operation_name(operation):
        if isinstance(config, FactoryConfig):
            return _build_factory(config, 0, allowed_factories)[0]
        return _materialize(_construct_meta(config)).eval()
