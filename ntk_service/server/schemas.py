"""Pydantic schemas for small request and response bodies (``XCreate`` / ``XPublic`` / ``XsPublic``).

Tensors never go through these models at run time (validating a big ``list[float]`` costs about a second):
``TensorJson`` exists only to document the wire format in OpenAPI, and routes decode tensors with ``wire``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    StrictInt,
    Tag,
    TypeAdapter,
    ValidationError,
)

from ntk_service.errors import InvalidInput, MalformedRequest, operation_name
from ntk_service.kernels.family.monte_carlo import MAX_MONTE_CARLO_SEEDS
from ntk_service.kernels.modes import DerivedMode, KernelMode
from ntk_service.kernels.spec import MODES_BY_VALUE
from ntk_service.kernels.types import NtkImplementation
from ntk_service.registry.architectures import ArchitectureSpec
from ntk_service.registry.store import MAX_LABEL_LENGTH
from ntk_service.server.error_responses import format_validation_errors
from ntk_service.server.params import (
    ID_MAX_LENGTH,
    INT64_MAX,
    MAX_GLOBS,
    MAX_JSON_TENSOR_VALUES,
    QUERY_MAX_LENGTH,
    Glob,
    NonNegativeInt64,
    VersionInt,
)
from ntk_service.vocabulary import OPERATOR_MODES, ModeName, OperatorModeName, mode_help

__all__ = [
    "ArchitecturesPublic",
    "DatasetPublic",
    "DatasetRef",
    "DatasetsPublic",
    "Globs",
    "GroupKernelPublic",
    "GroupName",
    "KernelOptions",
    "KernelPublic",
    "KernelGroups",
    "KernelGroupsPublic",
    "KernelModeField",
    "KernelModeValue",
    "KernelRequest",
    "LayerName",
    "MatvecOptions",
    "MatvecPublic",
    "MatvecRequest",
    "ModelCreate",
    "ModelCreateSchema",
    "ModelPublic",
    "ModelsPublic",
    "MonteCarloOptions",
    "MonteCarloPublic",
    "MonteCarloRequest",
    "MonteCarloSeeds",
    "NngpOptions",
    "NngpPublic",
    "NngpRequest",
    "ParameterPublic",
    "TensorJson",
    "openapi_body",
    "validate_body",
]

ModelT = TypeVar("ModelT", bound=BaseModel)

KernelModeValue = ModeName
"""The wire values of KernelMode and DerivedMode as one Literal (``vocabulary.ModeName``), so a bad mode gets one
plain message ("mode: Input should be 'full', 'trace', ..."), not one per enum of a union (tested against the enums)."""

_MODE_VALUE: TypeAdapter[KernelModeValue] = TypeAdapter(KernelModeValue)


def _mode(value: Any) -> KernelMode | DerivedMode:
    return MODES_BY_VALUE[_MODE_VALUE.validate_python(value)]


KernelModeField = Annotated[KernelMode | DerivedMode, PlainValidator(_mode, json_schema_input_type=KernelModeValue)]
"""A request's ``mode``: validated once as ``KernelModeValue`` (its schema, its one-line message), and held as the
enum of that value (a lookup), so nothing downstream parses it again."""

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""Model names: safe in URLs and file names, 1 to 64 characters."""

MAX_OUTPUT_PATH = 200
"""Longest ``output`` path: a key and a few indices need under 40 characters."""

SIDE_FORMS = (
    'a JSON tensor, an object of named JSON tensors {"input_ids": tensor, "attention_mask": tensor} for a model '
    'taking several inputs, or rows of a stored data set {"dataset": id, "start", "stop"}.'
)
"""How a side may come, for the descriptions of x1, x_train, x, ..."""
X1_DESCRIPTION = "x1 (N, *input): " + SIDE_FORMS
X2_DESCRIPTION = "x2 (M, *input), as x1; null: x2 = x1 (computed once, exactly symmetric)."
DTYPE_DESCRIPTION = "Compute dtype. Default: the model's."
ELAPSED_DESCRIPTION = "Server-side compute time in milliseconds."
COUNT_DESCRIPTION = "How many items data holds."

Globs = Annotated[list[Glob], Field(max_length=MAX_GLOBS)]
"""Glob patterns over parameter names (``fnmatch``), at most MAX_GLOBS."""

ComputeDtype = Annotated[Literal["float32", "float64"] | None, Field(description=DTYPE_DESCRIPTION)]
"""A request's compute dtype (null: the model's)."""

ModelVersion = Annotated[VersionInt | None, Field(description="Model version. Default: the latest.")]
"""A request's model version (null: the latest)."""

OutputPath = Annotated[
    str | None,
    Field(
        max_length=MAX_OUTPUT_PATH,
        description='For a model returning a dict: the tensor f is (as `output` of /ntk), e.g. "logits[:, 0]".',
        examples=["logits[:, 0]"],
    ),
]
"""Which tensor of a model returning a dict a computation uses (null: the model returns one tensor)."""

GroupName = Annotated[str, Field(min_length=1, max_length=QUERY_MAX_LENGTH)]
"""The name of a parameter group (``groups`` of a kernel request)."""


def _groups_kind(value: Any) -> str:
    """Which form of ``groups`` a value is meant as, so a bad one gets that form's error alone."""
    return "modules" if isinstance(value, str) else "mapping"


KernelGroups = Annotated[
    Annotated[Literal["modules"], Tag("modules")]
    | Annotated[dict[GroupName, Globs], Field(min_length=1, max_length=MAX_GLOBS), Tag("mapping")],
    Discriminator(_groups_kind),
]
"""``groups`` of a kernel request: "modules", or 1 to MAX_GLOBS named groups of globs (``compute_ntk_groups``)."""

LayerName = Annotated[str, Field(max_length=QUERY_MAX_LENGTH)]
"""A module name as ``named_modules()`` gives it, e.g. ``"layers.3.body.1"`` ("" is the model itself)."""

MonteCarloSeeds = Annotated[
    list[Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]],
    # The count and distinctness are checked by monte_carlo_ntk (its messages say how to split a long list); the
    # schema states the same limits.
    Field(json_schema_extra={"minItems": 1, "maxItems": MAX_MONTE_CARLO_SEEDS, "uniqueItems": True}),
]
"""Distinct seeds in [0, 2⁶³), one network each; 1 to MAX_MONTE_CARLO_SEEDS of them."""


def validate_body(model: type[ModelT], data: Any, *, operation: str | None = None) -> ModelT:
    """``model.model_validate(data)``, with pydantic's errors turned into one readable line.

    Args:
        operation: names the errors here; None: the route's boundary does (NOTE [operation names] in errors.py).

    Raises:
        MalformedRequest: ``data`` is not a JSON object (400).
        InvalidInput: a field is missing or has a wrong value (422), e.g. ``"seed: Input should be ..."``.
    """
    if operation is not None:  # a caller that names its operation here
        with operation_name(operation):
            return validate_body(model, data)
    if not isinstance(data, dict):
        raise MalformedRequest(detail=f"expected a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidInput(detail=format_validation_errors(exc.errors())) from exc


class TensorJson(BaseModel):
    """A tensor in JSON (documentation only): flat row-major ``data`` of ``shape``."""

    shape: list[NonNegativeInt64] = Field(max_length=8, examples=[[2, 3]], description="The tensor's shape.")
    dtype: Literal["float32", "float64", "int64"] = Field(
        examples=["float32"], description="The element type (integers are token ids or labels)."
    )
    data: list[float] = Field(
        max_length=MAX_JSON_TENSOR_VALUES,
        examples=[[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]],
        description="The values, flat in row-major (C) order: prod(shape) of them.",
    )


class DatasetRef(BaseModel):
    """Rows ``start:stop`` of a stored data set, in place of an inline tensor."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(min_length=1, max_length=ID_MAX_LENGTH, description="Data set id from POST /v1/datasets.")
    start: int | None = Field(default=None, ge=0, le=INT64_MAX, description="First row. Default: 0.")
    stop: int | None = Field(default=None, ge=0, le=INT64_MAX, description="One past the last row. Default: all rows.")


class KernelOptions(BaseModel):
    """How to compute: JSON body fields beside x1/x2, or query parameters with a binary body."""

    model_config = ConfigDict(extra="forbid")

    mode: KernelModeField = Field(
        default=KernelMode.FULL,
        description=mode_help() + " (pseudo: (1/k) Σ_ab Θ_ab).",
    )
    implementation: NtkImplementation = Field(
        default=NtkImplementation.AUTO,
        description="How to compute (all give the same numbers); auto picks by cost.",
        examples=["auto"],
    )
    params: list[Glob] | None = Field(
        default=None,
        max_length=MAX_GLOBS,
        description="Glob patterns over parameter names; null = all.",
        examples=[["layers.1.*"]],
    )
    dtype: Literal["float32", "float64"] | None = Field(default=None, description=DTYPE_DESCRIPTION)
    version: int | None = Field(default=None, ge=1, le=INT64_MAX, description="Model version. Default: the latest.")
    groups: KernelGroups | None = Field(
        default=None,
        description='Per-layer kernels: "modules" (one group per module with parameters) or {"name": [globs]}; '
        "the answer has one kernel per group (JSON groups[], or a safetensors tensor per group). Not with params.",
    )
    rest: bool = Field(default=False, description="With groups: the parameters no group lists, as a group 'rest'.")
    output: str | None = Field(
        default=None,
        max_length=MAX_OUTPUT_PATH,
        description="For a model returning a dict (its record's architecture lists `outputs`): the tensor the "
        'kernel is of, a key with optional indexing, e.g. "logits" or "logits[:, 2, :4]" (parsed, never '
        "evaluated; k = its size per example). null: the model returns one tensor.",
        examples=["logits[:, 0]"],
    )


class KernelRequest(KernelOptions):
    """``POST /v1/models/{name}/ntk`` as JSON (documentation; routes decode x1/x2 with ``wire``)."""

    x1: TensorJson | dict[str, TensorJson] | DatasetRef = Field(description=X1_DESCRIPTION)
    x2: TensorJson | dict[str, TensorJson] | DatasetRef | None = Field(default=None, description=X2_DESCRIPTION)


class KernelPublic(BaseModel):
    """The JSON kernel response."""

    theta: TensorJson = Field(description="Θ(x1, x2) in the mode's shape: " + mode_help() + ".")
    mode: KernelModeValue = Field(description="The mode computed.")
    implementation: NtkImplementation = Field(description='The implementation that ran (never "auto").')
    model: str = Field(description="The model's name.")
    version: int = Field(description="The model version used.")
    elapsed_ms: float = Field(description=ELAPSED_DESCRIPTION)
    dtype: Literal["float32", "float64"] | None = Field(default=None, description="The dtype Θ was computed in.")
    note: str | None = Field(
        default=None,
        description='Present when float64 inputs were computed in float32 (no dtype="float64" in the request).',
    )


class GroupKernelPublic(BaseModel):
    """One group's kernel in the JSON answer."""

    name: str = Field(description='The group\'s name: a key of `groups`, a module path for "modules", or "rest".')
    parameters: list[str] = Field(description="The parameters the group holds (`named_parameters()` names).")
    theta: TensorJson = Field(
        description="Θ_g(x1, x2) of the group's parameters alone, in the mode's layout (as `theta` of the plain "
        "kernel answer); the groups sum to the kernel of all their parameters."
    )


class KernelGroupsPublic(BaseModel):
    """The JSON answer of a kernel request with ``groups``."""

    groups: list[GroupKernelPublic] = Field(description="One kernel per group, in the order the groups were given.")
    mode: KernelModeValue = Field(description="The mode computed.")
    implementation: NtkImplementation = Field(description='The implementation that ran (never "auto").')
    model: str = Field(description="The model's name.")
    version: int = Field(description="The model version used.")
    elapsed_ms: float = Field(description=ELAPSED_DESCRIPTION)


class ModelCreate(BaseModel):
    """``POST /v1/models``: a built-in family or an allowed factory, initialized from ``seed``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=NAME_PATTERN, examples=["mnist-mlp"], description="A unique name: letters, digits, '._-', 1-64."
    )
    architecture: dict[str, Any] = Field(
        description="The family and its config fields (GET /v1/architectures lists them).",
        examples=[{"family": "mlp", "input_dim": 784, "hidden": [256], "output_dim": 10, "activation": "relu"}],
    )
    seed: int = Field(default=0, ge=0, le=INT64_MAX, description="Seed of the initial weights (version 1).")
    label: str | None = Field(
        default=None, max_length=MAX_LABEL_LENGTH, description="Label of version 1, e.g. 'init'. Default: none."
    )


class ModelCreateSchema(ModelCreate):
    """``POST /v1/models`` as OpenAPI documents it (documentation only): ``architecture`` is the discriminated union
    of the families on ``family``, each with an example. Routes validate the architecture in the registry
    (``parse_architecture``), so the library and HTTP give the same messages."""

    architecture: ArchitectureSpec = Field(  # type: ignore[assignment]
        description="The family (the discriminator) and its config fields; GET /v1/architectures lists them."
    )


class ParameterPublic(BaseModel):
    """One parameter tensor."""

    name: str = Field(description="Its name in named_parameters(), e.g. 'layers.0.weight'.")
    shape: list[int] = Field(description="Its shape.")


class InputLeafPublic(BaseModel):
    """One named input of a model taking several tensors."""

    name: str = Field(description="The forward argument's name.", examples=["input_ids"])
    shape: list[int] = Field(description="One example's shape, without the batch dimension.", examples=[[16]])
    dtype: str = Field(description='"float32", or "int64" for ids and masks.', examples=["int64"])
    vocab_size: int | None = Field(default=None, description="Ids must be below it; null: not token ids.")


class InputSpecPublic(BaseModel):
    """The inputs of a model taking several tensors."""

    kind: Literal["mapping", "tuple"] = Field(description="mapping: keyword arguments; tuple: positional ones.")
    leaves: list[InputLeafPublic] = Field(description="One per input, in forward's order.")


class ModelPublic(BaseModel):
    """One version of a registered model."""

    name: str = Field(description="The model's name.", examples=["mnist-mlp"])
    version: int = Field(description="1 for the seeded weights, then 2, 3, ... per weight upload.", examples=[1])
    architecture: dict[str, Any] = Field(description="The validated architecture, defaults filled in.")
    seed: int | None = Field(default=None, description="The seed of version 1; null for uploaded weights.")
    num_params: int = Field(description="P, parameter values (tied parameters counted once).", examples=[203530])
    input_shape: list[int] = Field(description="One example's shape, without the batch dimension.", examples=[[784]])
    input_dtype: str = Field(description='"float32", or "int64" for token ids.', examples=["float32"])
    output_dim: int = Field(description="k, outputs per example.", examples=[10])
    parameters: list[ParameterPublic] = Field(description="(name, shape) in named_parameters() order.")
    weights_sha256: str = Field(description="Hex sha256 of the stored safetensors file.")
    created_at: str = Field(description="When this version was uploaded (UTC, ISO 8601).")
    label: str | None = Field(default=None, description="The label given with the upload, e.g. 'epoch 3'.")
    inputs: InputSpecPublic | None = Field(
        default=None,
        description="A model taking several tensors: their names, shapes and dtypes (send x1 as an object of "
        "named tensors); null: one input x (N, *input_shape).",
    )
    class_name: str | None = Field(
        default=None,
        description="An exported model's class, as its archive records it (e.g. 'ResidualMlp'); null otherwise.",
    )
    parameter_paths: dict[str, Any] | None = Field(
        default=None,
        description="What the kernel engine does with the model, found at registration: 'groups' (per layer: "
        "'path' structured or autograd, 'form' factored / jacobian / jacrev / unused, the 'ops' and the "
        "'reason'), 'capture', 'auto' (the implementation AUTO takes at N = M = 64, FULL, and the weighted "
        "estimates it compared), parameter counts per path; {'error': ...} when the model could not be run on "
        "placeholder inputs; null for models registered before the report existed.",
    )


class ModelsPublic(BaseModel):
    data: list[ModelPublic] = Field(description="The latest version of each model.")
    count: int = Field(description=COUNT_DESCRIPTION)


class DatasetPublic(BaseModel):
    """An uploaded data set."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(description="ds_ and 24 hex digits, to reference it in kernels and jobs.")
    name: str | None = Field(default=None, description="The name given with the upload (not unique).")
    shape: list[int] = Field(description="(N, *input); (N,) for named arrays.", examples=[[1000, 784]])
    dtype: str = Field(description='"float32", "float64" or "int64"; "mapping" for named arrays.', examples=["float32"])
    sha256: str = Field(description="Hex sha256 of the stored .npy file (of the names and the arrays' hashes).")
    size_bytes: int = Field(description="Size of the stored .npy file(s).")
    arrays: list[dict[str, Any]] | None = Field(
        default=None,
        description='Named arrays only: [{"name", "shape": (N, *input_i), "dtype"}, ...] in upload order.',
        examples=[[{"name": "input_ids", "shape": [1000, 128], "dtype": "int64"}]],
    )
    created_at: str = Field(description="When it was uploaded (UTC, ISO 8601).")


class DatasetsPublic(BaseModel):
    data: list[DatasetPublic] = Field(description="Every data set.")
    count: int = Field(description=COUNT_DESCRIPTION)


class ArchitecturesPublic(BaseModel):
    data: list[dict[str, Any]] = Field(
        description="One entry per family (its config fields and an example), the sequential layer types and "
        "the allowed factories."
    )
    count: int = Field(description=COUNT_DESCRIPTION)


class NngpOptions(BaseModel):
    """``POST /v1/models/{name}/nngp``: the fields beside x1/x2."""

    model_config = ConfigDict(extra="forbid")

    mode: KernelModeField = Field(default=KernelMode.FULL, description="As for /ntk, with d features for k.")
    layer: LayerName | None = Field(
        default=None, description="A module name: its output's features. null = the outputs."
    )
    dtype: ComputeDtype = None
    version: ModelVersion = None
    output: OutputPath = None


class NngpRequest(NngpOptions):
    """``POST /v1/models/{name}/nngp`` as JSON (documentation; the route decodes x1/x2 with ``wire``)."""

    x1: TensorJson | DatasetRef = Field(description=X1_DESCRIPTION)
    x2: TensorJson | DatasetRef | None = Field(default=None, description=X2_DESCRIPTION)


class NngpPublic(BaseModel):
    kernel: TensorJson = Field(description="f(x1) f(x2)ᵀ, shaped as the mode's kernel with d features for k.")
    mode: KernelModeValue = Field(description="The mode computed.")
    layer: str | None = Field(description="The module whose features were used; null: the outputs.")
    features: int = Field(description="d, the features per example.")
    model: str = Field(description="The model's name.")
    version: int = Field(description="The model version used.")
    elapsed_ms: float = Field(description=ELAPSED_DESCRIPTION)


class MonteCarloOptions(BaseModel):
    """``POST /v1/models/{name}/monte_carlo``: the fields beside x1/x2. Each seed builds the model's architecture
    afresh (its registered weights are not used)."""

    model_config = ConfigDict(extra="forbid")

    # strict: JSON true / "7" / 7.0 are not seeds (lax pydantic would turn true into 1, "7" into 7)
    seeds: MonteCarloSeeds = Field(description=f"Distinct seeds, one network each (1 to {MAX_MONTE_CARLO_SEEDS}).")
    kernel: Literal["ntk", "nngp"] = Field(default="ntk", description="The kernel averaged.")
    mode: KernelModeField = Field(default=KernelMode.FULL, description="As for /ntk.")
    layer: LayerName | None = Field(default=None, description="kernel=nngp only: the module whose features to use.")
    params: Globs | None = Field(default=None, description="kernel=ntk only: parameter globs; null = all.")
    dtype: Literal["float32", "float64"] | None = Field(default=None, description=DTYPE_DESCRIPTION)
    version: VersionInt | None = Field(
        default=None, description="The model version whose architecture is built. Default: the latest."
    )


class MonteCarloRequest(MonteCarloOptions):
    """``POST /v1/models/{name}/monte_carlo`` as JSON (documentation)."""

    x1: TensorJson | DatasetRef = Field(description=X1_DESCRIPTION)
    x2: TensorJson | DatasetRef | None = Field(default=None, description=X2_DESCRIPTION)


class MonteCarloPublic(BaseModel):
    mean: TensorJson = Field(description="The kernel averaged over the seeds, shaped as the mode's kernel.")
    stderr: TensorJson | None = Field(description="Per-entry standard error of the mean; null for one seed.")
    n_samples: int = Field(description="Networks averaged (the number of seeds).")
    kernel: Literal["ntk", "nngp"] = Field(description="The kernel averaged.")
    mode: KernelModeValue = Field(description="The mode computed.")
    models_per_chunk: int = Field(description="Networks evaluated as one batched call.")
    model: str = Field(description="The model whose architecture was built.")
    version: int = Field(description="The model version whose architecture was built.")
    elapsed_ms: float = Field(description=ELAPSED_DESCRIPTION)


class MatvecOptions(BaseModel):
    """``POST /v1/models/{name}/operator/matvec``: the fields beside x1/x2/v."""

    model_config = ConfigDict(extra="forbid")

    mode: OperatorModeName = Field(
        default="full",
        description=mode_help(tuple(OPERATOR_MODES)) + "; v is (M, k) for a kernel of k × k blocks (full), else (M,).",
    )
    transpose: bool = Field(default=False, description="Θᵀ w = Θ(x2, x1) w instead of Θ v.")
    params: Globs | None = Field(default=None, description="Glob patterns over parameter names; null = all.")
    dtype: ComputeDtype = None
    version: ModelVersion = None
    output: OutputPath = None


class MatvecRequest(MatvecOptions):
    """``POST /v1/models/{name}/operator/matvec`` as JSON (documentation)."""

    x1: TensorJson | DatasetRef = Field(description=X1_DESCRIPTION)
    x2: TensorJson | DatasetRef | None = Field(default=None, description=X2_DESCRIPTION)
    v: TensorJson = Field(description="(M, k) for full, (M,) for trace and pseudo; (N, ...) with transpose.")


class MatvecPublic(BaseModel):
    product: TensorJson = Field(description="Θ(x1, x2) v: (N, k) full, (N,) trace and pseudo; (M, ...) transposed.")
    mode: OperatorModeName = Field(description="The mode computed.")
    model: str = Field(description="The model's name.")
    version: int = Field(description="The model version used.")
    elapsed_ms: float = Field(description=ELAPSED_DESCRIPTION)


def _inline_refs(node: Any, defs: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:  # a recursive schema (a Residual's body is a list of layers): stop at the cycle
                return {"type": "object", "description": f"{name}, as above (recursive)"}
            return _inline_refs(defs[name], defs, (*seen, name))
        if isinstance(node.get("discriminator"), dict):  # its mapping points into $defs, gone once inlined
            node = {**node, "discriminator": {"propertyName": node["discriminator"]["propertyName"]}}
        return {k: _inline_refs(v, defs, seen) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs, seen) for v in node]
    return node


def openapi_body(model: type[BaseModel], *, binary: dict[str, str] | None = None) -> dict[str, Any]:
    """``openapi_extra`` documenting a body the route reads itself (after auth): JSON by ``model``, plus the
    binary media types in ``binary`` (media type -> description)."""
    schema = model.model_json_schema()
    content: dict[str, Any] = {"application/json": {"schema": _inline_refs(schema, schema.get("$defs", {}))}}
    for media, description in (binary or {}).items():
        content[media] = {"schema": {"type": "string", "format": "binary", "description": description}}
    return {"requestBody": {"required": True, "content": content}}
