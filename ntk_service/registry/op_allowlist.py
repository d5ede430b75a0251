"""The operators an uploaded ``torch.export`` graph may call: pure ATen functions of tensors, by overload packet.

A node's target is the string the archive's graph JSON holds (``torch.ops.aten.linear.default``); it is checked
here, on the JSON, before torch's deserializer resolves any name. What the list holds and why:

- **only ``aten``** (and a few ``_operator`` functions of symbolic sizes). A custom op (``torch.ops.mylib.*``), an
  extension op (``#...``), a higher-order op (``torch.ops.higher_order.*``: cond, while_loop, wrap_with_set_grad,
  ...) or a call of any Python function is refused: they run code the service does not know, or subgraphs.
- **functional ops only**: in-place (``add_``), ``out=`` overloads and ``copy_``/``index_put_`` write into tensors,
  so a forward would change the stored weights; none is listed, and overloads named ``out`` are refused.
- **deterministic ops only**: random ops (``rand``, ``randn``, ``bernoulli``, ``normal``, ``native_dropout``,
  ``dropout`` with ``train=True``) would make Θ(x, x) a random variable; ``empty`` reads uninitialised memory.
- **no batch coupling**: ``batch_norm`` must have ``training=False`` (eval statistics), so one example's output
  does not depend on the others' (the NTK is per example pair).
- no I/O, printing, profiling, collectives or device/stream ops: nothing outside the tensors.

The list covers what ``torch.export.export(module.eval(), ...)`` emits (the training IR, which keeps ``linear``,
``conv2d``, ``batch_norm``, ``layer_norm``, ``scaled_dot_product_attention`` whole) for the layers of torch.nn a
research model is built from; an op missing from it is refused naming it, and adding a pure op is one line.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ntk_service.errors import UnsupportedModel

__all__ = ["ALLOWED_ATEN_OPS", "ALLOWED_PYTHON_OPS", "check_graph_ops"]

ALLOWED_ATEN_OPS: frozenset[str] = frozenset(
    {
        # linear algebra, convolution
        *("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "t", "conv1d", "conv2d", "conv3d"),
        *("convolution", "conv_transpose1d", "conv_transpose2d", "embedding", "scaled_dot_product_attention"),
        # normalisation (batch_norm: training=False checked below)
        *("batch_norm", "_native_batch_norm_legit_no_training", "layer_norm", "native_layer_norm", "group_norm"),
        *("native_group_norm", "rms_norm"),
        # elementwise
        *("add", "sub", "rsub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "log1p", "expm1"),
        *("abs", "sign", "sin", "cos", "tan", "reciprocal", "square", "erf", "clamp", "clamp_min", "clamp_max"),
        *("minimum", "maximum", "where", "relu", "gelu", "silu", "tanh", "sigmoid", "softplus", "elu"),
        *("leaky_relu", "hardtanh", "mish", "hardswish", "hardsigmoid", "threshold", "softmax", "log_softmax"),
        *("_softmax", "_log_softmax", "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and"),
        *("logical_or", "masked_fill", "lerp"),
        # boolean masks: Hugging Face attention masks combine causal and padding masks with ``&``
        *("__and__",),
        # reductions
        *("mean", "sum", "amax", "amin", "max", "min", "var", "std", "var_mean", "logsumexp", "prod"),
        *("linalg_vector_norm", "norm"),
        # shapes and indexing (views and copies; no writes)
        *("view", "reshape", "_unsafe_view", "flatten", "unflatten", "permute", "transpose", "unsqueeze"),
        *("squeeze", "expand", "contiguous", "clone", "alias", "detach", "cat", "stack", "split"),
        *("split_with_sizes", "chunk", "unbind", "slice", "select", "narrow", "index_select", "gather", "index"),
        *("repeat", "tile", "flip", "roll", "pad", "constant_pad_nd", "type_as", "to", "_to_copy"),
        *("lift_fresh_copy", "sym_size", "sym_numel", "sym_stride", "_assert_tensor_metadata", "_assert_scalar"),
        *("sym_constrain_range_for_size",),
        # pooling
        *("max_pool1d", "max_pool2d", "max_pool2d_with_indices", "avg_pool1d", "avg_pool2d"),
        *("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool2d"),
        # constants
        *("ones", "zeros", "full", "arange", "ones_like", "zeros_like", "full_like", "scalar_tensor"),
        # ones of another tensor's dtype/device: BERT's default token-type and position masks (pure: no input
        # value is read)
        *("new_ones",),
        # dropout: train=False checked below (the identity)
        *("dropout",),
    }
)
"""ATen overload packets a graph may call (``torch.ops.aten.<packet>.<overload>``): module docstring."""

ALLOWED_PYTHON_OPS: frozenset[str] = frozenset(
    {"_operator.add", "_operator.sub", "_operator.mul", "_operator.floordiv", "_operator.truediv", "_operator.neg"}
    | {"_operator.getitem"}
)
"""Python functions a graph may call: arithmetic of symbolic sizes, and ``getitem`` of a multi-output op."""

_FALSE_ARGUMENTS: dict[str, str] = {"batch_norm": "training", "dropout": "train"}

_FRESH_ONLY: dict[str, str] = {"detach_": "lift_fresh_copy"}
"""In-place packets allowed only on the output of the named packet: ``torch.tensor(...)`` inside forward exports as
``lift_fresh_copy`` (a new tensor) then ``detach_`` (autograd metadata only, no data written; GPT-2 does it). On a
parameter or an input ``detach_`` would cut the gradient the kernel needs, so anywhere else it is refused."""
_FRESH_SOURCES = frozenset(_FRESH_ONLY.values())
"""Packets whose named boolean argument must be false (eval semantics), and that argument."""

_HINTS = {
    "higher_order": "control flow (torch.cond, loops traced as while_loop) or torch.no_grad regions inside forward "
    "become higher-order ops; write the forward without them",
    "dropout": "export the module in eval mode (module.eval())",
    "batch_norm": "export the module in eval mode (module.eval()) so BatchNorm uses its running statistics",
}


def _nodes(tree: Any) -> Iterator[Mapping[str, Any]]:
    """Every node of every graph in the JSON (subgraphs of higher-order ops included), depth first."""
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            nodes = item.get("nodes")
            if isinstance(nodes, list):
                yield from (node for node in nodes if isinstance(node, Mapping))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _bool_argument(node: Mapping[str, Any], name: str) -> bool | None:
    for argument in node.get("inputs") or ():
        if isinstance(argument, Mapping) and argument.get("name") == name:
            value = argument.get("arg")
            if isinstance(value, Mapping) and isinstance(value.get("as_bool"), bool):
                return bool(value["as_bool"])
            return None
    return None


def _refuse(target: str, why: str, hint: str) -> UnsupportedModel:
    return UnsupportedModel(detail=f"the graph calls {target}, {why}; {hint}")


def check_graph_ops(graph_module: Any) -> set[str]:
    """Check every node target of a serialized graph (the JSON of ``models/<name>.json``'s ``graph_module``).

    Args:
        graph_module (Any): the parsed JSON object, before deserialization.

    Returns:
        The set of targets it calls (for the model record and tests).

    Raises:
        UnsupportedModel: the first node whose target is not allowed (named, with why and what to do), or a
            ``batch_norm``/``dropout`` in training mode.
    """
    targets: set[str] = set()
    fresh = {
        output.get("as_tensor", {}).get("name")
        for node in _nodes(graph_module)
        if str(node.get("target", "")).split(".")[3:4] and str(node.get("target")).split(".")[3] in _FRESH_SOURCES
        for output in node.get("outputs") or ()
        if isinstance(output, Mapping)
    }
    for node in _nodes(graph_module):
        target = node.get("target")
        if not isinstance(target, str):
            raise UnsupportedModel(detail=f"a graph node has target {target!r}, not an operator name")
        targets.add(target)
        if target in ALLOWED_PYTHON_OPS:
            continue
        parts = target.split(".")
        if len(parts) == 5 and parts[:3] == ["torch", "ops", "aten"] and parts[3] in _FRESH_ONLY:
            source = next(
                (
                    a.get("arg", {}).get("as_tensor", {}).get("name")
                    for a in node.get("inputs") or ()
                    if isinstance(a, Mapping) and a.get("name") == "self"
                ),
                None,
            )
            if source is None or source not in fresh:
                raise _refuse(
                    target,
                    f"an in-place operator, allowed only on a fresh {_FRESH_ONLY[parts[3]]} (torch.tensor in forward)",
                    "use the out-of-place form (detach) or none: the engine detaches what it needs",
                )
            continue
        if len(parts) == 5 and parts[:3] == ["torch", "ops", "aten"] and parts[3] in ALLOWED_ATEN_OPS:
            packet, overload = parts[3], parts[4]
            if overload == "out" or overload.endswith("_out"):
                raise _refuse(target, "an out= overload that writes into a tensor", "export again")
            if packet in _FALSE_ARGUMENTS and _bool_argument(node, _FALSE_ARGUMENTS[packet]) is not False:
                raise _refuse(target, f"with {_FALSE_ARGUMENTS[packet]}=True (training mode)", _HINTS[packet])
            continue
        namespace = parts[2] if len(parts) > 2 and parts[:2] == ["torch", "ops"] else ""
        if namespace == "aten":
            why = "an ATen operator outside the service's allow-list of pure, deterministic tensor functions"
            hint = "in-place, random and I/O operators are refused; write the forward with out-of-place ops"
        elif namespace == "higher_order":
            why, hint = "a higher-order operator", _HINTS["higher_order"]
        elif namespace:
            why = f"a custom operator (namespace {namespace!r}), whose code the service does not have"
            hint = "write the forward with torch operators only"
        else:
            why = "which is not a torch operator"
            hint = "export with torch.export.export, which records ATen operators only"
        raise _refuse(target, why, hint + " (docs/operations.md lists the allowed operators)")
    return targets
