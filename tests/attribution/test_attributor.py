"""``fit_attributor`` end to end: what a user (and later the server) hands it wrong gets a clear error before any
work, the caller's model is untouched, and the dense matrix is refused where it would not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ntk_service.attribution import AttributionOptions, fit_attributor
from ntk_service.errors import IncompatibleCheckpoint, InvalidInput, MemoryEstimateExceeded, ShapeMismatch
from tests.attribution.conftest import Problem

SMALL = AttributionOptions(dim=32)


def test_scores_are_reproducible_and_leave_the_model_alone(problem: Problem) -> None:
    before = {k: v.clone() for k, v in problem.model.state_dict().items()}
    first = fit_attributor(problem.model, problem.x, problem.labels, options=SMALL).scores(problem.xq, problem.labels_q)
    again = fit_attributor(problem.model, problem.x, problem.labels, options=SMALL).scores(problem.xq, problem.labels_q)
    np.testing.assert_array_equal(first, again)
    assert first.shape == (6, 24) and first.dtype == np.float32
    for k, v in problem.model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert problem.model.training  # not switched to eval


def test_a_checkpoint_of_another_architecture_is_refused_before_any_features(problem: Problem) -> None:
    other = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 12), nn.Tanh(), nn.Linear(12, 3))
    states = [problem.model.state_dict(), other.state_dict()]
    with pytest.raises(
        IncompatibleCheckpoint,
        match=r"checkpoint 1 does not fit the model.*'0.weight' has shape "
        r"\(32, 5\), the model's \(16, 5\)",
    ):
        fit_attributor(problem.model, problem.x, problem.labels, checkpoints=states, options=SMALL)
    with pytest.raises(InvalidInput, match="checkpoints is empty"):
        fit_attributor(problem.model, problem.x, problem.labels, checkpoints=[], options=SMALL)


def test_labels_that_do_not_match_are_refused(problem: Problem) -> None:
    with pytest.raises(ShapeMismatch, match=r"y_train has shape \(23,\), expected \(24,\)"):
        fit_attributor(problem.model, problem.x, problem.labels[:23], options=SMALL)
    with pytest.raises(ShapeMismatch, match=r"y_train has shape \(24, 3\), expected \(24,\)"):
        fit_attributor(problem.model, problem.x, problem.targets, options=SMALL)
    attributor = fit_attributor(problem.model, problem.x, problem.labels, options=SMALL)
    with pytest.raises(ShapeMismatch, match=r"y_test has shape \(5,\), expected \(6,\)"):
        attributor.scores(problem.xq, problem.labels_q[:5])
    with pytest.raises(ShapeMismatch, match="per-example shape"):
        attributor.scores(torch.randn(6, 4), problem.labels_q)


def test_a_sketch_beyond_the_limits_is_refused(problem: Problem) -> None:
    with pytest.raises(InvalidInput, match=r"dim must be an integer in \[1, 65536\]"):
        fit_attributor(problem.model, problem.x, problem.labels, options=AttributionOptions(dim=100_000))
    with pytest.raises(MemoryEstimateExceeded, match="features of N=24 examples at D=65536"):
        fit_attributor(
            problem.model, problem.x, problem.labels, options=AttributionOptions(dim=65536, memory_budget_bytes=2**30)
        )


def test_the_dense_scores_are_refused_past_the_budget_but_answers_stream(problem: Problem) -> None:
    options = AttributionOptions(dim=32, memory_budget_bytes=1000)
    attributor = fit_attributor(problem.model, problem.x, problem.labels, options=SMALL)
    tight = type(attributor)(attributor.models, attributor.train, options)
    tests = attributor.target_features(problem.xq, problem.labels_q)
    with pytest.raises(MemoryEstimateExceeded, match="use top_influences or tiles"):
        tight.scores(features=tests)
    top = tight.top_influences(features=tests, k=2)  # tiles of a few rows: still every answer
    dense = attributor.scores(features=tests)
    # other tile shapes sum the products in another order: equal to float32 rounding
    np.testing.assert_allclose(top.proponent_scores, -np.sort(-dense, axis=1)[:, :2], rtol=1e-5)
