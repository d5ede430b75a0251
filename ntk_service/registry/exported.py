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
3. (payloads.py) weights and constants only from raw tensor payloads: every entry marked ``use_pickle`` and every
   custom or opaque object is refused; dtype, layout (strided), device (cpu), sizes, strides and offset of each
   tensor are checked against its payload's byte count before a tensor is made of it (``torch.frombuffer`` +
   ``as_strided``);
4. (program_checks.py) the graph JSON, parsed with ``json`` (bounded size): every node target against the
   allow-list (op_allowlist.py); every symbolic-size string against a grammar of symbols, integers and arithmetic
   (no names but symbols and the sympy functions torch writes, no dots, quotes, brackets or ``__``); every tree
   spec against plain containers; the signature to parameters, buffers, tensor constants and one tensor input, one
   tensor output and no mutation, custom object or effect token; every parameter, buffer and submodule name a
   dotted identifier and every forward argument an identifier (torch.fx pastes them unescaped into the source it
   execs); ``guards_code`` is emptied (the service checks input shapes itself) and node metadata (stack traces,
   which fx writes into that source as comments) is dropped, after the root module's class name is read from it as
   a string that must be a dotted identifier (shown to users, never imported);
5. only then torch's own deserializer (``ExportedProgramDeserializer().deserialize``) on the validated JSON, with
   the tensors from step 3 and no sample inputs, under a lock (it keeps a process-wide "current deserializer");
   the graph module's forward hooks (torch's input check) are dropped and parameters sharing one storage (tied
   weights) made one object again: both torch's objects, nothing of the archive's runs.
6. what is stored is only what steps 2-5 read (``source``, ``program_json``): NOTE [stored archives] in
   program_archive.py.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._export.serde import schema
from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass, _to_json_bytes

from ntk_service.errors import InvalidInput
from ntk_service.registry.archive import ArchiveEntries, ArchiveLimits, read_archive
from ntk_service.registry.op_allowlist import check_graph_ops
from ntk_service.registry.payloads import MAX_JSON_BYTES, read_json, read_tensors
from ntk_service.registry.program_checks import (
    check_expressions,
    check_names,
    check_signature,
    check_treespecs,
    embedding_rows,
    input_meta,
    input_names,
    input_vocabulary,
    output_is_tensor,
    strip_metadata,
)
from ntk_service.registry.records import InputLeaf, InputSpec

__all__ = [
    "EXPORTED_FAMILY",
    "ExportedProgram",
    "exported_architecture",
    "exported_inputs",
    "load_exported",
    "probe_output_dim",
]

EXPORTED_FAMILY = "exported"
"""The ``family`` of a model registered as a torch.export program; its architecture names the stored archive."""

_MODEL = "model"
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
        inputs: several user inputs (positional or keyword): their names, shapes, dtypes and vocabularies; None
            for one positional tensor (then input_shape/input_dtype/vocab_size describe it). With inputs,
            input_shape and input_dtype are the first input's.
        returns_tensor: forward returns one tensor; False: a container of tensors (a dict: ``output=`` selects).
        source: the checked archive it was read from; ``source.names_read()`` are the entries the loader read.
        program_json: models/model.json as torch's deserializer was given it (checked, metadata and guards
            emptied, re-serialized from torch's schema). With ``source``, all a stored copy may hold
            (program_archive.py).
        class_name: the exported module's class (its name only, e.g. "ResidualMlp"), as the archive's node
            metadata records it; None when it records none (read as a string, never imported).
    """

    module: nn.Module
    state_dict: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor]
    targets: frozenset[str]
    input_shape: tuple[int | None, ...]
    input_dtype: str
    vocab_size: int | None = None
    inputs: InputSpec | None = None
    returns_tensor: bool = True
    source: ArchiveEntries | None = None
    program_json: bytes = b""
    class_name: str | None = None


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
    program = read_json(entries, f"models/{_MODEL}.json", MAX_JSON_BYTES)
    graph_module = program.get("graph_module") if isinstance(program, Mapping) else None
    if not isinstance(graph_module, Mapping):
        raise InvalidInput(f"{operation}: models/{_MODEL}.json has no graph_module")
    targets = check_graph_ops(graph_module, operation=operation)
    check_expressions(program, operation)
    check_treespecs(program, operation)
    class_name = _class_name(graph_module)
    strip_metadata(program)
    program["guards_code"] = []  # exec'd by ExportedProgram.module(); the service checks input shapes itself
    user_inputs = check_signature(graph_module, operation)
    kind, names = input_names(graph_module, user_inputs, operation)
    metas = [input_meta(graph_module, user_input, operation) for user_input in user_inputs]
    input_shape, input_dtype = metas[0]
    state_dict, params = read_tensors(entries, "weights")
    constants, _ = read_tensors(entries, "constants")
    check_names(program, [*state_dict, *constants], operation)
    if max_params is not None:
        count = sum(state_dict[name].numel() for name in params)
        if count > max_params:
            raise InvalidInput(
                f"{operation}: the program has {count:,} parameters, more than the server's limit of {max_params:,}"
            )
    inputs: InputSpec | None = None
    if kind == "tuple" and len(user_inputs) == 1:  # one unnamed input: exactly as before named inputs existed
        vocab_size = (
            input_vocabulary(graph_module, user_inputs[0], state_dict, operation) if input_dtype == "int64" else None
        )
    else:  # int64 inputs no embedding reads (masks, positions) are data without a range to check
        leaves = tuple(
            InputLeaf(
                name,
                _static_shape(shape, name, operation),
                dtype,
                embedding_rows(graph_module, user_input, state_dict) if dtype == "int64" else None,
            )
            for name, user_input, (shape, dtype) in zip(names, user_inputs, metas, strict=True)
        )
        inputs, vocab_size = InputSpec(kind, leaves), leaves[0].vocab_size
    module, program_json = _deserialize(dict(program), state_dict, constants, params, operation)
    return ExportedProgram(
        module,
        state_dict,
        constants,
        frozenset(targets),
        input_shape,
        input_dtype,
        vocab_size,
        inputs,
        output_is_tensor(graph_module),
        entries,
        program_json,
        class_name,
    )


_CLASS_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}(\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,32}$")


def _class_name(graph_module: Mapping[str, Any]) -> str | None:
    """The root module's class name from a node's ``nn_module_stack`` metadata ("key,path,type;..." with an
    empty path for the root): the type's last dotted part, if the type is a dotted identifier. A string only."""
    graph = graph_module.get("graph")
    for node in graph.get("nodes", ()) if isinstance(graph, Mapping) else ():
        metadata = node.get("metadata") if isinstance(node, Mapping) else None
        stack = metadata.get("nn_module_stack") if isinstance(metadata, Mapping) else None
        if not isinstance(stack, str):
            continue
        for entry in stack.split(";"):
            parts = entry.split(",")
            if len(parts) == 3 and parts[1] == "" and _CLASS_PATH.fullmatch(parts[2]):
                return parts[2].rpartition(".")[2]
    return None


def _static_shape(shape: tuple[int | None, ...], name: str, operation: str) -> tuple[int, ...]:
    if any(n is None for n in shape):
        raise InvalidInput(
            f"{operation}: the program's input {name!r} has per-example shape {shape} with dynamic sizes besides the "
            "batch dimension; export with dynamic_shapes marking only dimension 0 (Client.register_module does)"
        )
    return tuple(int(n) for n in shape)  # type: ignore[arg-type]


def _deserialize(
    program: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    constants: dict[str, torch.Tensor],
    params: set[str],
    operation: str,
) -> tuple[nn.Module, bytes]:
    weights = {k: nn.Parameter(v) if k in params else v for k, v in state_dict.items()}
    try:
        serialized = _dict_to_dataclass(schema.ExportedProgram, program)  # type: ignore[no-untyped-call]
        program_json = _to_json_bytes(serialized)  # exactly the fields torch reads, before it builds anything
        with _DESERIALIZE_LOCK:
            exported = ExportedProgramDeserializer().deserialize(serialized, weights, dict(constants), None)
        module = exported.module()
        # .module() sets instance methods train/eval that raise; the graph is already eval (batch_norm and dropout
        # with training=False are checked in op_allowlist.py), so the flags they flip change nothing: drop them so
        # the engine's private eval copy works as on any module.
        for name in ("train", "eval"):
            vars(module).pop(name, None)
        _without_hooks(module)
        _tie_aliases(module)
        _sizes_as_methods(module)
    except Exception as exc:  # torch's own checks of the (already validated) JSON: the upload is what is wrong
        raise InvalidInput(
            f"{operation}: torch could not load the program: {str(exc).strip()[:500] or type(exc).__name__}; "
            "write it with torch.export.save from the same torch version as the server's "
            f"({torch.__version__})"
        ) from exc
    return module, program_json


def _without_hooks(module: nn.Module) -> None:
    """Drop the forward hooks ``ExportedProgram.module()`` registers: an input-constraint check (the service checks
    input shapes itself, as for ``guards_code``) and a pair that enables ``nn.Module`` graph inputs (a program
    here takes tensors only). Torch's own code, nothing of the archive's; without them the graph module is a plain
    module whose forward is its graph, which the structured engine's closed-form chain may read (NOTE
    [sequential chains] in kernels/structured/chain.py: it refuses modules with hooks)."""
    for hooks in (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._forward_hooks_with_kwargs,
        module._forward_hooks_always_called,
        module._forward_pre_hooks_with_kwargs,
    ):
        hooks.clear()


def _tie_aliases(module: nn.Module) -> None:
    """One parameter object per storage: the program holds a tied weight (a Hugging Face model's input and output
    embeddings) as one parameter per name over one storage, the exported module as one parameter under several
    names. Made one object again (the first name ``named_modules`` reaches keeps it), ``named_parameters()`` lists
    it once under the module's own name, so selecting it by name selects every use of it, as on the module."""
    kept: dict[tuple[object, ...], nn.Parameter] = {}
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is None:
                continue
            key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), p.stride(), p.dtype)
            first = kept.setdefault(key, p)
            if first is not p:
                owner._parameters[name] = first


def example_batch(program: ExportedProgram, n: int = 2) -> Any:
    """A batch of ``n`` placeholder examples the program takes: zeros, and ones for int64 inputs that are not
    token ids (a mask of zeros would mask everything). A tensor, a tuple or a dict as forward takes them."""
    if program.inputs is None:
        dtype = {"float32": torch.float32, "int64": torch.int64}[program.input_dtype]
        return torch.zeros((n, *(int(d or 0) for d in program.input_shape)), dtype=dtype)
    leaves = {
        leaf.name: (torch.zeros if leaf.dtype == "float32" or leaf.vocab_size is not None else torch.ones)(
            (n, *leaf.shape), dtype={"float32": torch.float32, "int64": torch.int64}[leaf.dtype]
        )
        for leaf in program.inputs.leaves
    }
    return leaves if program.inputs.kind == "mapping" else tuple(leaves.values())


def _call(module: nn.Module, x: Any) -> Any:
    if isinstance(x, dict):
        return module(**x)
    return module(*x) if isinstance(x, tuple) else module(x)


def _size(tensor: torch.Tensor, dim: int) -> int:
    """``tensor.size(dim)``: what ``aten.sym_size.int`` computes, and which vmap batches (NOTE [sizes under vmap])."""
    return tensor.size(dim)


def _float_dtype(tensor: torch.Tensor, dtype: Any) -> Any:
    """float32 (the dtype the program was traced in) means "the model's float dtype": a floating tensor keeps its
    own (float64 when the kernel is computed in float64); anything else is cast as written."""
    return tensor.dtype if dtype == torch.float32 and tensor.is_floating_point() else dtype


def _to_dtype_layout(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``aten.to.dtype_layout`` under NOTE [sizes under vmap]'s float rule (:func:`_float_dtype`)."""
    if "dtype" in kwargs:
        kwargs["dtype"] = _float_dtype(tensor, kwargs["dtype"])
    return torch.ops.aten.to.dtype_layout(tensor, **kwargs)  # type: ignore[no-any-return]


def _to_copy(tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``aten._to_copy`` under the same rule."""
    if "dtype" in kwargs:
        kwargs["dtype"] = _float_dtype(tensor, kwargs["dtype"])
    return torch.ops.aten._to_copy.default(tensor, **kwargs)  # type: ignore[no-any-return]


def _to_dtype(tensor: torch.Tensor, dtype: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``aten.to.dtype`` under the same rule."""
    return torch.ops.aten.to.dtype(tensor, _float_dtype(tensor, dtype), *args, **kwargs)  # type: ignore[no-any-return]


_REWRITES: dict[Any, Any] = {
    torch.ops.aten.sym_size.int: _size,
    # the same function by its public name, which the engine's math_attention mode reroutes to the composite math
    # kernel (the CPU flash kernel has no vmap rule and no forward AD)
    torch.ops.aten.scaled_dot_product_attention.default: torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.to.dtype_layout: _to_dtype_layout,
    torch.ops.aten._to_copy.default: _to_copy,
    torch.ops.aten.to.dtype: _to_dtype,
}
"""Graph targets replaced after loading (NOTE [sizes under vmap]): each computes what the op computed when traced."""


def _sizes_as_methods(module: nn.Module) -> None:
    """NOTE [sizes under vmap]: a graph exported with a dynamic batch reads sizes with ``aten.sym_size.int`` when
    forward asks for them (Hugging Face models do: ``batch_size, seq_length = input_ids.shape``), and that op has no
    vmap batching rule, so every batched implementation would refuse the model. ``Tensor.size`` gives the same int
    and works under vmap (the per-example size); the graph calls it instead. Our own function, not the archive's.
    The dtype checks export records (``_assert_tensor_metadata``: float32) are dropped so float64 kernels run, and
    ``aten.scaled_dot_product_attention`` is called as ``F.scaled_dot_product_attention`` (the same function),
    which ``kernels.math_attention`` puts on its math path as for any eager model. Casts to float32 of floating
    tensors (export writes ``x.to(other.dtype)`` with the traced dtype: GPT-2 casts its position embeddings so) keep
    the tensor's own float dtype: no-ops when traced, and float64 kernels stay float64 throughout."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return
    changed = False
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _REWRITES:
            node.target, changed = _REWRITES[node.target], True
        elif node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            # an export-time check of the example's dtype (float32): kernels in float64 run the same graph on
            # float64 tensors; the service checks inputs itself
            if not node.users:
                graph.erase_node(node)
                changed = True
    if changed:
        module.recompile()  # type: ignore[operator]


def probe_output_dim(program: ExportedProgram, *, operation: str) -> int:
    """Outputs per example k = prod(out) of a loaded program, from one forward pass on a batch of two placeholder
    examples (:func:`example_batch`). For a program returning a dict, k of its first floating tensor (a request
    selects with ``output``; the record's ``architecture["outputs"]`` lists every entry's shape).

    Raises:
        InvalidInput: a dynamic dimension other than the batch, a failing forward pass, or no (2, ...) floating
            output.
    """
    return _probe(program, operation=operation)[0]


def _probe(program: ExportedProgram, *, operation: str) -> tuple[int, dict[str, list[int]] | None]:
    if any(n is None for n in program.input_shape):
        raise InvalidInput(
            f"{operation}: the program's input {program.input_shape} has dynamic sizes besides the batch "
            "dimension; export with dynamic_shapes marking only dimension 0 (Client.register_module does)"
        )
    x = example_batch(program)
    shapes = (
        tuple(x.shape)
        if isinstance(x, torch.Tensor)
        else {
            k: tuple(v.shape)
            for k, v in dict(
                x if isinstance(x, dict) else zip(program.inputs.names, x, strict=True)  # type: ignore[union-attr]
            ).items()
        }
    )
    try:
        with torch.no_grad():
            out = _call(program.module, x)
    except Exception as exc:  # the program is the client's: its failure is the client's error
        raise InvalidInput(
            f"{operation}: the program fails on a batch of shape {shapes}: {type(exc).__name__}: {exc}; "
            "export it with a dynamic batch dimension (dynamic_shapes={0: torch.export.Dim('batch')})"
        ) from exc

    def batched(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == 2 and t.is_floating_point()

    if isinstance(out, Mapping) and not program.returns_tensor:
        entries = {str(key): value for key, value in out.items() if batched(value) and value[0].numel()}
        if not entries:
            raise InvalidInput(
                f"{operation}: the program returns a dict without a floating (N, *out) tensor "
                f"(keys {sorted(map(str, out))[:8]}); return the logits"
            )
        first = next(iter(entries.values()))
        return int(first[0].numel()), {key: list(value.shape[1:]) for key, value in entries.items()}
    if not batched(out) or out[0].numel() == 0:
        got = type(out).__name__ + (f" {tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else "")
        raise InvalidInput(
            f"{operation}: the program must map (N, *input) to a floating (N, *out) or a dict of them, got {got}"
        )
    return int(out[0].numel()), None


def exported_inputs(architecture: dict[str, Any]) -> InputSpec | None:
    """The InputSpec an ``exported`` architecture records (None: one unnamed input, or another family)."""
    inputs = architecture.get("inputs") if architecture.get("family") == EXPORTED_FAMILY else None
    return None if inputs is None else InputSpec.from_public(inputs)


def exported_architecture(program: ExportedProgram, sha256: str, *, operation: str = "register") -> dict[str, Any]:
    """The stored architecture of an exported model: the archive's sha256 (the program is fixed per model), its
    input(s), the operators it calls and, for a dict output, each entry's per-example shape (``outputs``)."""
    outputs = None if program.returns_tensor else _probe(program, operation=operation)[1]
    return {
        "family": EXPORTED_FAMILY,
        "program_sha256": sha256,
        "input_shape": [int(n) for n in program.input_shape],  # type: ignore[arg-type]
        "input_dtype": program.input_dtype,
        "operators": sorted(program.targets),
        **({} if program.class_name is None else {"class_name": program.class_name}),
        **({} if program.vocab_size is None else {"vocab_size": program.vocab_size}),
        **({} if program.inputs is None else {"inputs": program.inputs.to_public()}),
        **({} if outputs is None else {"outputs": outputs}),
    }
