"""Checks of a torch.export program's JSON before torch's deserializer sees it: every string it would evaluate,
import by, or paste into generated code, and the signature the service supports.

    >>> check_expressions(program)    # symbolic sizes: sympy.sympify evaluates them
    >>> check_treespecs(program)      # tree specs: treespec_loads imports what an __enum__ names
    >>> check_names(program, names)   # attribute paths: torch.fx pastes them into code it execs
    >>> user_input = check_signature(graph_module)

NOTE [archive threat model] in exported.py lists what each check stops. Errors are raised with ``detail=``: the
caller's boundary names the operation (NOTE [operation names] in errors.py).
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
    "embedding_rows",
    "input_meta",
    "input_names",
    "input_vocabulary",
    "output_is_tensor",
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


def check_expressions(program: Any) -> None:
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
                detail=f"the graph has the symbolic size {str(expr)[:80]!r}, which is not an arithmetic "
                "expression of size symbols (s0, u1, ...); export the module again with torch.export.export"
            )


def check_names(program: Any, names: list[str]) -> None:
    """Attribute paths and argument names must be plain identifiers: fx would paste them into code it execs."""
    for key in _NAME_KEYS:
        names.extend(name for name in _strings(program, key) if not (key == "fqn" and name == ""))
    for name in names:
        if not isinstance(name, str) or not _FQN.match(name):
            raise InvalidInput(
                detail=f"the program names a parameter, buffer or submodule {str(name)[:80]!r}; names must "
                "be dotted identifiers (letters, digits, _), as a module's named_parameters() gives them"
            )
    for arg_names in _strings(program, "forward_arg_names"):
        if not isinstance(arg_names, list) or not all(
            isinstance(a, str) and a.isidentifier() and not keyword.iskeyword(a) for a in arg_names
        ):
            raise InvalidInput(
                detail=f"the program's forward arguments are {str(arg_names)[:80]}; they must be identifiers"
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


def check_treespecs(program: Any) -> None:
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
                    detail=f"the program's {key} holds {sorted(map(str, types - _TREESPEC_TYPES))}; inputs "
                    "and outputs must be tensors in plain tuples, lists or dicts"
                )


def check_signature(graph_module: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The user inputs' tensor names, in order (one or more); refuses mutations, custom objects, effect tokens and
    non-tensor inputs."""
    signature = graph_module.get("signature")
    inputs = signature.get("input_specs") if isinstance(signature, Mapping) else None
    outputs = signature.get("output_specs") if isinstance(signature, Mapping) else None
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise InvalidInput(detail="the program has no graph signature")
    user_inputs = []
    for spec in inputs:
        kind = next(iter(spec), None) if isinstance(spec, Mapping) and len(spec) == 1 else None
        if kind not in _INPUT_KINDS:
            raise UnsupportedModel(
                detail=f"the program takes a {kind!r} input; only parameters, buffers, tensor constants and "
                "tensor inputs are supported (no custom objects, effect tokens or non-tensor inputs)"
            )
        if kind == "user_input":
            user_inputs.append(spec[kind].get("arg") if isinstance(spec[kind], Mapping) else None)
    kinds = [next(iter(spec), None) if isinstance(spec, Mapping) else None for spec in outputs]
    if not kinds or any(kind != "user_output" for kind in kinds):
        raise UnsupportedModel(
            detail=f"the program's outputs are {kinds}; it must return a tensor (or a dict of tensors) and "
            "mutate nothing (a buffer_mutation output means forward writes a buffer: export the module in eval mode)"
        )
    tensors = [u for u in user_inputs if isinstance(u, Mapping) and "as_tensor" in u]
    if not user_inputs or len(tensors) != len(user_inputs):
        raise UnsupportedModel(
            detail=f"the program takes {len(user_inputs)} inputs ({str(user_inputs)[:200]}); the service's "
            "models take tensors: x of shape (N, *input_shape), or several (N, ...) tensors as positional or "
            "keyword arguments"
        )
    graph = graph_module.get("graph")
    if isinstance(graph, Mapping) and graph.get("custom_obj_values"):
        raise UnsupportedModel(detail="the graph holds custom objects; they are refused")
    return [u["as_tensor"] for u in tensors]


def _call_spec(graph_module: Mapping[str, Any], key: str) -> Any:
    """The parsed ``in_spec``/``out_spec`` of the program's top-level call (checked by :func:`check_treespecs`)."""
    calls = graph_module.get("module_call_graph")
    top = calls[0] if isinstance(calls, list) and calls and isinstance(calls[0], Mapping) else {}
    spec = top.get("signature", {}).get(key) if isinstance(top.get("signature"), Mapping) else None
    parsed = json.loads(spec) if isinstance(spec, str) else None
    return parsed[1] if isinstance(parsed, list) and len(parsed) == 2 else None


def _is_leaf(spec: Any) -> bool:
    return isinstance(spec, Mapping) and spec.get("type") is None and not spec.get("children_spec")


def input_names(graph_module: Mapping[str, Any], user_inputs: list[Any]) -> tuple[str, list[str]]:
    """How forward takes the user inputs: ("tuple", names) for positional arguments (the placeholders' names, which
    torch takes from forward's parameters) or ("mapping", keys) for keyword arguments, from the call's in_spec.

    Raises:
        UnsupportedModel: positional and keyword inputs mixed, or an input nested in a container.
    """
    spec = _call_spec(graph_module, "in_spec")
    children = spec.get("children_spec") if isinstance(spec, Mapping) else None
    if not isinstance(children, list) or len(children) != 2:
        raise UnsupportedModel(detail="the program's in_spec is not (args, kwargs); export it again")
    args, kwargs = children
    positional = args.get("children_spec") or [] if isinstance(args, Mapping) else []
    keyword = kwargs.get("children_spec") or [] if isinstance(kwargs, Mapping) else []
    if not all(_is_leaf(c) for c in [*positional, *keyword]) or len(positional) + len(keyword) != len(user_inputs):
        raise UnsupportedModel(
            detail="the program's inputs are nested in containers; export forward with tensors as its "
            "arguments (positional, or keyword: Client.register_module with a mapping input_shape does it)"
        )
    if positional and keyword:
        raise UnsupportedModel(
            detail=f"the program takes {len(positional)} positional and {len(keyword)} keyword tensors; "
            "export it with all inputs positional or all keyword"
        )
    if keyword:
        context = json.loads(kwargs.get("context") or "null")
        if not isinstance(context, list) or not all(isinstance(k, str) and k.isidentifier() for k in context):
            raise UnsupportedModel(detail=f"the program's keyword inputs {str(context)[:80]} are not identifiers")
        return "mapping", list(context)
    names = [str(u.get("name")) if isinstance(u, Mapping) else "" for u in user_inputs]
    return "tuple", names


def output_is_tensor(graph_module: Mapping[str, Any]) -> bool:
    """Whether forward returns one tensor (the out_spec is a leaf) rather than a container of them."""
    return _is_leaf(_call_spec(graph_module, "out_spec"))


def input_meta(graph_module: Mapping[str, Any], name: Any) -> tuple[tuple[int | None, ...], str]:
    values = graph_module.get("graph", {}).get("tensor_values", {})
    meta = values.get(name.get("name")) if isinstance(values, Mapping) and isinstance(name, Mapping) else None
    if not isinstance(meta, Mapping) or not isinstance(meta.get("sizes"), list) or not meta["sizes"]:
        raise UnsupportedModel(detail="the program's input has no shape with a batch dimension")
    sizes = [s.get("as_int") if isinstance(s, Mapping) else None for s in meta["sizes"]]
    dtype = {7: "float32", 5: "int64"}.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise UnsupportedModel(
            detail=f"the program's input has dtype code {meta.get('dtype')!r}; "
            "export with a float32 example (the service's dtype; kernels in float64 cast it) or int64 token ids"
        )
    return tuple(sizes[1:]), dtype


def embedding_rows(graph_module: Mapping[str, Any], user_input: Any, state_dict: dict[str, torch.Tensor]) -> int | None:
    """The rows of the smallest ``aten.embedding`` weight whose indices are ``user_input``, directly or through
    views (None: no embedding reads it)."""
    specs = graph_module["signature"]["input_specs"]
    weight_of = {
        spec["parameter"]["arg"]["name"]: spec["parameter"]["parameter_name"] for spec in specs if "parameter" in spec
    }
    rows = []
    origin: dict[Any, Any] = {}  # a view's output -> the tensor it views (GPT-2 reshapes ids before the embedding)
    for node in graph_module["graph"]["nodes"]:
        target = str(node.get("target", ""))
        arguments = {a.get("name"): a.get("arg", {}) for a in node.get("inputs", []) if isinstance(a, Mapping)}
        if target.split(".")[3:4] in (["view"], ["reshape"], ["_unsafe_view"]):
            source = arguments.get("self", {}).get("as_tensor", {}).get("name")
            for output in node.get("outputs") or ():
                if isinstance(output, Mapping) and "as_tensor" in output:
                    origin[output["as_tensor"].get("name")] = origin.get(source, source)
        if not target.startswith("torch.ops.aten.embedding."):
            continue
        indices = arguments.get("indices", {}).get("as_tensor", {}).get("name")
        indices = origin.get(indices, indices)
        weight = weight_of.get(arguments.get("weight", {}).get("as_tensor", {}).get("name"))
        if indices == user_input.get("name") and weight in state_dict:
            rows.append(int(state_dict[weight].shape[0]))
    return min(rows) if rows else None


def input_vocabulary(graph_module: Mapping[str, Any], user_input: Any, state_dict: dict[str, torch.Tensor]) -> int:
    """The rows of the smallest ``aten.embedding`` weight whose indices are the user input: the ids the model takes
    (the service checks them before computing, so an id out of range is a 422, not an error inside the graph)."""
    rows = embedding_rows(graph_module, user_input, state_dict)
    if rows is None:
        raise UnsupportedModel(
            detail="the program takes int64 token ids but no embedding reads them directly, so the service "
            "cannot check the ids' range; feed the ids into an nn.Embedding first"
        )
    return rows
