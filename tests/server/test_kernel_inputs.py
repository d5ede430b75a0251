"""The input contract (``registry/input_contract.py``) and ``server/computing.py`` alone: the side checks and the
mapping of model failures to the caller's errors (the helpers ``server/kernel_inputs.py`` held before issue 40).

The routes using it are tested end to end in ``tests/server/routes``; these are the cases a real request reaches
only on a GPU (a device out of memory) or with an odd factory model.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest
import torch

from ntk_service.errors import (
    InvalidInput,
    MemoryEstimateExceeded,
    ModelNotFound,
    ResourceLimit,
    ShapeMismatch,
    operation_name,
)
from ntk_service.registry import ModelRecord
from ntk_service.registry.input_contract import check_input
from ntk_service.server.computing import check_budget, run_model


def _record(architecture: dict[str, object], input_shape: tuple[int, ...], input_dtype: str) -> ModelRecord:
    return ModelRecord(
        name="m",
        version=1,
        architecture=architecture,
        seed=0,
        num_params=1,
        input_shape=input_shape,
        input_dtype=input_dtype,
        output_dim=2,
        parameters=(),
        weights_sha256="0" * 64,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


MLP = _record({"family": "mlp"}, (3,), "float32")
TRANSFORMER = _record({"family": "transformer", "max_len": 4, "vocab_size": 10}, (4,), "int64")


def test_check_input_accepts_what_the_model_takes() -> None:
    check_input(np.zeros((2, 3), np.float32), MLP, side="x1")
    check_input(np.array([[0, 9, 3]]), TRANSFORMER, side="x1")  # T = 3 <= max_len


@pytest.mark.parametrize(
    ("array", "record", "error", "fragment"),
    [
        (np.zeros((2, 4), np.float32), MLP, ShapeMismatch, "expects (3,)"),
        (np.float32(1.0), MLP, ShapeMismatch, "got a scalar"),
        (np.zeros((2, 3), np.int64), MLP, InvalidInput, "send float32 or float64 values"),
        (np.zeros((2, 5), np.int64), TRANSFORMER, ShapeMismatch, "1 <= T <= 4"),
        (np.zeros((2, 3), np.float32), TRANSFORMER, InvalidInput, "send integer token ids"),
        (np.array([[0, 10]]), TRANSFORMER, InvalidInput, "ids 0..9"),
        (np.array([[-1, 2]]), TRANSFORMER, InvalidInput, "token ids in [-1, 2]"),
    ],
)
def test_check_input_refuses_with_what_to_send(
    array: np.ndarray, record: ModelRecord, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error) as info, operation_name("op"):  # the caller's boundary names the operation
        check_input(np.asarray(array), record, side="x2")
    assert fragment in str(info.value)
    assert str(info.value).startswith("op: x2")


def test_run_model_maps_failures_to_the_callers_errors() -> None:
    assert run_model(lambda: 7, record=MLP)[0] == 7

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")  # a subclass of RuntimeError: must not read as bad input

    with pytest.raises(ResourceLimit, match="cuda:0 ran out of memory"):
        run_model(oom, record=MLP, device="cuda:0")

    def bad_forward() -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(InvalidInput, match="model 'm' failed on the inputs: mat1"):
        run_model(bad_forward, record=MLP)

    def domain() -> None:
        raise ModelNotFound("op: no model 'm'")

    with pytest.raises(ModelNotFound):  # domain errors pass through unchanged
        run_model(domain, record=MLP)


def test_check_budget_refuses_over_the_budget_with_the_estimate() -> None:
    check_budget(1000, 1000, what="w")
    with pytest.raises(MemoryEstimateExceeded) as info:
        check_budget(1001, 1000, what="the spectrum")
    assert info.value.estimate_bytes == 1001
    assert info.value.budget_bytes == 1000
