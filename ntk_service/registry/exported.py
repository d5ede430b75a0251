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
   which fx writes into that source as comments) is dropped;
5. only then torch's own deserializer (``ExportedProgramDeserializer().deserialize``) on the validated JSON, with
   the tensors from step 3 and no sample inputs, under a lock (it keeps a process-wide "current deserializer").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._export.serde import schema
from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass

from ntk_service.errors import InvalidInput
from ntk_service.registry.archive import ArchiveLimits, read_archive
from ntk_service.registry.op_allowlist import check_graph_ops
from ntk_service.registry.payloads import MAX_JSON_BYTES, read_json, read_tensors
from ntk_service.registry.program_checks import (
    check_expressions,
    check_names,
    check_signature,
    check_treespecs,
    input_meta,
    input_vocabulary,
    strip_metadata,
)

__all__ = ["EXPORTED_FAMILY", "ExportedProgram", "exported_architecture", "load_exported", "probe_output_dim"]

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
    """

    module: nn.Module
    state_dict: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor]
    targets: frozenset[str]
    input_shape: tuple[int | None, ...]
    input_dtype: str
    vocab_size: int | None = None


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
    strip_metadata(program)
    user_input = check_signature(graph_module, operation)
    input_shape, input_dtype = input_meta(graph_module, user_input, operation)
    state_dict, params = read_tensors(entries, "weights")
    constants, _ = read_tensors(entries, "constants")
    check_names(program, [*state_dict, *constants], operation)
    if max_params is not None:
        count = sum(state_dict[name].numel() for name in params)
        if count > max_params:
            raise InvalidInput(
                f"{operation}: the program has {count:,} parameters, more than the server's limit of {max_params:,}"
            )
    vocab_size = input_vocabulary(graph_module, user_input, state_dict, operation) if input_dtype == "int64" else None
    module = _deserialize(dict(program), state_dict, constants, params, operation)
    return ExportedProgram(module, state_dict, constants, frozenset(targets), input_shape, input_dtype, vocab_size)


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
