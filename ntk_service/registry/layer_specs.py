"""The layers a ``sequential`` architecture may hold: one strict pydantic model per allowed ``torch.nn`` class.

A layer is ``{"type": "Conv2d", "in_channels": 3, "out_channels": 16, "kernel_size": 3, "padding": 1, "bias":
false}``: the class name and the keyword arguments of its constructor, JSON scalars and lists only, each bounded.
Arguments that would change what a layer is outside eval-mode inference (``device``, ``dtype``, ``inplace``,
``max_norm``, ``batch_first=false``, ...) are not in the models, so they are refused by name. The combinators of
``ntk_service.layers`` (``Residual``, ``MeanPool``, ``PositionEmbedding``) are layers too; ``Residual`` nests layer
lists (at most MAX_NESTING deep). ``SequentialConfig`` (architectures.py) holds the list.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ntk_service.registry.limits import MAX_LEN, MAX_NESTING, MAX_SEQUENTIAL_LAYERS, MAX_WIDTH

__all__ = ["LAYER_SPECS", "LayerSpec", "ResidualSpec", "check_layer_tree"]

Size = Annotated[int, Field(ge=1, le=MAX_WIDTH)]
NonNegative = Annotated[int, Field(ge=0, le=MAX_WIDTH)]
Eps = Annotated[float, Field(gt=0.0, le=1.0)]
Scale = Annotated[float, Field(ge=0.0, le=1e6)]
Size2 = Size | Annotated[list[Size], Field(min_length=2, max_length=2)]
Size1 = Size | Annotated[list[Size], Field(min_length=1, max_length=1)]
Padding2 = NonNegative | Annotated[list[NonNegative], Field(min_length=2, max_length=2)] | Literal["same", "valid"]
Padding1 = NonNegative | Annotated[list[NonNegative], Field(min_length=1, max_length=1)] | Literal["same", "valid"]
Parameterization = Literal["standard", "ntk"]

_PARAMETERIZATION = (
    "'standard': PyTorch's layer; 'ntk': weights scaled by w_std/sqrt(fan_in) and bias by b_std in the forward, "
    "N(0, 1) initialisation (ntk_service.layers.NtkLinear/NtkConv*)."
)


class _Layer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


ParameterizationField = Annotated[Parameterization, Field(description=_PARAMETERIZATION)]
WStd = Annotated[Scale, Field(description="σ_w of the 'ntk' parameterization (1.0 with 'standard').")]
BStd = Annotated[Scale, Field(description="σ_b of the 'ntk' parameterization (1.0 with 'standard').")]
PaddingMode = Literal["zeros", "reflect", "replicate", "circular"]


class LinearSpec(_Layer):
    """nn.Linear: (*, in_features) -> (*, out_features)."""

    type: Literal["Linear"]
    in_features: Size
    out_features: Size
    bias: bool = True
    parameterization: ParameterizationField = "standard"
    w_std: WStd = 1.0
    b_std: BStd = 1.0


class Conv1dSpec(_Layer):
    """nn.Conv1d: (B, C_in, L) -> (B, C_out, L')."""

    type: Literal["Conv1d"]
    in_channels: Size
    out_channels: Size
    kernel_size: Size1
    stride: Size1 = 1
    padding: Padding1 = 0
    dilation: Size1 = 1
    groups: Size = 1
    bias: bool = True
    padding_mode: PaddingMode = "zeros"
    parameterization: ParameterizationField = "standard"
    w_std: WStd = 1.0
    b_std: BStd = 1.0


class Conv2dSpec(_Layer):
    """nn.Conv2d: (B, C_in, H, W) -> (B, C_out, H', W')."""

    type: Literal["Conv2d"]
    in_channels: Size
    out_channels: Size
    kernel_size: Size2
    stride: Size2 = 1
    padding: Padding2 = 0
    dilation: Size2 = 1
    groups: Size = 1
    bias: bool = True
    padding_mode: PaddingMode = "zeros"
    parameterization: ParameterizationField = "standard"
    w_std: WStd = 1.0
    b_std: BStd = 1.0


class _BatchNormSpec(_Layer):
    num_features: Size
    eps: Eps = 1e-5
    momentum: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        default=0.1, description="Unused (eval mode); accepted so a trained layer's spec round-trips."
    )
    affine: bool = True
    track_running_stats: bool = Field(
        default=True, description="Must be true: the layer normalises with its uploaded running statistics."
    )


class BatchNorm1dSpec(_BatchNormSpec):
    """nn.BatchNorm1d in eval mode (running statistics): (B, C) or (B, C, L)."""

    type: Literal["BatchNorm1d"]


class BatchNorm2dSpec(_BatchNormSpec):
    """nn.BatchNorm2d in eval mode (running statistics): (B, C, H, W)."""

    type: Literal["BatchNorm2d"]


NormalizedShape = Size | Annotated[list[Size], Field(min_length=1, max_length=4)]


class LayerNormSpec(_Layer):
    """nn.LayerNorm over the trailing normalized_shape."""

    type: Literal["LayerNorm"]
    normalized_shape: NormalizedShape
    eps: Eps = 1e-5
    elementwise_affine: bool = True
    bias: bool = True


class GroupNormSpec(_Layer):
    """nn.GroupNorm: (B, C, *) with C = num_channels divisible by num_groups."""

    type: Literal["GroupNorm"]
    num_groups: Size
    num_channels: Size
    eps: Eps = 1e-5
    affine: bool = True


class RMSNormSpec(_Layer):
    """nn.RMSNorm over the trailing normalized_shape."""

    type: Literal["RMSNorm"]
    normalized_shape: NormalizedShape
    eps: Eps | None = None
    elementwise_affine: bool = True


class EmbeddingSpec(_Layer):
    """nn.Embedding: int64 ids (B, *) in [0, num_embeddings) -> (B, *, embedding_dim)."""

    type: Literal["Embedding"]
    num_embeddings: Size
    embedding_dim: Size
    padding_idx: Annotated[int, Field(ge=-MAX_WIDTH, le=MAX_WIDTH)] | None = None


class DropoutSpec(_Layer):
    """nn.Dropout: the identity (models run in eval mode); accepted so trained models round-trip."""

    type: Literal["Dropout"]
    p: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.5


class FlattenSpec(_Layer):
    """nn.Flatten: dims start_dim..end_dim merged; start_dim must not be the batch dimension 0."""

    type: Literal["Flatten"]
    start_dim: Annotated[int, Field(ge=-8, le=8)] = 1
    end_dim: Annotated[int, Field(ge=-8, le=8)] = -1


class MaxPool2dSpec(_Layer):
    """nn.MaxPool2d: (B, C, H, W) -> (B, C, H', W')."""

    type: Literal["MaxPool2d"]
    kernel_size: Size2
    stride: Size2 | None = None
    padding: NonNegative | Annotated[list[NonNegative], Field(min_length=2, max_length=2)] = 0
    dilation: Size2 = 1
    ceil_mode: bool = False


class AvgPool2dSpec(_Layer):
    """nn.AvgPool2d: (B, C, H, W) -> (B, C, H', W')."""

    type: Literal["AvgPool2d"]
    kernel_size: Size2
    stride: Size2 | None = None
    padding: NonNegative | Annotated[list[NonNegative], Field(min_length=2, max_length=2)] = 0
    ceil_mode: bool = False
    count_include_pad: bool = True


class AdaptiveAvgPool2dSpec(_Layer):
    """nn.AdaptiveAvgPool2d: (B, C, H, W) -> (B, C, *output_size); [1, 1] is global average pooling."""

    type: Literal["AdaptiveAvgPool2d"]
    output_size: Size2


class ReLUSpec(_Layer):
    type: Literal["ReLU"]


class TanhSpec(_Layer):
    type: Literal["Tanh"]


class SigmoidSpec(_Layer):
    type: Literal["Sigmoid"]


class SiLUSpec(_Layer):
    type: Literal["SiLU"]


class IdentitySpec(_Layer):
    type: Literal["Identity"]


class GELUSpec(_Layer):
    type: Literal["GELU"]
    approximate: Literal["none", "tanh"] = "none"


class LeakyReLUSpec(_Layer):
    type: Literal["LeakyReLU"]
    negative_slope: Annotated[float, Field(ge=-1e3, le=1e3)] = 0.01


class ELUSpec(_Layer):
    type: Literal["ELU"]
    alpha: Annotated[float, Field(ge=-1e3, le=1e3)] = 1.0


class SoftplusSpec(_Layer):
    type: Literal["Softplus"]
    beta: Annotated[float, Field(gt=0.0, le=1e3)] = 1.0
    threshold: Annotated[float, Field(gt=0.0, le=1e3)] = 20.0


class TransformerEncoderLayerSpec(_Layer):
    """nn.TransformerEncoderLayer with batch_first=True: (B, T, d_model) -> (B, T, d_model), no mask."""

    type: Literal["TransformerEncoderLayer"]
    d_model: Size
    nhead: Size
    dim_feedforward: Size = 2048
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1
    activation: Literal["relu", "gelu"] = "relu"
    layer_norm_eps: Eps = 1e-5
    batch_first: Literal[True] = Field(description="Must be true: inputs are (B, T, d_model).")
    norm_first: bool = False
    bias: bool = True


class MeanPoolSpec(_Layer):
    """ntk_service.layers.MeanPool: the mean over dimension ``dim`` of (B, ...) (never 0, the batch)."""

    type: Literal["MeanPool"]
    dim: Annotated[int, Field(ge=-8, le=8)]


class PositionEmbeddingSpec(_Layer):
    """ntk_service.layers.PositionEmbedding: (B, T, d) -> x + embedding(0..T-1), T <= num_positions."""

    type: Literal["PositionEmbedding"]
    num_positions: Annotated[int, Field(ge=1, le=MAX_LEN)]
    embedding_dim: Size


class ResidualSpec(_Layer):
    """ntk_service.layers.Residual: body(x) + shortcut(x) (shortcut null: body(x) + x)."""

    type: Literal["Residual"]
    body: list[LayerSpec] = Field(
        min_length=1, max_length=MAX_SEQUENTIAL_LAYERS, description="The main path, as a list of layers."
    )
    shortcut: list[LayerSpec] | None = Field(
        default=None, max_length=MAX_SEQUENTIAL_LAYERS, description="The skip path; null is the identity."
    )


LayerSpec = Annotated[
    LinearSpec
    | Conv1dSpec
    | Conv2dSpec
    | BatchNorm1dSpec
    | BatchNorm2dSpec
    | LayerNormSpec
    | GroupNormSpec
    | RMSNormSpec
    | EmbeddingSpec
    | DropoutSpec
    | FlattenSpec
    | MaxPool2dSpec
    | AvgPool2dSpec
    | AdaptiveAvgPool2dSpec
    | ReLUSpec
    | TanhSpec
    | SigmoidSpec
    | SiLUSpec
    | IdentitySpec
    | GELUSpec
    | LeakyReLUSpec
    | ELUSpec
    | SoftplusSpec
    | TransformerEncoderLayerSpec
    | MeanPoolSpec
    | PositionEmbeddingSpec
    | ResidualSpec,
    Field(discriminator="type"),
]
"""One layer of a ``sequential`` spec, chosen by its ``type``."""

ResidualSpec.model_rebuild()

LAYER_SPECS: dict[str, type[_Layer]] = {
    cls.model_fields["type"].annotation.__args__[0]: cls  # type: ignore[union-attr]
    for cls in (
        LinearSpec,
        Conv1dSpec,
        Conv2dSpec,
        BatchNorm1dSpec,
        BatchNorm2dSpec,
        LayerNormSpec,
        GroupNormSpec,
        RMSNormSpec,
        EmbeddingSpec,
        DropoutSpec,
        FlattenSpec,
        MaxPool2dSpec,
        AvgPool2dSpec,
        AdaptiveAvgPool2dSpec,
        ReLUSpec,
        TanhSpec,
        SigmoidSpec,
        SiLUSpec,
        IdentitySpec,
        GELUSpec,
        LeakyReLUSpec,
        ELUSpec,
        SoftplusSpec,
        TransformerEncoderLayerSpec,
        MeanPoolSpec,
        PositionEmbeddingSpec,
        ResidualSpec,
    )
}
"""Layer type -> its spec model: the allow-list (``GET /v1/architectures`` shows it)."""


def check_layer_tree(layers: object, *, path: str = "layers", nesting: int = 0, count: list[int] | None = None) -> None:
    """The checks pydantic would word poorly, on the raw JSON before it is validated: unknown layer types and
    keywords (named, with the allowed ones), combinators nested deeper than MAX_NESTING, more than
    MAX_SEQUENTIAL_LAYERS layers in all. Anything else (types, bounds) is left to the models.

    Raises:
        ValueError: the first problem, naming the layer by its path, e.g. ``layers.3.body.1``.
    """
    count = [0] if count is None else count
    if not isinstance(layers, list):
        return
    for i, raw in enumerate(layers):
        where = f"{path}.{i}"
        if not isinstance(raw, dict):
            continue
        kind = raw.get("type")
        spec = LAYER_SPECS.get(kind) if isinstance(kind, str) else None
        if spec is None:
            raise ValueError(
                f"layer {where}: unknown layer type {kind!r}; allowed types: {', '.join(sorted(LAYER_SPECS))}. "
                "Any other module needs an operator factory (family 'factory'; GET /v1/architectures lists those "
                "this server allows)"
            )
        keywords = [name for name in spec.model_fields if name != "type"]
        extra = sorted(set(raw) - set(spec.model_fields))
        if extra:
            raise ValueError(
                f"layer {where} ({kind}): keyword{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))} "
                f"not allowed; {kind} takes {', '.join(keywords) or 'no keywords'}"
            )
        count[0] += 1
        if count[0] > MAX_SEQUENTIAL_LAYERS:
            raise ValueError(f"more than {MAX_SEQUENTIAL_LAYERS} layers (nested ones included), the limit")
        if kind == "Residual":
            if nesting + 1 > MAX_NESTING:
                raise ValueError(
                    f"layer {where} (Residual) is nested {nesting + 1} deep, more than the limit of {MAX_NESTING}; "
                    "flatten the blocks into one list (residual blocks follow each other, they need not nest)"
                )
            for branch in ("body", "shortcut"):
                check_layer_tree(raw.get(branch), path=f"{where}.{branch}", nesting=nesting + 1, count=count)
