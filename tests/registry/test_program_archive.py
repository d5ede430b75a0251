"""What is kept on disk of an uploaded torch.export archive: only the entries the checked loader read (NOTE [stored
archives] in program_archive.py). The stored file is opened with plain ``torch.export.load`` in a subprocess (this
process never runs a hostile pickle), where the upload itself, the control, does run its payloads."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ntk_service.registry import ModelRegistry
from ntk_service.registry.archive import ArchiveLimits, read_archive
from ntk_service.registry.exported import load_exported
from ntk_service.registry.program_archive import checked_archive
from tests.registry.archives import export_archive, mkdir_payload, rewrite
from tests.registry.exported_models import GatedLoop

_OPEN_WITH_TORCH = """
import json, os, sys
import numpy as np, torch
marker, x = sys.argv[1], torch.from_numpy(np.load(sys.argv[2]))
seen = {}
for path in sys.argv[3:]:
    try:
        out = torch.export.load(path).module()(x).detach().numpy().tolist()
    except Exception as exc:  # a payload that ran returns no tensor; torch notices after it ran
        out = repr(exc)
    seen[path] = {"ran": os.path.isdir(marker), "out": out}
    if os.path.isdir(marker):
        os.rmdir(marker)
print(json.dumps(seen))
"""


def _open_with_torch(marker: Path, x: torch.Tensor, *paths: Path) -> dict[str, Any]:
    """``torch.export.load(path).module()(x)`` of each file in one fresh interpreter: whether the marker directory
    appeared (then removed) and the output."""
    np.save(marker.parent / "x.npy", x.numpy())
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-c", _OPEN_WITH_TORCH, str(marker), str(marker.parent / "x.npy"), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return {Path(k).name: v for k, v in seen.items()}


def _hostile(archive: bytes, marker: Path) -> bytes:
    """The upload with a pickle that creates ``marker`` in every place the loader never reads: the sample inputs,
    a pickled payload no config names, an ``extra/`` file, the guards ``.module()`` execs, and a key torch ignores."""

    def program(tree: Any) -> None:
        tree["guards_code"] = [f"__import__('os').mkdir({str(marker)!r}) is None"]
        tree["unread_key"] = "kept?"

    return rewrite(
        archive,
        {"data/sample_inputs/model.pt": mkdir_payload(marker)},
        edit_json={"models/model.json": program},
        add={"archive/data/weights/weight_99": mkdir_payload(marker), "archive/extra/notes.txt": b"unread"},
    )


@pytest.fixture(scope="module")
def model() -> tuple[GatedLoop, bytes]:
    torch.manual_seed(0)
    module = GatedLoop().eval()
    return module, export_archive(module, torch.randn(2, 5))


def test_the_stored_archive_holds_only_what_the_loader_read(model: tuple[GatedLoop, bytes], tmp_path: Path) -> None:
    module, archive = model
    marker = tmp_path / "payload-ran"
    upload = tmp_path / "upload.pt2"
    upload.write_bytes(_hostile(archive, marker))

    registry = ModelRegistry(tmp_path / "data")
    record = registry.register_program("g", upload.read_bytes())
    registry.close()
    (stored,) = (tmp_path / "data" / "programs").glob("*.pt2")
    assert stored.name == f"{record.architecture['program_sha256']}.checked.pt2"

    names = sorted(i.filename for i in zipfile.ZipFile(stored).infolist())
    weights = [f"archive/data/weights/weight_{i}" for i in range(len(list(module.parameters())))]
    assert names == sorted(
        [
            *weights,
            "archive/data/weights/model_weights_config.json",
            "archive/data/constants/model_constants_config.json",
            "archive/models/model.json",
            "archive/data/sample_inputs/model.pt",  # empty: written by the service, read by torch as "none"
            *(f"archive/{n}" for n in ("archive_format", "archive_version", "byteorder")),
            *(f"archive/.data/{n}" for n in ("version", "serialization_id")),
        ]
    )
    with zipfile.ZipFile(stored) as z:
        assert z.read("archive/data/sample_inputs/model.pt") == b""
        program = json.loads(z.read("archive/models/model.json"))
        assert program["guards_code"] == [] and "unread_key" not in program

    x = torch.randn(3, 5)
    seen = _open_with_torch(marker, x, upload, stored)
    assert seen["upload.pt2"]["ran"], "the control: torch.export.load of the upload runs its payloads"
    assert not seen[stored.name]["ran"], "torch.export.load of the stored file ran a payload"
    with torch.no_grad():
        np.testing.assert_array_equal(np.asarray(seen[stored.name]["out"], dtype=np.float32), module(x).numpy())
    assert not marker.exists()


def test_the_stored_archive_loads_back_and_is_deterministic(model: tuple[GatedLoop, bytes]) -> None:
    module, archive = model
    stored = checked_archive(load_exported(archive, operation="register 'g'"))
    assert checked_archive(load_exported(archive, operation="register 'g'")) == stored
    again = load_exported(stored, operation="load 'g'")  # the checked loader reads its own output
    assert checked_archive(again) == stored  # a fixed point: nothing more to drop
    x = torch.randn(4, 5)
    with torch.no_grad():
        assert torch.equal(again.module(x), module(x))


def test_an_archive_stored_whole_by_an_earlier_version_is_rewritten_at_start(
    model: tuple[GatedLoop, bytes], tmp_path: Path
) -> None:
    module, archive = model
    marker = tmp_path / "payload-ran"
    hostile = _hostile(archive, marker)
    registry = ModelRegistry(tmp_path)
    sha = registry.register_program("g", hostile).architecture["program_sha256"]
    registry.close()
    programs = tmp_path / "programs"
    (programs / f"{sha}.checked.pt2").unlink()
    (programs / f"{sha}.pt2").write_bytes(hostile)  # how earlier versions stored it: the upload, whole
    (programs / f"{'0' * 64}.pt2").write_bytes(hostile)  # and one no model names

    reopened = ModelRegistry(tmp_path, module_cache_size=0)
    assert sorted(p.name for p in programs.iterdir()) == [f"{sha}.checked.pt2"]
    assert (programs / f"{sha}.checked.pt2").read_bytes() == checked_archive(load_exported(hostile, operation="g"))
    _, loaded = reopened.load_module("g")
    x = torch.randn(2, 5)
    with torch.no_grad():
        assert torch.equal(loaded(x), module(x))
    reopened.close()
    assert not marker.exists()


def test_zip_entries_read_are_recorded_in_order() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name in ("a", "b", "c"):
            z.writestr(f"root/{name}", name.encode())
    entries = read_archive(buffer.getvalue(), limits=ArchiveLimits(), operation="op")
    assert entries.names_read() == []
    entries.read("c"), entries.read("a"), entries.read("c")
    assert entries.names_read() == ["c", "a"]
