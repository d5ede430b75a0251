"""A job's result group as one zip file: the same Zarr group as on the server's disk, for a user on another machine.

    >>> for piece in zip_stream(Path("data/jobs/<id>/result.zarr")):   # doctest: +SKIP
    ...     sink.write(piece)
    >>> xr.open_zarr(zarr.storage.ZipStore("result.zarr.zip", mode="r"))  # doctest: +SKIP

The archive holds every regular file of the group under its name inside the group (``zarr.json``, ``theta/c/0/1``,
``tiles/done/c/3``, ...), stored uncompressed (kernels do not compress, and Zarr's ``ZipStore`` reads stored
entries in place), so ``zarr.storage.ZipStore`` opens it as the group itself: dimension names, attributes and the
tile ledger included. Only files the server wrote are in it: the group's own folder, walked without following
links; nothing a client named. It is written as it is sent (a zip needs no seeking: each entry's sizes follow it),
one read block at a time, so the server holds at most ``block_bytes`` of it.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ZIP_MEDIA", "result_files", "zip_stream"]

ZIP_MEDIA = "application/zip"

_TIMESTAMP = (1980, 1, 1, 0, 0, 0)
"""Every entry's date: the archive of one result is the same bytes however often it is downloaded."""


def result_files(group: Path) -> list[tuple[str, Path]]:
    """The regular files of a result group, by their POSIX name inside it, sorted (``zarr.json`` first).

    Args:
        group (Path): the ``result.zarr`` folder.

    Returns:
        ``[(name, path), ...]``; links and anything that is not a regular file are left out.
    """
    files = []
    for root, dirs, names in os.walk(group, followlinks=False):
        dirs.sort()
        for name in names:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                files.append((path.relative_to(group).as_posix(), path))
    return sorted(files, key=lambda item: (item[0] != "zarr.json", item[0]))


class _Pieces:
    """A write-only sink zipfile writes into (no ``tell``/``seek``: zipfile then writes data descriptors)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes, /) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


def zip_stream(group: Path, *, block_bytes: int = 8 * 2**20) -> Iterator[bytes]:
    """The result group as a stored (uncompressed) zip archive, in pieces of about ``block_bytes``.

    Args:
        group (Path): the ``result.zarr`` folder (the caller keeps it from being deleted meanwhile).
        block_bytes (int): how much of a file is read at a time. Default: 8 MiB.

    Yields:
        bytes: consecutive pieces of the archive; together, a zip file (ZIP64 where an entry or the archive needs
        it).
    """
    sink = _Pieces()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, path in result_files(group):
            info = zipfile.ZipInfo(name, date_time=_TIMESTAMP)
            info.file_size = path.stat().st_size
            with path.open("rb") as source, archive.open(info, "w") as target:
                while block := source.read(block_bytes):
                    target.write(block)
                    if piece := sink.take():
                        yield piece
            if piece := sink.take():
                yield piece
    yield sink.take()  # the central directory
