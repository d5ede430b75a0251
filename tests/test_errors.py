"""The exception tree of ntk_service/errors.py: InvalidInput is also a ValueError."""

from __future__ import annotations

import pickle

import pytest
import torch

from ntk_service import errors
from ntk_service.kernels import compute_ntk


def _subclasses(cls: type[Exception]) -> list[type[Exception]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_subclasses(sub))
    return found


def test_every_invalid_input_is_a_value_error_and_nothing_else_is() -> None:
    invalid = _subclasses(errors.InvalidInput)
    assert {c.__name__ for c in invalid} >= {"ShapeMismatch", "UnknownMode", "UnknownDevice", "OverlappingGroups"}
    for cls in invalid:
        assert issubclass(cls, ValueError), cls
        assert cls.http_status == 422, cls
    others = [c for c in _subclasses(errors.NtkServiceError) if c not in invalid]
    assert errors.MemoryEstimateExceeded in others and errors.MalformedRequest in others
    for cls in others:
        assert not issubclass(cls, ValueError), cls


def test_a_users_except_value_error_catches_a_bad_mode() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="compute_ntk: unknown mode 'diag'") as caught:
        compute_ntk(model, torch.zeros(3, 2), mode="diag")
    assert isinstance(caught.value, errors.UnknownMode)
    assert caught.value.message == str(caught.value)


def test_an_invalid_input_still_pickles_with_its_message() -> None:
    """Ray ships errors between processes by pickling them."""
    err = pickle.loads(pickle.dumps(errors.ShapeMismatch("compute_ntk: x2 has 3 features, x1 has 2")))
    assert type(err) is errors.ShapeMismatch and err.message == "compute_ntk: x2 has 3 features, x1 has 2"
