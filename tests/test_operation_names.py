"""NOTE [operation names] in errors.py: an error raised with ``detail=`` is named once, by the innermost
boundary (``operation_name``) it leaves; a whole ``message`` is never renamed."""

from __future__ import annotations

import pickle

import pytest
import torch

from ntk_service.errors import (
    Busy,
    InvalidInput,
    MemoryEstimateExceeded,
    ShapeMismatch,
    operation_name,
    operation_part,
)
from ntk_service.kernels import compute_ntk


def test_a_detail_is_named_once_by_the_innermost_boundary() -> None:
    with pytest.raises(ShapeMismatch) as info, operation_name("outer"), operation_name("inner"):
        raise ShapeMismatch(detail="x1 has 3 features, the model expects 4")
    assert str(info.value) == info.value.message == "inner: x1 has 3 features, the model expects 4"
    assert info.value.operation == "inner"


def test_a_whole_message_is_never_renamed() -> None:
    with pytest.raises(InvalidInput) as info, operation_name("route"):
        raise InvalidInput("compute_ntk: unknown mode 'diag'")
    assert str(info.value) == "compute_ntk: unknown mode 'diag'" and info.value.operation is None


def test_a_part_goes_between_the_operation_and_the_detail() -> None:
    with pytest.raises(InvalidInput) as info, operation_name("ntk of model 'm'"), operation_part("x1"):
        raise InvalidInput(detail="dataset: Field required")
    assert str(info.value) == "ntk of model 'm': x1: dataset: Field required"


def test_a_message_made_with_an_empty_name_becomes_a_detail() -> None:
    """For callees that start their messages with the name they are given (``select_output(..., "")``)."""
    with pytest.raises(InvalidInput) as info, operation_name("op"):
        try:
            raise InvalidInput(": output path 'x[' is not closed")
        except InvalidInput as exc:
            raise exc.leave_operation(drop=": ") from None
    assert str(info.value) == "op: output path 'x[' is not closed"


def test_no_boundary_leaves_the_detail_alone_and_errors_keep_their_fields() -> None:
    with pytest.raises(MemoryEstimateExceeded) as info, operation_name(None):
        raise MemoryEstimateExceeded(detail="needs 3 GiB", estimate_bytes=3, budget_bytes=2)
    assert str(info.value) == "needs 3 GiB" and info.value.estimate_bytes == 3 and info.value.budget_bytes == 2
    with pytest.raises(Busy) as busy, operation_name("op"):
        raise Busy(detail="at capacity", retry_after_s=7.0)
    assert str(busy.value) == "op: at capacity" and busy.value.retry_after_s == 7.0
    again = pickle.loads(pickle.dumps(busy.value))  # Ray ships errors by pickling them
    assert str(again) == "op: at capacity"


def test_the_public_call_is_the_boundary_of_the_engine() -> None:
    """``compute_ntk`` names what its values refuse; the same refusal inside ``compute_ntk_groups`` is named by it."""
    model = torch.nn.Linear(2, 1)
    with pytest.raises(InvalidInput) as info:
        compute_ntk(model, torch.zeros(3, 2), params="0.*")  # type: ignore[arg-type]
    assert str(info.value) == "compute_ntk: params must be a list of glob strings, got '0.*'"
