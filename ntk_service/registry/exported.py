"""``torch.export`` archives from clients, loaded without unpickling or executing anything they carry.

    >>> program = load_exported(archive_bytes, operation="register 'm'")
    >>> program.module(x)                          # a torch.fx.GraphModule: (N, *input) -> (N, *out)
    >>> program.state_dict                         # the original module's names: "blocks.0.weight", "gate", ...

NOTE [archive threat model]
``torch.export.load`` is not safe on untrusted bytes: ``torch/export/pt2_archive/_package.py`` calls
``torch.load(..., weights_only=False)`` for weights and constants marked ``use_pickle`` and ``pickle.loads`` /
``torch._C._pickle_load_obj`` for custom and opaque objects; ``torch/_export/serde/serialize.py`` retries the
sample inputs with ``weights_only=False``, ``sympy.sympify`` (which evaluates Python) every symbolic-size string,
``treespec_loads`` imports any module an ``__enum__`` names, and ``ExportedProgram.module()`` ``exec``s the
archive's ``guards_code``. So this module never calls ``torch.export.load`` and reads the archive itself:

1. the zip (archive.py): names relative, no ``..``, bounded count and sizes, no zip bomb, read in memory only;
2. ``archive_format`` is ``pt2``; exactly one program, ``models/model.json``; the sample inputs are never read;
3. weights and constants only from raw tensor payloads: every entry marked ``use_pickle`` and every custom or
   opaque object is refused; dtype, layout (strided), device (cpu), sizes, strides and offset of each tensor are
   checked against its payload's byte count before a tensor is made of it (``torch.frombuffer`` + ``as_strided``);
4. the graph JSON, parsed with ``json`` (bounded size): every node target against the allow-list
   (op_allowlist.py); every symbolic-size string against a grammar of symbols, integers and arithmetic (no names
   but symbols and the sympy functions torch writes, no dots, quotes, brackets or ``__``); every tree spec
   against plain containers; the signature to parameters, buffers, tensor constants and one tensor input, one
   tensor output and no mutation, custom object or effect token; every parameter, buffer and submodule name a dotted
   identifier and every forward argument an identifier (torch.fx pastes them unescaped into the source it execs);
   ``guards_code`` is emptied (the service checks input shapes itself) and node metadata (stack traces, which fx
   writes into that source as comments) is dropped;
5. only then torch's own deserializer (``ExportedProgramDeserializer().deserialize``) on the validated JSON, with
   the tensors from step 3 and no sample inputs, under a lock (it keeps a process-wide "current deserializer").
"""

from __future__ import annotations

import json
import keyword
import math
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._export.serde import schema
from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass

from ntk_service.errors import InvalidInput, UnsupportedModel
from ntk_service.registry.archive import ArchiveEntries, ArchiveLimits, read_archive
from ntk_service.registry.op_allowlist import check_graph_ops

__all__ = ["EXPORTED_FAMILY", "ExportedProgram", "exported_architecture", "load_exported", "probe_output_dim"]

EXPORTED_FAMILY = "exported"
"""The ``family`` of a model registered as a torch.export program; its architecture names the stored archive."""

MAX_GRAPH_JSON_BYTES = 64 << 20
"""Largest graph JSON (models/model.json): a ResNet-50's is about 1 MB; this bounds json and the deserializer."""

MAX_EXPR_CHARS = 500
"""Longest symbolic-size expression: a batch dimension is ``s77``; products of a few sizes stay under 100."""

_MODEL = "model"
_DTYPES: dict[int, torch.dtype] = {
    7: torch.float32,
    8: torch.float64,
    6: torch.float16,
    13: torch.bfloat16,
    5: torch.int64,
    4: torch.int32,
    12: torch.bool,
    1: torch.uint8,
}
"""Serialized ScalarType codes (torch/_export/serde/schema.py) a payload may hold."""
_STRIDED = 7
_PAYLOAD_NAME = {"weights": re.compile(r"^weight_\d{1,9}$"), "constants": re.compile(r"^tensor_\d{1,9}$")}
_TOKEN = re.compile(
    r"\s+|[A-Za-z_][A-Za-z0-9_]*|'[a-z]{1,4}\d{1,9}'|\d{1,12}(?:\.\d{1,12})?|==|!=|<=|>=|//|[-+*/%<>(),=]"
)
"""The tokens of a symbolic-size string: names, quoted symbol names, bounded numbers, arithmetic and comparisons."""
_SYMBOL = re.compile(r"^(s|u|zf|zuf|ps)\d{1,9}$")
_SYMPY_NAMES = frozenset(
    {"FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv"}
    | {"FloatTrueDiv", "IntTrueDiv", "TruncToFloat", "TruncToInt", "RoundToInt", "ToFloat", "Identity"}
    | {"Max", "Min", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "True", "False", "oo", "Integer"}
    | {"Rational", "Abs", "floor", "ceiling", "Mul", "Add", "Symbol", "positive", "integer", "real", "nonnegative"}
    | {"finite"}
)
"""Names a symbolic-size string may use besides symbols: torch.utils._sympy.functions and sympy's basics, as
``srepr`` writes them (``Symbol('s77', positive=True, integer=True)``). No powers: sympy evaluates
``Pow(10, 10**12)`` eagerly, a denial of service; a batch dimension never needs one."""
_TREESPEC_TYPES = frozenset(
    {None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"}
    | {"torch.fx.immutable_collections.immutable_list", "torch.fx.immutable_collections.immutable_dict"}
)
_FQN = re.compile(r"^[A-Za-z0-9_]{1,200}(\.[A-Za-z0-9_]{1,200}){0,64}$")
_NAME_KEYS = ("parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name", "fqn")
"""Keys whose strings torch.fx pastes into the Python source it generates and execs (``getattr(self, "<name>")``,
``def forward(self, <arg names>)``), unescaped."""
_INPUT_KINDS = frozenset({"parameter", "buffer", "tensor_constant", "user_input"})
_DESERIALIZE_LOCK = threading.Lock()


@dataclass(frozen=True)
class ExportedProgram:
    """A validated program: its graph module and the tensors it was loaded with.

    Attributes:
        module: the ``torch.fx.GraphModule`` of ``ExportedProgram.module()``, eval semantics; its parameters and
            buffers carry the original module's names.
        state_dict: name -> tensor of the weights config (parameters and persistent buffers), as stored.
        constants: name -> tensor of the constants config (non-persistent buffers, lifted tensor constants).
        targets: the operators the graph calls.
        input_shape: one example's shape (the user input's sizes without the batch dimension; dynamic ones None).
        input_dtype: "float32" or "int64".
        vocab_size: int64 inputs only: the rows of the smallest embedding that reads the input (ids must be below).
    """

    module: nn.Module
    state_dict: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor]
    targets: frozenset[str]
    input_shape: tuple[int | None, ...]
    input_dtype: str
    vocab_size: int | None = None


def _json(entries: ArchiveEntries, name: str, limit: int) -> Any:
    operation = entries.operation
    if name not in entries.infos:
        raise InvalidInput(
            f"{operation}: the archive has no {entries.root}/{name}; send the file torch.export.save wrote for one "
            "ExportedProgram"
        )
    if entries.size(name) > limit:
        raise InvalidInput(f"{operation}: {name} has {entries.size(name):,} bytes, more than the limit of {limit:,}")
    try:
        return json.loads(entries.read(name).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidInput(f"{operation}: {name} is not valid JSON ({exc})") from exc


def _as_int(value: Any, what: str, operation: str) -> int:
    if isinstance(value, Mapping) and set(value) == {"as_int"} and type(value["as_int"]) is int:
        return int(value["as_int"])
    raise InvalidInput(f"{operation}: {what} is {value!r}; stored tensors need integer sizes, strides and offsets")


def _payload_tensor(
    meta: Any, payload: bytes, where: str, operation: str, cache: dict[str, torch.Tensor], path: str
) -> torch.Tensor:
    """One stored tensor from its raw bytes, after checking its declared layout against them."""
    if not isinstance(meta, Mapping):
        raise InvalidInput(f"{operation}: {where} has no tensor_meta; only raw tensor payloads are read")
    dtype = _DTYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise InvalidInput(
            f"{operation}: {where} has dtype code {meta.get('dtype')!r}; stored tensors may be "
            + ", ".join(str(d).removeprefix("torch.") for d in _DTYPES.values())
        )
    if meta.get("layout") != _STRIDED:
        raise InvalidInput(f"{operation}: {where} has layout {meta.get('layout')!r}; only strided tensors are read")
    device = meta.get("device")
    if not isinstance(device, Mapping) or device.get("type") != "cpu":
        raise InvalidInput(f"{operation}: {where} is on device {device!r}; export the module on the CPU")
    sizes = [_as_int(s, f"{where}: a size", operation) for s in meta.get("sizes") or []]
    strides = [_as_int(s, f"{where}: a stride", operation) for s in meta.get("strides") or []]
    offset = _as_int(meta.get("storage_offset"), f"{where}: the storage offset", operation)
    if len(sizes) != len(strides) or any(n < 0 for n in sizes) or any(s < 0 for s in strides) or offset < 0:
        raise InvalidInput(
            f"{operation}: {where} declares sizes {sizes}, strides {strides}, offset {offset}; they must be "
            "non-negative with one stride per size"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(payload) % itemsize:
        raise InvalidInput(
            f"{operation}: {where}: its payload has {len(payload)} bytes, not a multiple of the {itemsize}-byte "
            f"{str(dtype).removeprefix('torch.')}"
        )
    numel = len(payload) // itemsize
    needed = 0 if 0 in sizes else offset + 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    if needed > numel:
        raise InvalidInput(
            f"{operation}: {where} declares sizes {sizes}, strides {strides} and offset {offset}, which need "
            f"{needed * itemsize:,} bytes, but its payload has {len(payload):,}; the sizes do not match the bytes"
        )
    flat = cache.get(path)
    if flat is None:
        flat = torch.frombuffer(bytearray(payload), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
        cache[path] = flat
    if flat.dtype != dtype:
        raise InvalidInput(f"{operation}: {where} reads payload {path} as another dtype than a tensor before it")
    return torch.as_strided(flat, sizes, strides, offset) if math.prod(sizes) else flat.new_empty(sizes)


def _tensors(entries: ArchiveEntries, kind: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors of ``data/<kind>/model_<kind>_config.json``; returns them and the names of parameters."""
    operation = entries.operation
    config_name = f"data/{kind}/{_MODEL}_{kind}_config.json"
    config = _json(entries, config_name, MAX_GRAPH_JSON_BYTES)
    items = config.get("config") if isinstance(config, Mapping) else None
    if not isinstance(items, Mapping):
        raise InvalidInput(f"{operation}: {config_name} has no 'config' object")
    tensors: dict[str, torch.Tensor] = {}
    params: set[str] = set()
    cache: dict[str, torch.Tensor] = {}
    for fqn, payload_meta in items.items():
        where = f"{kind[:-1]} {fqn!r}"
        if not isinstance(payload_meta, Mapping):
            raise InvalidInput(f"{operation}: {where} has no payload description")
        path = payload_meta.get("path_name")
        if payload_meta.get("use_pickle") is not False:
            raise InvalidInput(
                f"{operation}: {where} is marked use_pickle (a pickled tensor subclass or object); the service "
                "never unpickles uploads. Export plain tensors (no tensor subclasses, no custom objects)"
            )
        if not isinstance(path, str) or not _PAYLOAD_NAME[kind].match(path):
            hint = "custom and opaque objects are refused" if kind == "constants" else "weights are weight_<i>"
            raise InvalidInput(
                f"{operation}: {where} points at payload {path!r}; only raw tensors are read ({hint}). Export a "
                "module whose state is plain tensors"
            )
        payload = entries.read(f"data/{kind}/{path}")
        tensor = _payload_tensor(payload_meta.get("tensor_meta"), payload, where, operation, cache, path)
        tensors[str(fqn)] = tensor
        if payload_meta.get("is_param") is True:
            params.add(str(fqn))
    return tensors, params


def _strings(tree: Any, key: str) -> Iterator[Any]:
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            for k, v in item.items():
                if k == key:
                    yield v
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)


def _check_expressions(program: Any, operation: str) -> None:
    for expr in _strings(program, "expr_str"):
        ok = isinstance(expr, str) and len(expr) <= MAX_EXPR_CHARS and "__" not in expr
        if ok:
            tokens = _TOKEN.findall(expr)
            ok = "".join(tokens) == expr and all(
                not t[0].isalpha() or _SYMBOL.match(t) is not None or t in _SYMPY_NAMES for t in tokens
            )
            ok = ok and all(len(t) <= 30 for t in tokens)
        if not ok:
            raise InvalidInput(
                f"{operation}: the graph has the symbolic size {str(expr)[:80]!r}, which is not an arithmetic "
                "expression of size symbols (s0, u1, ...); export the module again with torch.export.export"
            )


def _check_names(program: Any, names: list[str], operation: str) -> None:
    """Attribute paths and argument names must be plain identifiers: fx would paste them into code it execs."""
    for key in _NAME_KEYS:
        names.extend(name for name in _strings(program, key) if not (key == "fqn" and name == ""))
    for name in names:
        if not isinstance(name, str) or not _FQN.match(name):
            raise InvalidInput(
                f"{operation}: the program names a parameter, buffer or submodule {str(name)[:80]!r}; names must "
                "be dotted identifiers (letters, digits, _), as a module's named_parameters() gives them"
            )
    for arg_names in _strings(program, "forward_arg_names"):
        if not isinstance(arg_names, list) or not all(
            isinstance(a, str) and a.isidentifier() and not keyword.iskeyword(a) for a in arg_names
        ):
            raise InvalidInput(
                f"{operation}: the program's forward arguments are {str(arg_names)[:80]}; they must be identifiers"
            )


def _strip_metadata(program: Any) -> None:
    """Empty every node's metadata (stack traces, module stacks: fx writes stack traces into the code it
    generates) and the graph's custom metadata; nothing the kernels need lives there."""
    for item in _strings(program, "nodes"):
        for node in item if isinstance(item, list) else ():
            if isinstance(node, dict):
                node["metadata"] = {}
    graph_module = program.get("graph_module")
    if isinstance(graph_module, dict):
        graph_module["metadata"] = {}


def _check_treespecs(program: Any, operation: str) -> None:
    for key in ("in_spec", "out_spec"):
        for spec in _strings(program, key):
            if spec is None:
                continue
            try:
                parsed = json.loads(spec) if isinstance(spec, str) and "__enum__" not in spec else None
            except ValueError:
                parsed = None
            types = set(_strings(parsed, "type")) if parsed is not None else {"?"}
            if not types <= _TREESPEC_TYPES:
                raise InvalidInput(
                    f"{operation}: the program's {key} holds {sorted(map(str, types - _TREESPEC_TYPES))}; inputs "
                    "and outputs must be tensors in plain tuples, lists or dicts"
                )


def _check_signature(graph_module: Mapping[str, Any], operation: str) -> Mapping[str, Any]:
    """The one user input's tensor name; refuses mutations, custom objects and effect tokens."""
    signature = graph_module.get("signature")
    inputs = signature.get("input_specs") if isinstance(signature, Mapping) else None
    outputs = signature.get("output_specs") if isinstance(signature, Mapping) else None
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise InvalidInput(f"{operation}: the program has no graph signature")
    user_inputs = []
    for spec in inputs:
        kind = next(iter(spec), None) if isinstance(spec, Mapping) and len(spec) == 1 else None
        if kind not in _INPUT_KINDS:
            raise UnsupportedModel(
                f"{operation}: the program takes a {kind!r} input; only parameters, buffers, tensor constants and "
                "one tensor input are supported (no custom objects, effect tokens or non-tensor inputs)"
            )
        if kind == "user_input":
            user_inputs.append(spec[kind].get("arg") if isinstance(spec[kind], Mapping) else None)
    kinds = [next(iter(spec), None) if isinstance(spec, Mapping) else None for spec in outputs]
    if kinds != ["user_output"]:
        raise UnsupportedModel(
            f"{operation}: the program's outputs are {kinds}; it must return one tensor and mutate nothing (a "
            "buffer_mutation output means forward writes a buffer: export the module in eval mode)"
        )
    if len(user_inputs) != 1 or not isinstance(user_inputs[0], Mapping) or "as_tensor" not in user_inputs[0]:
        raise UnsupportedModel(
            f"{operation}: the program takes {len(user_inputs)} inputs ({user_inputs}); the service's models "
            "take one tensor x of shape (N, *input_shape)"
        )
    graph = graph_module.get("graph")
    if isinstance(graph, Mapping) and graph.get("custom_obj_values"):
        raise UnsupportedModel(f"{operation}: the graph holds custom objects; they are refused")
    return user_inputs[0]["as_tensor"]  # type: ignore[no-any-return]


def _input_meta(graph_module: Mapping[str, Any], name: Any, operation: str) -> tuple[tuple[int | None, ...], str]:
    values = graph_module.get("graph", {}).get("tensor_values", {})
    meta = values.get(name.get("name")) if isinstance(values, Mapping) and isinstance(name, Mapping) else None
    if not isinstance(meta, Mapping) or not isinstance(meta.get("sizes"), list) or not meta["sizes"]:
        raise UnsupportedModel(f"{operation}: the program's input has no shape with a batch dimension")
    sizes = [s.get("as_int") if isinstance(s, Mapping) else None for s in meta["sizes"]]
    dtype = {7: "float32", 5: "int64"}.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise UnsupportedModel(
            f"{operation}: the program's input has dtype code {meta.get('dtype')!r}; "
            "export with a float32 example (the service's dtype; kernels in float64 cast it) or int64 token ids"
        )
    return tuple(sizes[1:]), dtype


def load_exported(
    data: bytes, *, operation: str, limits: ArchiveLimits | None = None, max_params: int | None = None
) -> ExportedProgram:
    """Load the archive ``torch.export.save`` wrote, checking everything first (NOTE [archive threat model]).

    Args:
        data (bytes): the archive.
        operation (str): prefix of error messages, e.g. "register 'm'".
        limits (ArchiveLimits | None): zip bounds. Default: ``ArchiveLimits()``.
        max_params (int | None): the most parameter elements, checked on the declared tensors. Default: no cap.

    Returns:
        ExportedProgram: the graph module (its parameters and buffers by the original names) and its tensors.

    Raises:
        MalformedRequest: not a zip. PayloadTooLarge: a zip bomb, too many or too large entries.
        InvalidInput: a name that climbs out, a pickled or custom payload, sizes that do not match the bytes, a
            symbolic size that is not arithmetic, an archive torch cannot deserialize (torch's message).
        UnsupportedModel: an operator outside the allow-list (named), mutations, custom objects, not one tensor
            input and one tensor output.
    """
    entries = read_archive(data, limits=limits or ArchiveLimits(), operation=operation)
    fmt = entries.read("archive_format") if "archive_format" in entries.infos else b""
    programs = [n for n in entries.names() if n.startswith("models/")]
    if fmt.strip() != b"pt2" or programs != [f"models/{_MODEL}.json"]:
        raise InvalidInput(
            f"{operation}: expected a torch.export.save archive (archive_format 'pt2', one program models/"
            f"{_MODEL}.json), got format {fmt[:16]!r} and programs {programs[:4]}; save one ExportedProgram with "
            "torch.export.save(program, path)"
        )
    program = _json(entries, f"models/{_MODEL}.json", MAX_GRAPH_JSON_BYTES)
    graph_module = program.get("graph_module") if isinstance(program, Mapping) else None
    if not isinstance(graph_module, Mapping):
        raise InvalidInput(f"{operation}: models/{_MODEL}.json has no graph_module")
    targets = check_graph_ops(graph_module, operation=operation)
    _check_expressions(program, operation)
    _check_treespecs(program, operation)
    _strip_metadata(program)
    user_input = _check_signature(graph_module, operation)
    input_shape, input_dtype = _input_meta(graph_module, user_input, operation)
    state_dict, params = _tensors(entries, "weights")
    constants, _ = _tensors(entries, "constants")
    _check_names(program, [*state_dict, *constants], operation)
    if max_params is not None:
        count = sum(state_dict[name].numel() for name in params)
        if count > max_params:
            raise InvalidInput(
                f"{operation}: the program has {count:,} parameters, more than the server's limit of {max_params:,}"
            )
    vocab_size = _vocabulary(graph_module, user_input, state_dict, operation) if input_dtype == "int64" else None
    module = _deserialize(dict(program), state_dict, constants, params, operation)
    return ExportedProgram(module, state_dict, constants, frozenset(targets), input_shape, input_dtype, vocab_size)


def _vocabulary(
    graph_module: Mapping[str, Any], user_input: Any, state_dict: dict[str, torch.Tensor], operation: str
) -> int:
    """The rows of the smallest ``aten.embedding`` weight whose indices are the user input: the ids the model takes
    (the service checks them before computing, so an id out of range is a 422, not an error inside the graph)."""
    specs = graph_module["signature"]["input_specs"]
    weight_of = {
        spec["parameter"]["arg"]["name"]: spec["parameter"]["parameter_name"] for spec in specs if "parameter" in spec
    }
    rows = []
    for node in graph_module["graph"]["nodes"]:
        if not str(node.get("target", "")).startswith("torch.ops.aten.embedding."):
            continue
        arguments = {a.get("name"): a.get("arg", {}) for a in node.get("inputs", []) if isinstance(a, Mapping)}
        indices = arguments.get("indices", {}).get("as_tensor", {}).get("name")
        weight = weight_of.get(arguments.get("weight", {}).get("as_tensor", {}).get("name"))
        if indices == user_input.get("name") and weight in state_dict:
            rows.append(int(state_dict[weight].shape[0]))
    if not rows:
        raise UnsupportedModel(
            f"{operation}: the program takes int64 token ids but no embedding reads them directly, so the service "
            "cannot check the ids' range; feed the ids into an nn.Embedding first"
        )
    return min(rows)


def _deserialize(
    program: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
    params: set[str],
    operation: str,
) -> nn.Module:
    program["guards_code"] = []  # exec'd by ExportedProgram.module(); the service checks input shapes itself
    weights = {k: nn.Parameter(v) if k in params else v for k, v in state_dict.items()}
    try:
        serialized = _dict_to_dataclass(schema.ExportedProgram, program)  # type: ignore[no-untyped-call]
        with _DESERIALIZE_LOCK:
            exported = ExportedProgramDeserializer().deserialize(serialized, weights, dict(constants), None)
        module = exported.module()
        # .module() sets instance methods train/eval that raise; the graph is already eval (batch_norm and dropout
        # with training=False are checked in op_allowlist.py), so the flags they flip change nothing: drop them so
        # the engine's private eval copy works as on any module.
        for name in ("train", "eval"):
            vars(module).pop(name, None)
    except Exception as exc:  # torch's own checks of the (already validated) JSON: the upload is what is wrong
        raise InvalidInput(
            f"{operation}: torch could not load the program: {str(exc).strip()[:500] or type(exc).__name__}; "
            "write it with torch.export.save from the same torch version as the server's "
            f"({torch.__version__})"
        ) from exc
    return module


def probe_output_dim(program: ExportedProgram, *, operation: str) -> int:
    """Outputs per example k = prod(out) of a loaded program, from one forward pass on a batch of two zero examples.

    Raises:
        InvalidInput: a dynamic dimension other than the batch, a failing forward pass, or no (2, ...) floating
            output.
    """
    if any(n is None for n in program.input_shape):
        raise InvalidInput(
            f"{operation}: the program's input {program.input_shape} has dynamic sizes besides the batch "
            "dimension; export with dynamic_shapes marking only dimension 0 (Client.register_module does)"
        )
    dtype = {"float32": torch.float32, "int64": torch.int64}[program.input_dtype]
    x = torch.zeros((2, *(int(n or 0) for n in program.input_shape)), dtype=dtype)
    try:
        with torch.no_grad():
            out = program.module(x)
    except Exception as exc:  # the program is the client's: its failure is the client's error
        raise InvalidInput(
            f"{operation}: the program fails on a batch of shape {tuple(x.shape)}: {type(exc).__name__}: {exc}; "
            "export it with a dynamic batch dimension (dynamic_shapes={0: torch.export.Dim('batch')})"
        ) from exc
    ok = isinstance(out, torch.Tensor) and out.ndim >= 1 and out.shape[0] == 2 and out.is_floating_point()
    if not ok or out[0].numel() == 0:
        got = type(out).__name__ + (f" {tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else "")
        raise InvalidInput(f"{operation}: the program must map (N, *input) to a floating (N, *out), got {got}")
    return int(out[0].numel())


def exported_architecture(program: ExportedProgram, sha256: str) -> dict[str, Any]:
    """The stored architecture of an exported model: the archive's sha256 (the program is fixed per model), its
    input and the operators it calls."""
    return {
        "family": EXPORTED_FAMILY,
        "program_sha256": sha256,
        "input_shape": [int(n) for n in program.input_shape],  # type: ignore[arg-type]
        "input_dtype": program.input_dtype,
        "operators": sorted(program.targets),
        **({} if program.vocab_size is None else {"vocab_size": program.vocab_size}),
    }
