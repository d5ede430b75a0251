"""A data directory written by the previous release (schema version 1, no version labels) keeps working: it is
upgraded in place on open, its models load with the same weights, and new versions get labels."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import safetensors.torch
import torch

from ntk_service.registry import ModelRegistry
from ntk_service.registry.database import DATABASE_FILENAME, SCHEMA_VERSION

FIXTURE = Path(__file__).parent / "data" / "registry-v1"


def test_a_schema_1_data_dir_is_migrated_in_place(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    shutil.copytree(FIXTURE, data_dir)
    with sqlite3.connect(data_dir / DATABASE_FILENAME) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (1,)
        assert "label" not in {row[1] for row in conn.execute("PRAGMA table_info(model_versions)")}

    registry = ModelRegistry(data_dir)
    versions = registry.versions("mlp-v1")
    assert [(r.version, r.seed, r.label) for r in versions] == [(1, 7, None), (2, None, None)]
    assert versions[0].parameter_paths is None  # registered before the path report (schema 4) existed
    assert versions[0].created_at < versions[1].created_at
    assert [(p.name, p.shape) for p in versions[0].parameters] == [
        ("layers.0.weight", (4, 3)),
        ("layers.0.bias", (4,)),
        ("layers.1.weight", (2, 4)),
        ("layers.1.bias", (2,)),
    ]
    _, v1 = registry.load_module("mlp-v1", 1)
    _, v2 = registry.load_module("mlp-v1", 2)
    for key, tensor in v1.state_dict().items():
        assert torch.equal(v2.state_dict()[key], 2 * tensor)  # as the fixture's README says it was written
    x = torch.randn(5, 3)
    assert v1(x).shape == (5, 2)

    record = registry.add_version("mlp-v1", safetensors.torch.save(v1.state_dict()), label="after upgrade")
    assert (record.version, record.label) == (3, "after upgrade")
    assert record.architecture == versions[0].architecture
    registry.close()

    with sqlite3.connect(data_dir / DATABASE_FILENAME) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
    reopened = ModelRegistry(data_dir)  # a second open finds the current schema and changes nothing
    assert [r.label for r in reopened.versions("mlp-v1")] == [None, None, "after upgrade"]
    reopened.close()
