"""What the service keeps of an uploaded torch.export archive: the entries its checked loader read, nothing else.

    >>> program = load_exported(upload, operation="register 'm'")
    >>> stored = checked_archive(program)          # bytes of a torch.export archive, safe for torch.export.load

NOTE [stored archives]
An upload may carry entries the checked loader never reads: pickled sample inputs, ``use_pickle`` payloads no config
names, ``extra/`` files, AOTInductor libraries, a ``guards_code`` in models/model.json. The server never runs
them, but ``torch.export.load`` on the stored file would (it unpickles the sample inputs, loads AOTInductor
shared objects, and ``.module()`` execs the guards). Refusing unread entries instead would turn away what
``torch.export.save`` itself writes (the sample inputs are always there, pickled), so the service rewrites: the
stored archive is written by torch's own archive writer from

- ``models/model.json`` exactly as torch's deserializer was given it (checked, node metadata and ``guards_code``
  emptied, re-serialized from torch's schema, so keys torch does not read are gone);
- the weights and constants configs and payloads the loader read, byte for byte (every one checked: raw tensors,
  no ``use_pickle``);
- what the writer adds itself (``archive_format``, ``archive_version``, ``.data/version``, ``byteorder``,
  ``.data/serialization_id``) and an empty sample-inputs entry (torch reads "no sample inputs" from it).

So plain ``torch.export.load`` of a stored file unpickles nothing and executes nothing beyond the checked graph,
the checked loader reads it back to the same program, and the rewrite is deterministic (identical uploads, one
file).
"""

from __future__ import annotations

import io

from torch.export.pt2_archive._package import PT2ArchiveWriter

from ntk_service.registry.exported import ExportedProgram

__all__ = ["PROGRAM_JSON", "checked_archive"]

PROGRAM_JSON = "models/model.json"
"""The one program of an archive the loader accepts."""

_SAMPLE_INPUTS = "data/sample_inputs/model.pt"


def checked_archive(program: ExportedProgram) -> bytes:
    """The archive to store for a program the checked loader loaded (NOTE [stored archives]).

    Args:
        program (ExportedProgram): the result of ``load_exported`` (its ``source`` and ``program_json``).

    Returns:
        A ``torch.export.save``-format archive (root ``archive/``) holding only the loader's reads, the validated
        program JSON in place of the uploaded one, and the entries torch's writer adds itself.

    Raises:
        ValueError: the program does not carry its source archive (not from ``load_exported``).
    """
    if program.source is None or not program.program_json:
        raise ValueError("checked_archive: the program carries no source archive; load it with load_exported")
    buffer = io.BytesIO()
    with PT2ArchiveWriter(buffer) as writer:
        writer.write_bytes(PROGRAM_JSON, program.program_json)
        for name in program.source.names_read():
            if name not in (PROGRAM_JSON, "archive_format"):  # the writer writes the format itself
                writer.write_bytes(name, program.source.read(name))
        writer.write_bytes(_SAMPLE_INPUTS, b"")
    return buffer.getvalue()
