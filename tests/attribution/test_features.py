"""Sketched attribution features: the scores converge to TRAK's formula at the 1/√D rate (docs/attribution.md,
"Exactness"), against the by-hand float64 reference of conftest.py; chunks, option checks and memory refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from ntk_service.attribution import (
    AttributionOptions,
    fit_attributor,
    target_features,
    train_feature_chunks,
    train_features,
)
from ntk_service.attribution.checkpoints import AllOutputs, OutputFunction
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch
from ntk_service.kernels import ntk_features
from tests.attribution.conftest import Problem, reference_scores, relative_error


def _labels(problem: Problem, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    if loss == "cross_entropy":
        return problem.labels, problem.labels_q
    return problem.targets, problem.targets_q


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_sketched_scores_converge_to_the_exact_ones_at_the_square_root_rate(problem: Problem, loss: str) -> None:
    y, yq = _labels(problem, loss)
    expected = reference_scores(problem.model, problem.x, y, problem.xq, yq, loss=loss, ridge=0.1)
    dims, seeds = [128, 512, 2048], [0, 1, 2]
    errors = []
    for dim in dims:
        per_seed = []
        for seed in seeds:
            options = AttributionOptions(loss=loss, dim=dim, seed=seed, ridge=0.1, dtype="float64")
            scores = fit_attributor(problem.model, problem.x, y, options=options).scores(problem.xq, yq)
            per_seed.append(relative_error(scores, expected) ** 2)
        errors.append(float(np.sqrt(np.mean(per_seed))))  # RMS over seeds
    slope = np.polyfit(np.log(dims), np.log(errors), 1)[0]
    assert errors[0] > errors[1] > errors[2]
    assert -0.8 < slope < -0.3, f"errors {errors} fall with slope {slope:.2f}, expected about -1/2"
    # the documented constant: error × √D stays within a factor 2 of its mean across D
    constants = np.array(errors) * np.sqrt(dims)
    assert constants.max() < 2 * constants.min()


@pytest.mark.parametrize("sketch", ["structured", "gaussian"])
def test_the_output_function_is_sketched_with_the_same_draws_as_all_outputs(problem: Problem, sketch: str) -> None:
    # mse's Hessian rows come from AllOutputs, its test features from OutputFunction: one sketch only if
    # Φ_OF(x, w) = Σ_a w_a Φ_a(x) with the same draws
    model = copy.deepcopy(problem.model).double()
    x = problem.x.double()
    w = torch.randn(x.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weighted = ntk_features(OutputFunction(model), (x, w), dim=96, seed=5, sketch=sketch)[:, 0]
    rows = ntk_features(AllOutputs(model), x, dim=96, seed=5, sketch=sketch)
    torch.testing.assert_close(weighted, torch.einsum("na,nad->nd", w, rows), rtol=1e-10, atol=1e-12)


def test_chunks_partition_the_training_side(problem: Problem) -> None:
    options = AttributionOptions(dim=64, dtype="float64")
    whole = train_features(problem.model, problem.x, problem.labels, options=options)
    chunks = list(
        train_feature_chunks(problem.model, problem.x, problem.labels, options=options.replace(rows_per_chunk=5))
    )
    assert [c.start for c in chunks] == [0, 5, 10, 15, 20]
    np.testing.assert_allclose(np.concatenate([c.features for c in chunks]), whole.features, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sum(c.gram for c in chunks), whole.gram, rtol=1e-10, atol=1e-10)
    assert sum(c.rows for c in chunks) == whole.rows == 24


def test_an_mse_training_side_has_k_hessian_rows_per_example(problem: Problem) -> None:
    tf = train_features(problem.model, problem.x, problem.targets, options=AttributionOptions(loss="mse", dim=32))
    assert tf.rows == 24 * 3 and tf.features.shape == (24, 32) and tf.gram.shape == (32, 32)
    np.testing.assert_array_equal(tf.loss_weights, np.ones(24))


def test_target_features_refuse_other_options(problem: Problem) -> None:
    tf = train_features(problem.model, problem.x, problem.labels, options=AttributionOptions(dim=32))
    with pytest.raises(InvalidInput, match="same options"):
        target_features(problem.model, problem.xq, train=tf, options=AttributionOptions(loss="mse", dim=32))
    with pytest.raises(ShapeMismatch, match="D=32, options.dim=64"):
        target_features(problem.model, problem.xq, train=tf, options=AttributionOptions(dim=64))


def test_features_over_the_budget_are_refused_before_any_work(problem: Problem) -> None:
    options = AttributionOptions(dim=8192, memory_budget_bytes=2**20)
    with pytest.raises(MemoryEstimateExceeded, match="over the memory budget of 1.00 MiB") as refused:
        next(train_feature_chunks(problem.model, problem.x, problem.labels, options=options))
    assert refused.value.estimate_bytes is not None and refused.value.estimate_bytes > 2 * 8192**2 * 8


def test_test_labels_are_optional_for_cross_entropy_and_measure_the_predicted_class(problem: Problem) -> None:
    options = AttributionOptions(features="exact")
    attributor = fit_attributor(problem.model, problem.x, problem.labels, options=options)
    with torch.no_grad():
        predicted = problem.model(problem.xq).argmax(dim=1)
    np.testing.assert_allclose(attributor.scores(problem.xq), attributor.scores(problem.xq, predicted), rtol=1e-6)
    with pytest.raises(InvalidInput, match="y_test"):
        fit_attributor(problem.model, problem.x, problem.targets, options=options.replace(loss="mse")).scores(
            problem.xq
        )
