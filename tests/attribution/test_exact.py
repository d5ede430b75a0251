"""Exact attribution features (NOTE [exact features]) give TRAK's formula written out by hand in parameter space
(conftest.py's float64 reference) to float32 rounding, with and without a ridge, for both losses."""

from __future__ import annotations

import pytest
import torch

from ntk_service.attribution import AttributionOptions, exact_memory, fit_attributor, train_features
from ntk_service.attribution.options import AttributionLoss
from ntk_service.errors import MemoryEstimateExceeded
from tests.attribution.conftest import Problem, reference_scores, relative_error


def _labels(problem: Problem, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    if loss == "cross_entropy":
        return problem.labels, problem.labels_q
    return problem.targets, problem.targets_q


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("ridge", [0.1, 0.0])
def test_exact_features_give_the_reference_scores(problem: Problem, loss: str, ridge: float) -> None:
    y, yq = _labels(problem, loss)
    expected = reference_scores(problem.model, problem.x, y, problem.xq, yq, loss=loss, ridge=ridge)
    options = AttributionOptions(loss=loss, features="exact", ridge=ridge)
    scores = fit_attributor(problem.model, problem.x, y, options=options).scores(problem.xq, yq)
    # the scores are float32 products: 1e-5 is 100x their rounding, far below any modelling difference
    assert relative_error(scores, expected) < 1e-5


def test_an_exact_kernel_over_the_budget_is_refused_with_its_estimate(problem: Problem) -> None:
    assert exact_memory(24, 3, AttributionLoss.CROSS_ENTROPY) == 4 * 24**2 * 8
    assert exact_memory(24, 3, AttributionLoss.MSE) == 4 * 72**2 * 8
    options = AttributionOptions(features="exact", memory_budget_bytes=1000)
    with pytest.raises(MemoryEstimateExceeded, match=r"exact features of N=24 examples \(k=3\) need about 18.00 KiB"):
        train_features(problem.model, problem.x, problem.labels, options=options)
