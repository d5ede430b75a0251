"""A zip archive from a client, read in memory with every entry checked: no name it chose reaches the disk.

    >>> entries = read_archive(data, limits=ArchiveLimits(), operation="register 'm'")
    >>> entries.read("models/model.json")   # bytes of archive/models/model.json, exactly its declared size

What is checked before any entry is read (NOTE [archive threat model] in exported.py says why each one):

- the bytes are a zip file (else MalformedRequest, 400);
- at most ``max_entries`` entries; every name relative (no leading ``/`` or ``\\``, no drive letter), with no
  ``..`` or empty component, no backslash or NUL, all under one root folder, none twice;
- each entry's declared size at most ``max_entry_bytes`` and their sum at most ``max_total_bytes``; an entry that
  declares more than ``max_ratio`` times its compressed size is a zip bomb (all three PayloadTooLarge, 413);
- only stored or deflated entries, none encrypted.

Reading an entry decompresses at most its declared size (zipfile stops there) and checks that exactly that many
bytes came and that the CRC matches, so a header that lies about the size is refused (InvalidInput, 422). The
entries record which of them were read (``names_read``): what is stored of an upload is those and nothing else
(program_archive.py).
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass, field

from ntk_service.errors import InvalidInput, MalformedRequest, PayloadTooLarge

__all__ = ["ArchiveEntries", "ArchiveLimits", "read_archive"]

_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on an uploaded archive, checked on its central directory before anything is decompressed.

    Attributes:
        max_entries: most entries. A torch.export archive has about 10 plus one per weight storage. Default: 20,000.
        max_entry_bytes: largest uncompressed entry. Default: 1 GiB (a 250M-parameter float32 tensor).
        max_total_bytes: largest uncompressed sum. Default: 2 GiB; the upload's own body limit usually binds first.
        max_ratio: largest uncompressed / compressed size of one entry above 1 MiB; deflate reaches about 1000 on
            zeros, real weights about 1.1. Default: 100.
    """

    max_entries: int = 20_000
    max_entry_bytes: int = 1 << 30
    max_total_bytes: int = 2 << 30
    max_ratio: float = 100.0


@dataclass(frozen=True)
class ArchiveEntries:
    """The checked entries of one archive, by name relative to its root folder (``models/model.json``)."""

    root: str
    infos: dict[str, zipfile.ZipInfo]
    _zip: zipfile.ZipFile
    operation: str
    _read: dict[str, None] = field(default_factory=dict, compare=False, repr=False)

    def names(self) -> list[str]:
        """Entry names relative to the root, in archive order."""
        return list(self.infos)

    def names_read(self) -> list[str]:
        """The entries ``read`` has returned so far, in the order they were first read."""
        return list(self._read)

    def size(self, name: str) -> int:
        """The declared (and, once read, verified) uncompressed size of an entry, in bytes."""
        return self.infos[name].file_size

    def read(self, name: str) -> bytes:
        """The bytes of one entry.

        Raises:
            InvalidInput: no such entry, or its bytes do not match its declared size or CRC.
        """
        info = self.infos.get(name)
        if info is None:
            raise InvalidInput(f"{self.operation}: the archive has no entry {self.root}/{name}")
        try:
            with self._zip.open(info) as stream:
                data = stream.read(info.file_size + 1)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:  # bad CRC, truncated or corrupt stream
            raise InvalidInput(
                f"{self.operation}: entry {info.filename} of the archive is corrupt ({exc}); write it again with "
                "torch.export.save"
            ) from exc
        if len(data) != info.file_size:
            raise InvalidInput(
                f"{self.operation}: entry {info.filename} declares {info.file_size} bytes but holds {len(data)}; "
                "write the archive again with torch.export.save"
            )
        self._read[name] = None
        return data


def _check_name(name: str, operation: str) -> list[str]:
    parts = name.split("/")
    bad = (
        name.startswith(("/", "\\"))
        or _DRIVE.match(name) is not None
        or "\\" in name
        or "\x00" in name
        or any(part in ("", ".", "..") for part in parts[:-1])
        or parts[-1] in (".", "..")
    )
    if bad:
        raise InvalidInput(
            f"{operation}: the archive has an entry named {name!r}; entry names must be relative paths without "
            "'..', '.', empty parts, backslashes or a drive (the service extracts nothing by name, and refuses "
            "archives that try); write the archive with torch.export.save"
        )
    return parts


def read_archive(data: bytes, *, limits: ArchiveLimits, operation: str) -> ArchiveEntries:
    """Open a zip archive held in memory and check its names and sizes (module docstring) before reading any entry.

    Args:
        data (bytes): the archive as uploaded.
        limits (ArchiveLimits): the bounds.
        operation (str): prefix of error messages, e.g. "register 'm'".

    Returns:
        ArchiveEntries: the file entries (directories dropped) by name relative to the archive's one root folder.

    Raises:
        MalformedRequest: not a zip file.
        InvalidInput: a name that is absolute or climbs out ('..'), entries not under one root, a duplicate,
            an encrypted entry or a compression other than stored/deflate.
        PayloadTooLarge: too many entries, an entry or the sum too large, or a compression ratio of a zip bomb.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise MalformedRequest(
            f"{operation}: the upload is not a zip archive ({exc}); send the file torch.export.save wrote"
        ) from exc
    infos = archive.infolist()
    if len(infos) > limits.max_entries:
        raise PayloadTooLarge(
            f"{operation}: the archive has {len(infos):,} entries, more than the limit of {limits.max_entries:,}"
        )
    roots: set[str] = set()
    entries: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in infos:
        parts = _check_name(info.filename, operation)
        if info.is_dir():
            continue
        if len(parts) < 2:
            raise InvalidInput(
                f"{operation}: entry {info.filename!r} is not under a root folder; a torch.export archive keeps "
                "every entry under one folder (archive/...)"
            )
        roots.add(parts[0])
        if info.flag_bits & 0x1:
            raise InvalidInput(f"{operation}: entry {info.filename} is encrypted; send an unencrypted archive")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise InvalidInput(
                f"{operation}: entry {info.filename} uses compression method {info.compress_type}; only stored "
                "and deflate are read"
            )
        if info.file_size > limits.max_entry_bytes:
            raise PayloadTooLarge(
                f"{operation}: entry {info.filename} declares {info.file_size:,} bytes uncompressed, more than the "
                f"limit of {limits.max_entry_bytes:,}"
            )
        ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size > 1 << 20 and ratio > limits.max_ratio:
            raise PayloadTooLarge(
                f"{operation}: entry {info.filename} expands {info.compress_size:,} compressed bytes to "
                f"{info.file_size:,} (ratio {ratio:,.0f}, limit {limits.max_ratio:,.0f}): refused as a zip bomb; "
                "torch.export.save stores weights uncompressed"
            )
        total += info.file_size
        if total > limits.max_total_bytes:
            raise PayloadTooLarge(
                f"{operation}: the archive's entries declare more than {limits.max_total_bytes:,} bytes "
                "uncompressed in all, the limit"
            )
        name = "/".join(parts[1:])
        if name in entries:
            raise InvalidInput(f"{operation}: the archive has entry {info.filename} twice")
        entries[name] = info
    if len(roots) != 1:
        found = ", ".join(sorted(roots)) or "none"
        raise InvalidInput(
            f"{operation}: the archive's entries must be under one root folder, found {found}; send the file "
            "torch.export.save wrote"
        )
    return ArchiveEntries(root=roots.pop(), infos=entries, _zip=archive, operation=operation)
