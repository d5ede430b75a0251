"""The layers a ``sequential`` architecture may hold: one strict pydantic model per allowed ``torch.nn`` class.

A layer is ``{"type": "Conv2d", "in_channels": 3, "out_channels": 16, "kernel_size": 3, "padding": 1, "bias":
false}``: the class name and the keyword arguments of its constructor, JSON scalars and lists only, each bounded.
Arguments that would change what a layer is outside eval-mode inference (``device``, ``dtype``, ``inplace``,
``max_norm``, ``batch_first=false``, ...) are not in the models, so they are refused by name. The combinators of
``ntk_service.layers`` (``Residual``, ``MeanPool``, ``PositionEmbedding``) are layers too. ``Residual`` and
``Sequential`` (an ``nn.Sequential`` standing where a layer may) nest layer lists, at most MAX_NESTING deep.
``SequentialConfig`` (architectures.py) holds the list.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ntk_service.registry.limits import MAX_LEN, MAX_NESTING, MAX_SEQUENTIAL_LAYERS, MAX_WIDTH

__all__ = ["LAYER_SPECS", "LayerSpec", "ResidualSpec", "SequentialSpec", "check_layer_tree"]

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

    type: Literal["Linear"] = Field(description="'Linear'.")
    in_features: Size = Field(description="Size of the input's last dimension.")
    out_features: Size = Field(description="Size of the output's last dimension.")
    bias: bool = Field(default=True, description="Whether the layer has a learnable bias (out_features,).")
    parameterization: ParameterizationField = "standard"
    w_std: WStd = 1.0
    b_std: BStd = 1.0


class Conv1dSpec(_Layer):
    """nn.Conv1d: (B, C_in, L) -> (B, C_out, L')."""

    type: Literal["Conv1d"] = Field(description="'Conv1d'.")
    in_channels: Size = Field(description="C_in, the input's channel dimension 1.")
    out_channels: Size = Field(description="C_out, the output's channel dimension 1 (filters).")
    kernel_size: Size1 = Field(
        description="Size of the kernel: an int for every spatial dimension, or [k].", examples=[3, [5]]
    )
    stride: Size1 = Field(default=1, description="Step of the kernel: an int, or [s].")
    padding: Padding1 = Field(
        default=0,
        description="Padding added on both sides of each spatial dimension: an int, [p], 'valid' (none) or "
        "'same' (output as long as the input; stride must be 1).",
        examples=[1, "same"],
    )
    dilation: Size1 = Field(default=1, description="Spacing between kernel elements: an int, or [d].")
    groups: Size = Field(
        default=1,
        description="Channel groups convolved apart; in_channels and out_channels must be divisible by it "
        "(groups = in_channels: depthwise).",
    )
    bias: bool = Field(default=True, description="Whether the layer has a learnable bias (out_channels,).")
    padding_mode: PaddingMode = Field(
        default="zeros",
        description="What padding holds: 'zeros', or the input's values mirrored ('reflect'), repeated from the "
        "border ('replicate') or wrapped around ('circular').",
    )
    parameterization: ParameterizationField = "standard"
    w_std: WStd = 1.0
    b_std: BStd = 1.0


class Conv2dSpec(_Layer):
    """nn.Conv2d: (B, C_in, H, W) -> (B, C_out, H', W')."""

    type: Literal["Conv2d"] = Field(description="'Conv2d'.")
    in_channels: Size = Field(description="C_in, the input's channel dimension 1.")
    out_channels: Size = Field(description="C_out, the output's channel dimension 1 (filters).")
    kernel_size: Size2 = Field(
        description="Size of the kernel: an int for every spatial dimension, or [kh, kw].", examples=[3, [3, 5]]
    )
    stride: Size2 = Field(default=1, description="Step of the kernel: an int, or [sh, sw].")
    padding: Padding2 = Field(
        default=0,
        description="Padding added on both sides of each spatial dimension: an int, [ph, pw], 'valid' (none) or "
        "'same' (output as long as the input; stride must be 1).",
        examples=[1, "same"],
    )
    dilation: Size2 = Field(default=1, description="Spacing between kernel elements: an int, or [dh, dw].")
    groups: Size = Field(
        default=1,
        description="Channel groups convolved apart; in_channels and out_channels must be divisible by it "
        "(groups = in_channels: depthwise).",
    )
    bias: bool = Field(default=True, description="Whether the layer has a learnable bias (out_channels,).")
    padding_mode: PaddingMode = Field(
        default="zeros",
        description="What padding holds: 'zeros', or the input's values mirrored ('reflect'), repeated from the "
        "border ('replicate') or wrapped around ('circular').",
    )
    parameterization: ParameterizationField = "standard"
    w_std: WStd = 1.0
    b_std: BStd = 1.0


class _BatchNormSpec(_Layer):
    num_features: Size = Field(description="C, the input's channel dimension 1.")
    eps: Eps = Field(default=1e-5, description="Added to the variance: (x - running_mean) / sqrt(running_var + eps).")
    momentum: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        default=0.1, description="Unused (eval mode); accepted so a trained layer's spec round-trips."
    )
    affine: bool = Field(
        default=True, description="Whether a learnable weight and bias (C,) scale and shift the normalised input."
    )
    track_running_stats: bool = Field(
        default=True, description="Must be true: the layer normalises with its uploaded running statistics."
    )


class BatchNorm1dSpec(_BatchNormSpec):
    """nn.BatchNorm1d in eval mode (running statistics): (B, C) or (B, C, L)."""

    type: Literal["BatchNorm1d"] = Field(description="'BatchNorm1d'.")


class BatchNorm2dSpec(_BatchNormSpec):
    """nn.BatchNorm2d in eval mode (running statistics): (B, C, H, W)."""

    type: Literal["BatchNorm2d"] = Field(description="'BatchNorm2d'.")


NormalizedShape = Size | Annotated[list[Size], Field(min_length=1, max_length=4)]


class LayerNormSpec(_Layer):
    """nn.LayerNorm over the trailing normalized_shape."""

    type: Literal["LayerNorm"] = Field(description="'LayerNorm'.")
    normalized_shape: NormalizedShape = Field(
        description="The trailing dimensions normalised over: an int (the last dimension's size) or a list of "
        "the last dimensions' sizes.",
        examples=[64, [16, 8, 8]],
    )
    eps: Eps = Field(default=1e-5, description="Added to the variance in the denominator.")
    elementwise_affine: bool = Field(
        default=True, description="Whether a learnable weight of shape normalized_shape scales the output."
    )
    bias: bool = Field(
        default=True,
        description="Whether a learnable bias of shape normalized_shape is added too (only with elementwise_affine).",
    )


class GroupNormSpec(_Layer):
    """nn.GroupNorm: (B, C, *) with C = num_channels divisible by num_groups."""

    type: Literal["GroupNorm"] = Field(description="'GroupNorm'.")
    num_groups: Size = Field(description="Groups the channels are split into; num_channels must be divisible by it.")
    num_channels: Size = Field(description="C, the input's channel dimension 1.")
    eps: Eps = Field(default=1e-5, description="Added to each group's variance in the denominator.")
    affine: bool = Field(
        default=True, description="Whether a learnable weight and bias (C,) scale and shift the normalised input."
    )


class RMSNormSpec(_Layer):
    """nn.RMSNorm over the trailing normalized_shape."""

    type: Literal["RMSNorm"] = Field(description="'RMSNorm'.")
    normalized_shape: NormalizedShape = Field(
        description="The trailing dimensions normalised over: an int (the last dimension's size) or a list of "
        "the last dimensions' sizes.",
        examples=[64, [16, 8, 8]],
    )
    eps: Eps | None = Field(
        default=None,
        description="Added to the mean square in the denominator; null is torch.finfo(input dtype).eps.",
    )
    elementwise_affine: bool = Field(
        default=True, description="Whether a learnable weight of shape normalized_shape scales the output (no bias)."
    )


class EmbeddingSpec(_Layer):
    """nn.Embedding: int64 ids (B, *) in [0, num_embeddings) -> (B, *, embedding_dim)."""

    type: Literal["Embedding"] = Field(description="'Embedding'.")
    num_embeddings: Size = Field(description="Vocabulary size; every id must be in [0, num_embeddings).")
    embedding_dim: Size = Field(description="Width d of each embedding vector.")
    padding_idx: Annotated[int, Field(ge=-MAX_WIDTH, le=MAX_WIDTH)] | None = Field(
        default=None,
        description="An id whose entries do not contribute to the gradient (as in nn.Embedding); negative counts "
        "from num_embeddings. Default: null, none.",
    )


class DropoutSpec(_Layer):
    """nn.Dropout: the identity (models run in eval mode); accepted so trained models round-trip."""

    type: Literal["Dropout"] = Field(description="'Dropout'.")
    p: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        default=0.5, description="Drop probability in training; unused here (eval mode is the identity)."
    )


class FlattenSpec(_Layer):
    """nn.Flatten: dims start_dim..end_dim merged; start_dim must not be the batch dimension 0."""

    type: Literal["Flatten"] = Field(description="'Flatten'.")
    start_dim: Annotated[int, Field(ge=-8, le=8)] = Field(
        default=1, description="First dimension merged, of the batched tensor (B, ...); negative counts from the end."
    )
    end_dim: Annotated[int, Field(ge=-8, le=8)] = Field(
        default=-1, description="Last dimension merged (inclusive); -1 is the last."
    )


class MaxPool2dSpec(_Layer):
    """nn.MaxPool2d: (B, C, H, W) -> (B, C, H', W')."""

    type: Literal["MaxPool2d"] = Field(description="'MaxPool2d'.")
    kernel_size: Size2 = Field(
        description="Size of the pooling window: an int (square) or [kh, kw].", examples=[2, [2, 2]]
    )
    stride: Size2 | None = Field(
        default=None, description="Step of the window: an int or [sh, sw]. Default: null, kernel_size."
    )
    padding: NonNegative | Annotated[list[NonNegative], Field(min_length=2, max_length=2)] = Field(
        default=0,
        description="-inf padding on both sides of H and W: an int or [ph, pw], at most half the (dilated) kernel.",
    )
    dilation: Size2 = Field(default=1, description="Spacing between window elements: an int or [dh, dw].")
    ceil_mode: bool = Field(
        default=False, description="Whether the output size rounds up (ceil) instead of down (floor)."
    )


class AvgPool2dSpec(_Layer):
    """nn.AvgPool2d: (B, C, H, W) -> (B, C, H', W')."""

    type: Literal["AvgPool2d"] = Field(description="'AvgPool2d'.")
    kernel_size: Size2 = Field(
        description="Size of the pooling window: an int (square) or [kh, kw].", examples=[2, [2, 2]]
    )
    stride: Size2 | None = Field(
        default=None, description="Step of the window: an int or [sh, sw]. Default: null, kernel_size."
    )
    padding: NonNegative | Annotated[list[NonNegative], Field(min_length=2, max_length=2)] = Field(
        default=0,
        description="Zero padding on both sides of H and W: an int or [ph, pw], at most half the kernel size.",
    )
    ceil_mode: bool = Field(
        default=False, description="Whether the output size rounds up (ceil) instead of down (floor)."
    )
    count_include_pad: bool = Field(
        default=True, description="Whether the zero padding counts in each window's divisor."
    )


class AdaptiveAvgPool2dSpec(_Layer):
    """nn.AdaptiveAvgPool2d: (B, C, H, W) -> (B, C, *output_size); [1, 1] is global average pooling."""

    type: Literal["AdaptiveAvgPool2d"] = Field(description="'AdaptiveAvgPool2d'.")
    output_size: Size2 = Field(
        description="(H', W') of the output, whatever the input size: an int (square) or [H', W'].",
        examples=[1, [2, 2]],
    )


class ReLUSpec(_Layer):
    """nn.ReLU: max(x, 0), elementwise."""

    type: Literal["ReLU"] = Field(description="'ReLU'.")


class TanhSpec(_Layer):
    """nn.Tanh: tanh(x), elementwise."""

    type: Literal["Tanh"] = Field(description="'Tanh'.")


class SigmoidSpec(_Layer):
    """nn.Sigmoid: 1 / (1 + exp(-x)), elementwise."""

    type: Literal["Sigmoid"] = Field(description="'Sigmoid'.")


class SiLUSpec(_Layer):
    """nn.SiLU: x·sigmoid(x), elementwise."""

    type: Literal["SiLU"] = Field(description="'SiLU'.")


class IdentitySpec(_Layer):
    """nn.Identity: x unchanged."""

    type: Literal["Identity"] = Field(description="'Identity'.")


class GELUSpec(_Layer):
    """nn.GELU: x·Φ(x) (or its tanh approximation), elementwise."""

    type: Literal["GELU"] = Field(description="'GELU'.")
    approximate: Literal["none", "tanh"] = Field(
        default="none", description="'none': exact, x·Φ(x) with the normal CDF Φ; 'tanh': the tanh approximation."
    )


class LeakyReLUSpec(_Layer):
    """nn.LeakyReLU, elementwise."""

    type: Literal["LeakyReLU"] = Field(description="'LeakyReLU'.")
    negative_slope: Annotated[float, Field(ge=-1e3, le=1e3)] = Field(
        default=0.01, description="Slope for negative inputs: x if x >= 0 else negative_slope·x."
    )


class ELUSpec(_Layer):
    """nn.ELU, elementwise."""

    type: Literal["ELU"] = Field(description="'ELU'.")
    alpha: Annotated[float, Field(ge=-1e3, le=1e3)] = Field(
        default=1.0, description="Scale of the negative part: x if x > 0 else alpha·(exp(x) - 1)."
    )


class SoftplusSpec(_Layer):
    """nn.Softplus: a smooth ReLU, elementwise."""

    type: Literal["Softplus"] = Field(description="'Softplus'.")
    beta: Annotated[float, Field(gt=0.0, le=1e3)] = Field(
        default=1.0, description="Sharpness: log(1 + exp(beta·x)) / beta."
    )
    threshold: Annotated[float, Field(gt=0.0, le=1e3)] = Field(
        default=20.0, description="Where beta·x exceeds it, the output is x (the linear tail, for stability)."
    )


class TransformerEncoderLayerSpec(_Layer):
    """nn.TransformerEncoderLayer with batch_first=True: (B, T, d_model) -> (B, T, d_model), no mask."""

    type: Literal["TransformerEncoderLayer"] = Field(description="'TransformerEncoderLayer'.")
    d_model: Size = Field(description="Width d_model of each token, in and out.")
    nhead: Size = Field(description="Attention heads; d_model must be divisible by it.")
    dim_feedforward: Size = Field(
        default=2048, description="Hidden width of the feed-forward block linear2(activation(linear1(x)))."
    )
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        default=0.1, description="Dropout probability in training; unused here (eval mode)."
    )
    activation: Literal["relu", "gelu"] = Field(
        default="relu", description="Nonlinearity of the feed-forward block; 'gelu' is exact (erf)."
    )
    layer_norm_eps: Eps = Field(default=1e-5, description="eps of the two LayerNorms (norm1, norm2).")
    batch_first: Literal[True] = Field(description="Must be true: inputs are (B, T, d_model).")
    norm_first: bool = Field(
        default=False,
        description="true: pre-norm, x + sa(norm1(x)) then x + ff(norm2(x)); false: post-norm, norm1(x + sa(x)) "
        "then norm2(x + ff(x)).",
    )
    bias: bool = Field(default=True, description="Whether the Linear and LayerNorm layers have learnable biases.")


class MeanPoolSpec(_Layer):
    """ntk_service.layers.MeanPool: the mean over dimension ``dim`` of (B, ...) (never 0, the batch)."""

    type: Literal["MeanPool"] = Field(description="'MeanPool'.")
    dim: Annotated[int, Field(ge=-8, le=8)] = Field(
        description="Dimension of the batched tensor (B, ...) averaged over, never 0; negative counts from the end.",
        examples=[1],
    )


class PositionEmbeddingSpec(_Layer):
    """ntk_service.layers.PositionEmbedding: (B, T, d) -> x + embedding(0..T-1), T <= num_positions."""

    type: Literal["PositionEmbedding"] = Field(description="'PositionEmbedding'.")
    num_positions: Annotated[int, Field(ge=1, le=MAX_LEN)] = Field(
        description="The longest sequence length T it takes (rows of its embedding)."
    )
    embedding_dim: Size = Field(description="Width d of the input (B, T, d).")


class ResidualSpec(_Layer):
    """ntk_service.layers.Residual: body(x) + shortcut(x) (shortcut null: body(x) + x)."""

    type: Literal["Residual"] = Field(description="'Residual'.")
    body: list[LayerSpec] = Field(
        min_length=1, max_length=MAX_SEQUENTIAL_LAYERS, description="The main path, as a list of layers."
    )
    shortcut: list[LayerSpec] | None = Field(
        default=None, max_length=MAX_SEQUENTIAL_LAYERS, description="The skip path; null is the identity."
    )


class SequentialSpec(_Layer):
    """nn.Sequential: its layers applied in order, as a layer of the outer list (parameter names ``3.0.weight``)."""

    type: Literal["Sequential"] = Field(description="'Sequential'.")
    layers: list[LayerSpec] = Field(
        min_length=1,
        max_length=MAX_SEQUENTIAL_LAYERS,
        description="The layers of the nested nn.Sequential, in order; their names are its index then theirs, "
        "e.g. 3.0.body.0.weight.",
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
    | ResidualSpec
    | SequentialSpec,
    Field(discriminator="type"),
]
"""One layer of a ``sequential`` spec, chosen by its ``type``."""

ResidualSpec.model_rebuild()
SequentialSpec.model_rebuild()

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
        SequentialSpec,
    )
}
"""Layer type -> its spec model: the allow-list (``GET /v1/architectures`` shows it)."""


_BRANCHES: dict[str, tuple[str, ...]] = {"Residual": ("body", "shortcut"), "Sequential": ("layers",)}
"""The combinators and their fields that hold layer lists (each one level of nesting deeper)."""


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
        branches = _BRANCHES.get(str(kind), ())
        if branches and nesting + 1 > MAX_NESTING:
            raise ValueError(
                f"layer {where} ({kind}) is nested {nesting + 1} deep, more than the limit of {MAX_NESTING}; "
                "flatten the blocks into one list (blocks follow each other, they need not nest)"
            )
        for branch in branches:
            check_layer_tree(raw.get(branch), path=f"{where}.{branch}", nesting=nesting + 1, count=count)
