"""Exported programs with several inputs and dict outputs: the loader records each input's name, shape, dtype and
vocabulary (positional or keyword), the dict's entries, and the kernels of the loaded graph equal the float64
reference of the original module; mixed positional + keyword inputs and ``detach_`` on anything but a fresh
``torch.tensor`` are refused; a schema-2 data directory gets the ``inputs`` column and its rows read as before."""

from __future__ import annotations

import io
import sqlite3
from pathlib import Path

import pytest
import torch
from torch import nn

from ntk_service.client._export import export_module
from ntk_service.errors import InvalidInput, UnsupportedModel
from ntk_service.kernels.api import compute_ntk
from ntk_service.registry import ModelRegistry
from ntk_service.registry.database import DATABASE_FILENAME, SCHEMA_VERSION
from ntk_service.registry.exported import load_exported
from ntk_service.registry.programs import load_program
from ntk_service.registry.records import InputLeaf, InputSpec
from tests.reference import assert_matches, reference_ntk
from tests.registry.archives import nodes, rewrite

OP = "register 'm'"


class IdsAndFeatures(nn.Module):
    """Token ids (positional), a float feature vector and a mask; a dict out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.features = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = (self.embed(ids) * mask.unsqueeze(-1).to(feats.dtype)).sum(1) + self.features(feats)
        hidden = torch.tanh(pooled)
        return {"logits": self.head(hidden), "hidden": hidden}


def _inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 4, dtype=torch.int64)
    mask[0, 2:] = 0
    return {"ids": torch.randint(0, 11, (n, 4), generator=g), "feats": torch.randn(n, 3, generator=g), "mask": mask}


def _export_positional(module: nn.Module) -> bytes:
    x = _inputs(2, 0)
    batch = torch.export.Dim("batch")
    program = torch.export.export(
        module, (x["ids"], x["feats"], x["mask"]), dynamic_shapes=({0: batch}, {0: batch}, {0: batch})
    )
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def test_keyword_inputs_and_a_dict_output_are_recorded_and_their_kernels_equal_the_reference() -> None:
    torch.manual_seed(0)
    module = IdsAndFeatures().eval()
    archive = export_module(
        module,
        input_shape={"ids": (4,), "feats": (3,), "mask": (4,)},
        input_dtype={"ids": "int64", "mask": "int64"},  # feats: float32 by default
    )
    loaded, spec, architecture, _ = load_program(archive, operation=OP)
    expected = InputSpec(
        "mapping",
        (InputLeaf("ids", (4,), "int64", 11), InputLeaf("feats", (3,), "float32"), InputLeaf("mask", (4,), "int64")),
    )
    assert load_exported(archive, operation=OP).inputs == expected
    assert architecture["inputs"] == expected.to_public() and architecture["outputs"] == {"logits": [2], "hidden": [4]}
    assert spec.output_dim == 2  # the first entry's k; a request selects with output
    x1, x2 = _inputs(3, 1), _inputs(2, 2)
    for output, select in (("logits", lambda o: o["logits"]), ("hidden[:, 1:3]", lambda o: o["hidden"][:, 1:3])):
        reference = reference_ntk(module, x1, x2, output=select)
        for implementation in ("structured", "jacobian_contraction", "ntk_vector_products", "auto"):
            result = compute_ntk(loaded, x1, x2, output=output, implementation=implementation, dtype=torch.float64)
            assert_matches(result.theta, reference, 1e-10)


def test_positional_inputs_are_a_tuple_spec_named_after_forward() -> None:
    torch.manual_seed(1)
    module = IdsAndFeatures().eval()
    program = load_exported(_export_positional(module), operation=OP)
    assert program.inputs is not None and program.inputs.kind == "tuple"
    assert program.inputs.names == ("ids", "feats", "mask") and program.inputs.leaves[0].vocab_size == 11
    x = _inputs(3, 3)
    args = (x["ids"], x["feats"], x["mask"])
    result = compute_ntk(program.module.eval(), args, output="logits", dtype=torch.float64)
    assert_matches(result.theta, reference_ntk(module, args, output=lambda o: o["logits"]), 1e-10)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * scale


def test_positional_and_keyword_inputs_mixed_are_refused() -> None:
    x, scale = torch.randn(2, 3), torch.ones(2, 1)
    batch = torch.export.Dim("batch")
    program = torch.export.export(Mixed(), (x,), {"scale": scale}, dynamic_shapes=({0: batch}, {0: batch}))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    with pytest.raises(UnsupportedModel, match="1 positional and 1 keyword tensors"):
        load_exported(buffer.getvalue(), operation=OP)


def test_mapping_dtypes_need_mapping_shapes() -> None:
    with pytest.raises(InvalidInput, match="input_dtype is a mapping but input_shape is one shape"):
        export_module(IdsAndFeatures(), input_shape=(4,), input_dtype={"ids": "int64"})
    with pytest.raises(InvalidInput, match=r"names \['token_type_ids'\] that input_shape lacks"):
        export_module(IdsAndFeatures(), input_shape={"ids": (4,)}, input_dtype={"token_type_ids": "int64"})


class FreshConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * torch.tensor(2.0)  # exports as lift_fresh_copy + detach_


def test_detach_in_place_only_on_a_fresh_tensor() -> None:
    x = torch.randn(2, 3)
    program = torch.export.export(FreshConstant().eval(), (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    archive = buffer.getvalue()
    loaded = load_exported(archive, operation=OP)
    assert "torch.ops.aten.detach_.default" in loaded.targets

    def detach_the_input(tree: dict) -> None:  # point detach_ at the user input instead of the fresh copy
        user = tree["graph_module"]["signature"]["input_specs"][-1]["user_input"]["arg"]["as_tensor"]["name"]
        for node in nodes(tree):
            if node["target"] == "torch.ops.aten.detach_.default":
                node["inputs"][0]["arg"]["as_tensor"]["name"] = user

    hostile = rewrite(archive, edit_json={"models/model.json": detach_the_input})
    with pytest.raises(UnsupportedModel, match="allowed only on a fresh lift_fresh_copy"):
        load_exported(hostile, operation=OP)


def test_a_schema_2_data_dir_gets_the_inputs_column(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    registry.register("m", {"family": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 2}, seed=1)
    registry.close()
    with sqlite3.connect(tmp_path / DATABASE_FILENAME) as conn:  # as the previous release wrote it
        conn.execute("ALTER TABLE model_versions DROP COLUMN inputs")
        conn.execute("ALTER TABLE datasets DROP COLUMN arrays")
        conn.execute("ALTER TABLE models DROP COLUMN paths")  # schema 4
        conn.execute("UPDATE schema_version SET version = 2")
    reopened = ModelRegistry(tmp_path)
    record = reopened.get("m")
    assert record.inputs is None and record.to_public()["inputs"] is None and record.input_shape == (3,)
    reopened.close()
    with sqlite3.connect(tmp_path / DATABASE_FILENAME) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
        assert "inputs" in {row[1] for row in conn.execute("PRAGMA table_info(model_versions)")}
