"""Checks of a torch.export program's JSON before torch's deserializer sees it: every string it would evaluate,
import by, or paste into generated code, and the signature the service supports.

    >>> check_expressions(program, operation)    # symbolic sizes: sympy.sympify evaluates them
    >>> check_treespecs(program, operation)      # tree specs: treespec_loads imports what an __enum__ names
    >>> check_names(program, names, operation)   # attribute paths: torch.fx pastes them into code it execs
    >>> user_input = check_signature(graph_module, operation)

NOTE [archive threat model] in exported.py lists what each check stops.
"""

from __future__ import annotations

import json
import keyword
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ntk_service.errors import InvalidInput, UnsupportedModel

__all__ = [
    "MAX_EXPR_CHARS",
    "check_expressions",
    "check_names",
    "check_signature",
    "check_treespecs",
    "input_meta",
    "input_vocabulary",
    "strip_metadata",
]

MAX_EXPR_CHARS = 500
"""Longest symbolic-size expression: a batch dimension is ``s77``; products of a few sizes stay under 100."""

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


def check_expressions(program: Any, operation: str) -> None:
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


def check_names(program: Any, names: list[str], operation: str) -> None:
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


def strip_metadata(program: Any) -> None:
    """Empty every node's metadata (stack traces, module stacks: fx writes stack traces into the code it
    generates) and the graph's custom metadata; nothing the kernels need lives there."""
    for item in _strings(program, "nodes"):
        for node in item if isinstance(item, list) else ():
            if isinstance(node, dict):
                node["metadata"] = {}
    graph_module = program.get("graph_module")
    if isinstance(graph_module, dict):
        graph_module["metadata"] = {}


def check_treespecs(program: Any, operation: str) -> None:
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


def check_signature(graph_module: Mapping[str, Any], operation: str) -> Mapping[str, Any]:
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


def input_meta(graph_module: Mapping[str, Any], name: Any, operation: str) -> tuple[tuple[int | None, ...], str]:
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


def input_vocabulary(
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
