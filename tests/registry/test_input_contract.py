"""The input contract of a model record (``registry/input_contract.py``) and the module of a record already read
(``ModelRegistry.module``): what the server checks once per request, before computing."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import torch

from ntk_service.errors import InvalidInput, operation_name
from ntk_service.kernels.problem.outputs import parse_output
from ntk_service.registry import ModelRecord, ModelRegistry
from ntk_service.registry.input_contract import check_input, check_output, output_size, vocabulary


def _record(
    architecture: dict[str, object], input_shape: tuple[int, ...] = (3,), dtype: str = "float32"
) -> ModelRecord:
    return ModelRecord(
        name="m",
        version=1,
        architecture=architecture,
        seed=0,
        num_params=1,
        input_shape=input_shape,
        input_dtype=dtype,
        output_dim=4,
        parameters=(),
        weights_sha256="0" * 64,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


EXPORTED = _record({"family": "exported", "outputs": {"logits": [3, 5], "hidden": [8]}})


def test_output_size_selects_from_the_listed_outputs_before_computing() -> None:
    assert output_size(None, _record({"family": "mlp"})) == 4
    assert output_size(parse_output("logits"), EXPORTED) == 15
    assert output_size(parse_output("logits[:, 0]"), EXPORTED) == 5
    assert output_size(parse_output("logits[:, 1:3, :2]"), EXPORTED) == 4
    with pytest.raises(InvalidInput) as info, operation_name("op"):
        output_size(parse_output("nope"), EXPORTED)
    assert str(info.value).startswith("op: ") and "'nope'" in str(info.value)  # named once, by the boundary


def test_check_output_refuses_output_for_a_model_returning_a_tensor() -> None:
    check_output(None, _record({"family": "mlp"}))
    check_output("logits", EXPORTED)
    check_output("anything", _record({"family": "factory"}))  # only the engine knows
    with pytest.raises(InvalidInput) as info, operation_name("op"):
        check_output("logits", _record({"family": "mlp"}))
    assert str(info.value).startswith("op: output='logits' was given, but model 'm' returns one tensor")


def test_vocabulary_of_each_family() -> None:
    assert vocabulary({"family": "transformer", "vocab_size": 11}) == 11
    assert vocabulary({"family": "exported", "vocab_size": 7}) == 7
    layers = [{"type": "Embedding", "num_embeddings": 9, "embedding_dim": 2}]
    assert vocabulary({"family": "sequential", "input_dtype": "int64", "layers": layers}) == 9
    assert vocabulary({"family": "mlp"}) is None
    ids = _record({"family": "transformer", "vocab_size": 11, "max_len": 4}, (4,), "int64")
    check_input(np.array([[0, 10]]), ids, side="x1")
    with pytest.raises(InvalidInput, match=r"^op: x1 has token ids in \[0, 11\]"), operation_name("op"):
        check_input(np.array([[0, 11]]), ids, side="x1")


def test_module_of_a_record_already_read_is_the_cached_module(tmp_path: Path) -> None:
    registry = ModelRegistry(tmp_path)
    try:
        record = registry.register("m", {"family": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 2}, seed=0)
        module = registry.module(record)
        assert registry.module(record) is module  # one build, from the LRU cache
        again, loaded = registry.load_module("m", 1)
        assert again == record and loaded is module
        x = torch.randn(2, 3)
        torch.testing.assert_close(module(x), loaded(x))
    finally:
        registry.close()
