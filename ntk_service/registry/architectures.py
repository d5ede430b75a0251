"""Architecture specs: the JSON a client sends to register a model, validated with pydantic.

Five families, chosen by the ``family`` key (exact semantics in ``zoo.py`` and ``docs/architectures.md``):

    mlp          {input_dim, hidden, output_dim, activation, bias, parameterization, w_std, b_std}
    cnn          {input_shape: [C, H, W], channels, kernel_size, strides, padding, activation, output_dim}
    transformer  {vocab_size, max_len, d_model, n_heads, n_layers, d_ff, output_dim}
    sequential   {input_shape, input_dtype, layers: [{type: "Conv2d", ...kwargs}, ...]}   (layer_specs.py)
    factory      {factory: "pkg.mod:func", kwargs, input_shape, input_dtype}   (operator-allowed only)

Validation is strict (no "3" for 3, no 3.0 for 3, no unknown keys) and a failure becomes one ``InvalidInput`` whose
message lists every bad field, e.g. ``register: invalid 'mlp' architecture: hidden.1: Input should be greater than or
equal to 1 (got 0)``.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ntk_service.errors import InvalidInput
from ntk_service.registry.layer_specs import LAYER_SPECS, LayerSpec, Parameterization, check_layer_tree
from ntk_service.registry.limits import MAX_LAYERS, MAX_LEN, MAX_SEQUENTIAL_LAYERS, MAX_WIDTH

__all__ = [
    "ARCHITECTURE_CONFIGS",
    "ArchitectureField",
    "ArchitectureInfo",
    "ArchitectureSpec",
    "CnnConfig",
    "FactoryConfig",
    "LayerInfo",
    "MlpConfig",
    "SequentialConfig",
    "TransformerConfig",
    "list_architectures",
    "parse_architecture",
]

Activation = Literal["relu", "tanh", "gelu", "erf"]
PositiveInt = Annotated[int, Field(ge=1, le=MAX_WIDTH)]


JsonValue = Any
"""A value a JSON body can hold; factory kwargs are passed to the factory as parsed JSON, nothing else."""

_RESNET_EXAMPLE: dict[str, JsonValue] = {
    "family": "sequential",
    "input_shape": [3, 16, 16],
    "layers": [
        {"type": "Conv2d", "in_channels": 3, "out_channels": 8, "kernel_size": 3, "padding": 1, "bias": False},
        {"type": "BatchNorm2d", "num_features": 8},
        {"type": "ReLU"},
        {
            "type": "Residual",
            "body": [
                {"type": "Conv2d", "in_channels": 8, "out_channels": 16, "kernel_size": 3, "stride": 2, "padding": 1},
                {"type": "ReLU"},
                {"type": "Conv2d", "in_channels": 16, "out_channels": 16, "kernel_size": 3, "padding": 1},
            ],
            "shortcut": [{"type": "Conv2d", "in_channels": 8, "out_channels": 16, "kernel_size": 1, "stride": 2}],
        },
        {"type": "ReLU"},
        {"type": "AdaptiveAvgPool2d", "output_size": 1},
        {"type": "Flatten"},
        {"type": "Linear", "in_features": 16, "out_features": 10},
    ],
}

_EXAMPLES: dict[str, dict[str, JsonValue]] = {
    "mlp": {"family": "mlp", "input_dim": 8, "hidden": [64, 64], "output_dim": 3, "activation": "relu"},
    "cnn": {"family": "cnn", "input_shape": [1, 8, 8], "channels": [4, 8], "strides": [1, 2], "output_dim": 10},
    "transformer": {
        "family": "transformer",
        "vocab_size": 32,
        "max_len": 16,
        "d_model": 32,
        "n_heads": 4,
        "n_layers": 2,
        "d_ff": 64,
        "output_dim": 2,
    },
    "sequential": _RESNET_EXAMPLE,
    "factory": {
        "family": "factory",
        "factory": "mylab.models:make_resnet",
        "kwargs": {"depth": 8},
        "input_shape": [3, 32, 32],
        "input_dtype": "float32",
    },
}


def _with_example(family: str) -> ConfigDict:
    """Strict, no unknown keys, and the family's example in its JSON schema (OpenAPI shows one per family)."""
    return ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [_EXAMPLES[family]]})


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MlpConfig(_Config):
    """Fully connected net: Linear layers input_dim -> hidden[0] -> ... -> output_dim, activation between them."""

    model_config = _with_example("mlp")

    family: Literal["mlp"] = Field(description="'mlp'.")
    input_dim: PositiveInt = Field(description="Features per example; inputs are float32 of shape (input_dim,).")
    hidden: list[PositiveInt] = Field(
        max_length=MAX_LAYERS,
        description="Widths of the hidden layers, in order; [] gives a linear model.",
        examples=[[64, 64]],
    )
    output_dim: PositiveInt = Field(description="Outputs per example (k).")
    activation: Activation = Field(
        default="relu", description="Nonlinearity between Linear layers (none after the last); gelu is exact (erf)."
    )
    bias: bool = Field(default=True, description="Whether every Linear layer has a bias.")
    parameterization: Parameterization = Field(
        default="standard",
        description="'standard': nn.Linear layers, PyTorch's init; 'ntk': y = (w_std/sqrt(fan_in)) x Wᵀ + b_std b with "
        "W, b ~ N(0, 1) (neural-tangents' stax.Dense(parameterization='ntk')).",
    )
    w_std: float = Field(default=1.0, ge=0.0, le=1e6, description="σ_w of the 'ntk' parameterization.")
    b_std: float = Field(default=1.0, ge=0.0, le=1e6, description="σ_b of the 'ntk' parameterization.")

    @model_validator(mode="after")
    def _check_scales(self) -> MlpConfig:
        if self.parameterization == "standard" and (self.w_std, self.b_std) != (1.0, 1.0):
            raise ValueError(
                f"w_std and b_std apply only to parameterization 'ntk' (got w_std={self.w_std}, b_std={self.b_std} "
                "with 'standard'); set parameterization to 'ntk' or drop them"
            )
        return self


class CnnConfig(_Config):
    """Conv2d layers, each followed by the activation, then flatten and one Linear head."""

    model_config = _with_example("cnn")

    family: Literal["cnn"] = Field(description="'cnn'.")
    input_shape: list[PositiveInt] = Field(
        min_length=3, max_length=3, description="[C, H, W] of one example; inputs are float32.", examples=[[3, 32, 32]]
    )
    channels: list[PositiveInt] = Field(
        min_length=1, max_length=MAX_LAYERS, description="Output channels of each conv layer, in order."
    )
    kernel_size: PositiveInt = Field(default=3, description="Square kernel size of every conv layer.")
    strides: list[PositiveInt] | None = Field(
        default=None,
        max_length=MAX_LAYERS,
        description="Stride of each conv layer (same length as channels). Default: all 1.",
    )
    padding: int = Field(default=0, ge=0, le=MAX_WIDTH, description="Zero padding on each side, every conv layer.")
    activation: Activation = Field(default="relu", description="Nonlinearity after every conv layer.")
    output_dim: PositiveInt = Field(description="Outputs per example (k) of the Linear head.")

    @model_validator(mode="after")
    def _fill_strides(self) -> CnnConfig:
        if self.strides is None:
            self.strides = [1] * len(self.channels)
        elif len(self.strides) != len(self.channels):
            raise ValueError(
                f"strides has {len(self.strides)} entries but channels has {len(self.channels)}; "
                "give one stride per conv layer or omit strides (all 1)"
            )
        return self


class TransformerConfig(_Config):
    """Token + position embeddings, pre-norm encoder blocks, final LayerNorm, mean pooling, Linear head."""

    model_config = _with_example("transformer")

    family: Literal["transformer"] = Field(description="'transformer'.")
    vocab_size: PositiveInt = Field(description="Token ids are int64 in [0, vocab_size).")
    max_len: int = Field(ge=1, le=MAX_LEN, description="Sequence length T; inputs are int64 of shape (max_len,).")
    d_model: PositiveInt = Field(description="Embedding width; must be divisible by n_heads.")
    n_heads: PositiveInt = Field(description="Attention heads per block.")
    n_layers: int = Field(ge=1, le=MAX_LAYERS, description="Number of pre-norm blocks.")
    d_ff: PositiveInt = Field(description="Hidden width of each block's Linear-GELU-Linear MLP.")
    output_dim: PositiveInt = Field(description="Outputs per example (k) of the Linear head.")

    @model_validator(mode="after")
    def _check_heads(self) -> TransformerConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"e.g. n_heads in {_divisors(self.d_model)}"
            )
        return self


class SequentialConfig(_Config):
    """Layers from an allow-list of torch.nn classes and ntk_service.layers combinators, applied in order."""

    model_config = _with_example("sequential")

    family: Literal["sequential"] = Field(description="'sequential'.")
    input_shape: list[PositiveInt] = Field(
        min_length=1,
        max_length=8,
        description="Shape of one example, without the batch dimension.",
        examples=[[3, 32, 32], [16]],
    )
    input_dtype: Literal["float32", "int64"] = Field(
        default="float32", description="dtype of the inputs; int64 token ids must go into an Embedding first."
    )
    layers: list[LayerSpec] = Field(
        min_length=1,
        max_length=MAX_SEQUENTIAL_LAYERS,
        description="The layers in order, as nn.Sequential applies them: {type, ...constructor keywords}; "
        "GET /v1/architectures lists every type and its keywords.",
    )

    @model_validator(mode="before")
    @classmethod
    def _check_tree(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_layer_tree(data.get("layers"))
        return data


class FactoryConfig(_Config):
    """A model built by an operator-allowed Python function, called with JSON keyword arguments."""

    model_config = _with_example("factory")

    family: Literal["factory"] = Field(description="'factory'.")
    factory: str = Field(
        min_length=3,
        max_length=200,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="'package.module:function', which the operator must list in NTK_MODEL_FACTORIES.",
        examples=["mylab.models:make_resnet"],
    )
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="JSON keyword arguments of the function.")
    input_shape: list[Annotated[int, Field(ge=1, le=MAX_WIDTH)]] = Field(
        max_length=8, description="Shape of one example, without the batch dimension."
    )
    input_dtype: Literal["float32", "int64"] = Field(default="float32", description="dtype of the inputs.")


ArchitectureConfig = MlpConfig | CnnConfig | TransformerConfig | SequentialConfig | FactoryConfig

ARCHITECTURE_CONFIGS: dict[str, type[_Config]] = {
    "mlp": MlpConfig,
    "cnn": CnnConfig,
    "transformer": TransformerConfig,
    "sequential": SequentialConfig,
    "factory": FactoryConfig,
}
"""Family name -> its pydantic config class."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


def _format_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] not in {"missing", "extra_forbidden", "value_error"}:
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_architecture(architecture: object, *, operation: str = "build_model") -> ArchitectureConfig:
    """Validate a client's architecture dict into its family's config.

    Args:
        architecture (object): the parsed JSON, e.g. ``{"family": "mlp", "input_dim": 4, "hidden": [8], ...}``.
        operation (str): prefix of error messages. Default: "build_model".

    Returns:
        The family's config (MlpConfig, CnnConfig, TransformerConfig or FactoryConfig), defaults filled in.

    Raises:
        InvalidInput: not a dict, unknown family, or any bad field (all of them listed in one message).
    """
    if not isinstance(architecture, dict):
        raise InvalidInput(
            f"{operation}: architecture must be a JSON object with a 'family' key, got {type(architecture).__name__}"
        )
    family = architecture.get("family")
    config_cls = ARCHITECTURE_CONFIGS.get(family) if isinstance(family, str) else None
    if family == "exported":
        raise InvalidInput(
            f"{operation}: an 'exported' model is registered by uploading its torch.export archive (multipart POST "
            "/v1/models/exported with fields name and program; Client.register_module does it), not as JSON"
        )
    if config_cls is None:
        raise InvalidInput(
            f"{operation}: unknown architecture family {family!r}; expected one of "
            f"{sorted(ARCHITECTURE_CONFIGS)} (GET /v1/architectures lists their fields)"
        )
    try:
        return config_cls.model_validate(architecture)  # type: ignore[return-value]
    except ValidationError as exc:
        raise InvalidInput(f"{operation}: invalid {family!r} architecture: {_format_validation_error(exc)}") from exc


class ArchitectureField(BaseModel):
    """One config field of a family, as ``GET /v1/architectures`` shows it."""

    name: str
    type: str
    required: bool
    default: JsonValue = None
    description: str


class LayerInfo(BaseModel):
    """One layer type a ``sequential`` spec may use, with its keywords."""

    type: str
    description: str
    fields: list[ArchitectureField]


class ArchitectureInfo(BaseModel):
    """A family: its name, what it builds, its config fields and an example architecture dict.

    ``layers`` (sequential only) lists the allowed layer types; ``factories`` (factory only) the
    ``module:function`` factories this server's operator allows (NTK_MODEL_FACTORIES).
    """

    name: str
    description: str
    fields: list[ArchitectureField]
    example: dict[str, JsonValue]
    layers: list[LayerInfo] | None = None
    factories: list[str] | None = None


ArchitectureSpec = Annotated[ArchitectureConfig, Field(discriminator="family")]
"""Any family's architecture, chosen by ``family`` (the OpenAPI schema of ``POST /v1/models``' architecture)."""


def _type_name(annotation: object) -> str:
    if annotation == LayerSpec:
        return "layer"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _fields(cls: type[BaseModel], *, skip: tuple[str, ...] = ()) -> list[ArchitectureField]:
    fields = []
    for field_name, field in cls.model_fields.items():
        if field_name in skip:
            continue
        required = field.is_required()
        default = None if required else field.get_default(call_default_factory=True)
        fields.append(
            ArchitectureField(
                name=field_name,
                type=_type_name(field.annotation),
                required=required,
                default=default,
                description=field.description or "",
            )
        )
    return fields


def list_architectures(allowed_factories: frozenset[str] = frozenset()) -> list[ArchitectureInfo]:
    """The families a model can be registered with, their config fields, sequential's layer types, and the
    operator's factories.

    Args:
        allowed_factories (frozenset[str]): the server's NTK_MODEL_FACTORIES, shown on the factory family.
            Default: none.

    Returns:
        One ArchitectureInfo per family ("mlp", "cnn", "transformer", "sequential", "factory"), in that order.

    Examples:
        >>> [a.name for a in list_architectures()]
        ['mlp', 'cnn', 'transformer', 'sequential', 'factory']
    """
    infos = []
    for name, cls in ARCHITECTURE_CONFIGS.items():
        info = ArchitectureInfo(
            name=name, description=(cls.__doc__ or "").strip(), fields=_fields(cls), example=_EXAMPLES[name]
        )
        if name == "sequential":
            info.layers = [
                LayerInfo(type=kind, description=(spec.__doc__ or kind).strip(), fields=_fields(spec, skip=("type",)))
                for kind, spec in LAYER_SPECS.items()
            ]
        elif name == "factory":
            info.factories = sorted(allowed_factories)
        infos.append(info)
    return infos
