"""ModelRegistry on a real SQLite file: persistence, versions, strict uploads, deletes, caching, crash safety."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import types
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import ntk_service.registry
from ntk_service.errors import (
    InvalidInput,
    MalformedRequest,
    ModelNotFound,
    NameConflict,
    NonFiniteInput,
    NtkServiceError,
    PermissionDenied,
)
from ntk_service.registry import ModelRecord, ModelRegistry

from . import factories

MLP = {"family": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 2}
TIED = {
    "family": "factory",
    "factory": f"{factories.__name__}:tied_lm",
    "kwargs": {"vocab": 5, "width": 3},
    "input_shape": [4],
    "input_dtype": "int64",
}
PUBLIC_FIELDS = {
    "name",
    "version",
    "architecture",
    "seed",
    "inputs",
    "num_params",
    "input_shape",
    "input_dtype",
    "output_dim",
    "parameters",
    "weights_sha256",
    "created_at",
    "label",
    "class_name",
    "parameter_paths",
}


def _weight_files(data_dir: Path) -> list[str]:
    return sorted(p.name for p in (data_dir / "weights").iterdir())


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_public_api_is_explicit() -> None:
    module = ntk_service.registry
    public = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"
    }
    assert public == set(module.__all__) and module.__all__ == sorted(module.__all__)


def test_register_get_list(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    record = registry.register("mlp-1", MLP, seed=3)
    assert (record.name, record.version, record.seed, record.num_params) == ("mlp-1", 1, 3, 3 * 4 + 4 + 4 * 2 + 2)
    assert (record.input_shape, record.input_dtype, record.output_dim) == ((3,), "float32", 2)
    assert [(p.name, p.shape) for p in record.parameters] == [
        ("layers.0.weight", (4, 3)),
        ("layers.0.bias", (4,)),
        ("layers.1.weight", (2, 4)),
        ("layers.1.bias", (2,)),
    ]
    assert record.architecture == {
        **MLP,
        "activation": "relu",
        "bias": True,
        "parameterization": "standard",
        "w_std": 1.0,
        "b_std": 1.0,
    }
    assert record.created_at.tzinfo == UTC and abs((datetime.now(UTC) - record.created_at).total_seconds()) < 60
    public = record.to_public()
    assert set(public) == PUBLIC_FIELDS
    assert public["parameters"][0] == {"name": "layers.0.weight", "shape": [4, 3]}
    paths = public["parameter_paths"]  # the MLP family: a pipeline the engine captures in closed form
    assert paths["capture"].startswith("chain") and paths["jacrev_parameters"] == 0
    assert [(g["group"], g["parameters"], g["form"]) for g in paths["groups"]] == [
        ("layers.0", ["weight", "bias"], "factored"),
        ("layers.1", ["weight", "bias"], "factored"),
    ]
    assert paths["auto"]["implementation"] == "structured" and public["class_name"] is None
    assert datetime.fromisoformat(public["created_at"]) == record.created_at
    assert registry.get("mlp-1") == record == registry.get("mlp-1", 1)
    registry.register("a-0", MLP)
    assert [r.name for r in registry.list()] == ["a-0", "mlp-1"]


def test_restart_keeps_records_and_weights(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    record = registry.register("m", {"family": "cnn", "input_shape": [1, 5, 5], "channels": [2], "output_dim": 2})
    _, module = registry.load_module("m")
    weights = registry.weights_bytes("m", 1)
    registry.close()

    reopened = ModelRegistry(tmp_path)
    assert reopened.get("m") == record and reopened.list() == [record]
    assert reopened.weights_bytes("m", 1) == weights
    again, loaded = reopened.load_module("m", 1)
    assert again == record and loaded is not module and not loaded.training
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    x = torch.randn(3, 1, 5, 5)
    torch.testing.assert_close(loaded(x), module(x), rtol=0, atol=0)


def test_seeded_weights_are_deterministic(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    a, b, c = (registry.register(n, MLP, seed=s) for n, s in (("a", 11), ("b", 11), ("c", 12)))
    assert a.weights_sha256 == b.weights_sha256 != c.weights_sha256
    assert len(_weight_files(tmp_path)) == 2  # content-addressed: a and b share one file


def test_names_conflicts_and_not_found(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    registry.register("m", MLP)
    with pytest.raises(NameConflict, match="a model named 'm' already exists .versions 1."):
        registry.register("m", MLP)
    for bad in ["", "-x", "a b", "x" * 65, "../etc", "é"]:
        with pytest.raises(InvalidInput, match="invalid model name"):
            registry.register(bad, MLP)
    with pytest.raises(ModelNotFound, match="no model named 'nope'; registered models: m"):
        registry.get("nope")
    with pytest.raises(ModelNotFound, match="model 'm' has no version 3; its versions are 1"):
        registry.get("m", 3)
    with pytest.raises(ModelNotFound, match="no model named 'nope'"):
        registry.delete("nope")
    with pytest.raises(InvalidInput, match="hidden: Field required"):
        registry.register("x", {"family": "mlp", "input_dim": 3, "output_dim": 1})
    assert [r.name for r in registry.list()] == ["m"]


def test_add_version_stores_uploaded_weights(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    v1 = registry.register("m", MLP, seed=0)
    _, module = registry.load_module("m")
    new = {k: v * 2 + 1 for k, v in _state(module).items()}
    upload = safetensors.torch.save(new, metadata={"note": "anything"})
    v2 = registry.add_version("m", upload)
    assert (v2.version, v2.seed, v2.parameters, v2.architecture) == (2, None, v1.parameters, v1.architecture)
    assert registry.get("m") == v2 and registry.get("m", 1) == v1
    assert [r.version for r in registry.list()] == [2]
    _, loaded = registry.load_module("m")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in new.items())
    assert safetensors.torch.load(registry.weights_bytes("m", 2)).keys() == new.keys()
    v3 = registry.add_version("m", safetensors.torch.save(new))  # same tensors, other metadata: same file
    assert v3.version == 3 and v3.weights_sha256 == v2.weights_sha256
    assert ModelRegistry(tmp_path).get("m", 2) == v2


def _upload_error(registry: ModelRegistry, tensors: dict[str, torch.Tensor]) -> str:
    with pytest.raises(InvalidInput) as info:
        registry.add_version("m", safetensors.torch.save(tensors))
    return info.value.message


def test_add_version_is_strict(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    registry.register("m", MLP)
    good = _state(registry.load_module("m")[1])
    missing = {k: v for k, v in good.items() if k != "layers.1.bias"}
    assert "missing tensors: layers.1.bias" in _upload_error(registry, missing)
    extra = {**good, "layers.2.weight": torch.zeros(2, 2)}
    assert "unexpected tensors: layers.2.weight" in _upload_error(registry, extra)
    shape = {**good, "layers.0.weight": torch.zeros(4, 5)}
    assert "layers.0.weight (expected [4, 3] float32, got [4, 5] float32)" in _upload_error(registry, shape)
    dtype = {**good, "layers.0.bias": good["layers.0.bias"].double()}
    assert "layers.0.bias (expected [4] float32, got [4] float64)" in _upload_error(registry, dtype)
    several = _upload_error(registry, {**missing, "extra": torch.zeros(1)})
    assert "missing tensors: layers.1.bias" in several and "unexpected tensors: extra" in several
    with pytest.raises(NonFiniteInput, match="layers.1.weight contain NaN or inf"):
        registry.add_version("m", safetensors.torch.save({**good, "layers.1.weight": torch.full((2, 4), torch.nan)}))
    for junk in [b"", b"not safetensors at all", b"\xff" * 64]:
        with pytest.raises(MalformedRequest, match="not a (valid )?safetensors file"):
            registry.add_version("m", junk)
    with pytest.raises(ModelNotFound):
        registry.add_version("other", safetensors.torch.save(good))
    assert [r.version for r in registry.versions("m")] == [1]
    assert len(_weight_files(tmp_path)) == 1


def test_delete_removes_versions_and_unshared_files(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    registry.register("a", MLP, seed=1)
    registry.register("b", MLP, seed=1)  # same weights as a
    _, module = registry.load_module("a")
    registry.add_version("a", safetensors.torch.save({k: v + 1 for k, v in _state(module).items()}))
    assert len(_weight_files(tmp_path)) == 2
    registry.delete("a")
    with pytest.raises(ModelNotFound):
        registry.get("a")
    assert len(_weight_files(tmp_path)) == 1  # a's v2 file is gone; v1's file is still b's
    assert registry.load_module("b")[0].version == 1
    registry.delete("b")
    assert _weight_files(tmp_path) == [] and registry.list() == []


def test_reregistered_name_never_serves_the_old_module(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    registry.register("m", {**MLP, "activation": "relu"}, seed=0)
    x = -torch.ones(1, 3)
    relu_out = registry.load_module("m")[1](x)
    registry.delete("m")
    record = registry.register("m", {**MLP, "activation": "tanh"}, seed=0)  # same weights_sha256, same (name, 1)
    _, module = registry.load_module("m")
    assert record.architecture["activation"] == "tanh"
    assert module.activation.__class__.__name__ == "Tanh"
    assert not torch.equal(module(x), relu_out)


def test_module_cache_is_lru_and_shared(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path, module_cache_size=1)
    registry.register("a", MLP)
    registry.register("b", MLP, seed=1)
    registry.close()
    registry = ModelRegistry(tmp_path, module_cache_size=1)
    first = registry.load_module("a")[1]
    assert registry.load_module("a")[1] is first
    registry.load_module("b")
    assert registry.load_module("a")[1] is not first  # evicted by b, built again

    results: list[Any] = []
    registry = ModelRegistry(tmp_path, module_cache_size=4)

    def work(i: int) -> None:
        if i % 2:
            results.append(registry.load_module("a")[1])
        else:
            results.append(registry.register(f"t{i}", MLP, seed=i).version)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    modules = [r for r in results if not isinstance(r, int)]
    assert len(results) == 8 and len({id(m) for m in modules}) == 1
    assert len(registry.list()) == 6


def test_concurrent_registrations_of_one_name(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    outcomes: list[str] = []

    def work(seed: int) -> None:
        try:
            registry.register("same", MLP, seed=seed)
            outcomes.append("ok")
        except NameConflict:
            outcomes.append("conflict")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["conflict"] * 3 + ["ok"]
    assert _weight_files(tmp_path) == [f"{registry.get('same').weights_sha256}.safetensors"]


def test_tied_weights_factory_round_trip(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path, allowed_factories=frozenset({TIED["factory"]}))
    record = registry.register("tied", TIED, seed=4)
    assert [p.name for p in record.parameters] == ["embedding.weight"]  # the tie counts once
    assert record.num_params == 15 and record.output_dim == 5
    stored = safetensors.torch.load(registry.weights_bytes("tied", 1))
    assert set(stored) == {"scale", "embedding.weight"}  # the buffer is kept, the alias head.weight is not
    new = {"scale": torch.tensor(3.0), "embedding.weight": torch.randn(5, 3)}
    registry.add_version("tied", safetensors.torch.save(new))
    reopened = ModelRegistry(tmp_path, allowed_factories=frozenset({TIED["factory"]}), module_cache_size=0)
    _, module = reopened.load_module("tied")
    assert module.head.weight is module.embedding.weight
    assert torch.equal(module.head.weight, new["embedding.weight"]) and float(module.scale) == 3.0
    alias = {**new, "head.weight": new["embedding.weight"].clone()}
    assert "unexpected tensors: head.weight" in _upload_error_named(registry, "tied", alias)
    module.embedding.weight.data.fill_(0.5)  # a private copy: the registry's cached module is another object
    path = tmp_path / "saved.safetensors"
    safetensors.torch.save_model(module, str(path))  # what a user would upload for a tied model
    v3 = registry.add_version("tied", path.read_bytes())
    assert float(registry.load_module("tied", v3.version)[1].head.weight.detach().sum()) == 7.5
    with pytest.raises(PermissionDenied, match="not allowed"):
        ModelRegistry(tmp_path).load_module("tied")  # the operator removed the factory


def _upload_error_named(registry: ModelRegistry, name: str, tensors: dict[str, torch.Tensor]) -> str:
    with pytest.raises(InvalidInput) as info:
        registry.add_version(name, safetensors.torch.save(tensors))
    return info.value.message


def test_failed_commit_leaves_no_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = ModelRegistry(tmp_path)
    registry.register("keep", MLP, seed=9)

    def fail(self: ModelRegistry, conn: Any, record: ModelRecord) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(ModelRegistry, "_insert_version_row", fail)
    with pytest.raises(sqlite3.OperationalError):
        registry.register("lost", MLP, seed=1)
    with pytest.raises(sqlite3.OperationalError):
        registry.add_version("keep", _bytes_of(registry, "keep", 5.0))
    monkeypatch.undo()
    assert [r.name for r in registry.list()] == ["keep"] and registry.get("keep").version == 1
    assert _weight_files(tmp_path) == [f"{registry.get('keep').weights_sha256}.safetensors"]
    assert registry.register("lost", MLP, seed=1).version == 1


def _bytes_of(registry: ModelRegistry, name: str, value: float) -> bytes:
    return safetensors.torch.save(
        {k: torch.full_like(v, value) for k, v in _state(registry.load_module(name)[1]).items()}
    )


_CRASH_SCRIPT = """
import os, sys
from pathlib import Path
from ntk_service.registry import ModelRegistry

registry = ModelRegistry(Path(sys.argv[1]))
print(registry.register("seeded", {MLP!r}, seed=11).weights_sha256, flush=True)

def crash(self, conn, record):
    os._exit(17)  # the process dies after the weight file is in place, before the row is committed

ModelRegistry._insert_version_row = crash
registry.register("half", {CNN!r}, seed=0)
"""


def test_process_killed_mid_upload_leaves_registry_consistent(tmp_path: Path) -> None:
    cnn = {"family": "cnn", "input_shape": [1, 4, 4], "channels": [2], "output_dim": 1}
    script = textwrap.dedent(_CRASH_SCRIPT).replace("{MLP!r}", repr(MLP)).replace("{CNN!r}", repr(cnn))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 17, proc.stderr
    seeded_sha = proc.stdout.strip()
    assert len(_weight_files(tmp_path)) == 2  # the half-registered model's file made it to disk
    stale = tmp_path / "weights" / ".tmp-leftover.safetensors"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    fresh = tmp_path / "weights" / ".tmp-inflight.safetensors"
    fresh.write_bytes(b"another process is writing this")

    registry = ModelRegistry(tmp_path)
    assert [r.name for r in registry.list()] == ["seeded"]
    with pytest.raises(ModelNotFound):
        registry.get("half")
    # Cross-process determinism: this process computes the same weights for the same architecture and seed.
    assert registry.get("seeded").weights_sha256 == seeded_sha == registry.register("again", MLP, 11).weights_sha256
    assert _weight_files(tmp_path) == [".tmp-inflight.safetensors", f"{seeded_sha}.safetensors"]
    assert registry.register("half", cnn).version == 1


def test_model_replaced_during_upload_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = ModelRegistry(tmp_path)
    registry.register("m", MLP)
    upload = _bytes_of(registry, "m", 0.5)
    other = ModelRegistry(tmp_path)
    skeleton = ModelRegistry._skeleton

    def replace_meanwhile(self: ModelRegistry, record: ModelRecord, op: str) -> torch.nn.Module:
        other.delete("m")
        other.register("m", {**MLP, "hidden": [5]})
        return skeleton(self, record, op)

    monkeypatch.setattr(ModelRegistry, "_skeleton", replace_meanwhile)
    with pytest.raises(ModelNotFound, match="was deleted .or replaced. while the weights were uploaded"):
        registry.add_version("m", upload)
    monkeypatch.undo()
    assert [r.version for r in registry.versions("m")] == [1] and registry.get("m").architecture["hidden"] == [5]


def test_missing_weight_file_is_reported(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path, module_cache_size=0)
    record = registry.register("m", MLP)
    (tmp_path / "weights" / f"{record.weights_sha256}.safetensors").unlink()
    for call in (lambda: registry.load_module("m"), lambda: registry.weights_bytes("m", 1)):
        with pytest.raises(NtkServiceError, match="version 1: its weights file .* is missing"):
            call()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    ModelRegistry(tmp_path).close()
    with sqlite3.connect(tmp_path / "registry.sqlite3") as conn:
        conn.execute("UPDATE schema_version SET version = 99")
    conn.close()
    with pytest.raises(NtkServiceError, match="schema version 99, newer than this ntk-service understands"):
        ModelRegistry(tmp_path)


def test_closed_registry_refuses_calls(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    registry.list()
    registry.close()
    with pytest.raises(NtkServiceError, match="is closed"):
        registry.list()
