"""Scoring: ensembles, tiles, self- and total influence against dense formulas built from the by-hand reference;
the tile planner keeps its memory estimate under the budget and refuses what cannot fit."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from ntk_service.attribution import (
    AttributionOptions,
    fit_attributor,
    fit_checkpoint,
    iter_score_tiles,
    plan_score_tiles,
    score_memory,
    score_train_rows,
    self_influence_scores,
    solve_targets,
    target_features,
    train_features,
)
from ntk_service.errors import InvalidInput, MemoryEstimateExceeded, ShapeMismatch
from tests.attribution.conftest import Problem, make_mlp, margin_weights, reference_scores, relative_error

EXACT = AttributionOptions(features="exact", ridge=0.2)


def _loss_weights(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        f = copy.deepcopy(model).double()(x.double()).numpy()
    return margin_weights(f, y.numpy())[1]


@pytest.mark.parametrize("ensemble", ["trak", "mean"])
def test_two_checkpoints_combine_by_the_ensemble_rule(problem: Problem, ensemble: str) -> None:
    second = make_mlp(1)
    models = [problem.model, second]
    per = [
        reference_scores(m, problem.x, problem.labels, problem.xq, problem.labels_q, loss="cross_entropy", ridge=0.2)
        for m in models
    ]
    s = [_loss_weights(m, problem.x, problem.labels) for m in models]
    if ensemble == "mean":
        expected = (per[0] + per[1]) / 2
    else:  # TRAK: the mean of the unweighted scores times the mean loss weight
        expected = (per[0] / s[0] + per[1] / s[1]) / 2 * (s[0] + s[1]) / 2
    attributor = fit_attributor(
        problem.model,
        problem.x,
        problem.labels,
        checkpoints=[m.state_dict() for m in models],
        options=EXACT.replace(ensemble=ensemble),
    )
    assert relative_error(attributor.scores(problem.xq, problem.labels_q), expected) < 1e-5


def test_tiles_of_any_size_assemble_the_same_scores(problem: Problem) -> None:
    attributor = fit_attributor(problem.model, problem.x, problem.labels, options=EXACT)
    tests = attributor.target_features(problem.xq, problem.labels_q)
    dense = attributor.scores(features=tests)
    out = np.full_like(dense, np.nan)
    for tile in attributor.tiles(features=tests, train_rows=7, test_rows=4):
        assert tile.block.dtype == np.float32 and tile.block.shape[0] <= 4 and tile.block.shape[1] <= 7
        out[
            tile.test_start : tile.test_start + tile.block.shape[0],
            tile.train_start : tile.train_start + tile.block.shape[1],
        ] = tile.block
    np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-6 * np.abs(dense).max())


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_self_influence_is_the_diagonal_of_the_training_sets_scores(problem: Problem, loss: str) -> None:
    y = problem.labels if loss == "cross_entropy" else problem.targets
    attributor = fit_attributor(problem.model, problem.x, y, options=EXACT.replace(loss=loss))
    on_itself = attributor.scores(problem.x, y)  # (N, N): τ(x_m, x_n)
    np.testing.assert_allclose(attributor.self_influence(), np.diag(on_itself), rtol=1e-5, atol=1e-7)
    assert (attributor.self_influence() >= 0).all()  # s·g F⁻¹ g ≥ 0 for an exact, positive definite F


def test_total_influence_is_the_sum_over_the_test_set(problem: Problem) -> None:
    attributor = fit_attributor(problem.model, problem.x, problem.labels, options=EXACT.replace(ensemble="mean"))
    dense = attributor.scores(problem.xq, problem.labels_q)
    total = attributor.total_influence(problem.xq, problem.labels_q)
    np.testing.assert_allclose(total, dense.sum(axis=0), rtol=1e-5, atol=1e-6 * np.abs(total).max())


def test_ridge_zero_is_the_pseudo_inverse_and_with_ridge_reuses_the_features(problem: Problem) -> None:
    attributor = fit_attributor(
        problem.model, problem.x, problem.labels, options=AttributionOptions(dim=16, ridge=0.0, dtype="float64")
    )
    assert attributor.fitted[0].method.startswith("eigh (pseudo-inverse")
    train = attributor.train[0]
    tests = attributor.target_features(problem.xq, problem.labels_q)
    expected = tests[0] @ np.linalg.pinv(train.gram) @ (train.features * train.loss_weights[:, None]).T
    assert relative_error(attributor.scores(features=tests), expected) < 1e-5
    ridged = attributor.with_ridge(0.5)
    assert ridged.train is not attributor.train and ridged.train[0] is train and ridged.fitted[0].method == "cholesky"
    lam = 0.5 * np.trace(train.gram) / train.rows
    assert ridged.fitted[0].lam == pytest.approx(lam)


def test_scoring_refuses_features_that_do_not_fit_together(problem: Problem) -> None:
    a = train_features(problem.model, problem.x, problem.labels, options=AttributionOptions(dim=16))
    b = train_features(problem.model, problem.x[:10], problem.labels[:10], options=AttributionOptions(dim=16))
    fitted = [fit_checkpoint(a), fit_checkpoint(b)]
    with pytest.raises(ShapeMismatch, match="checkpoint 1 has features of N=10"):
        list(iter_score_tiles(fitted, [np.zeros((3, 16)), np.zeros((3, 16))]))
    with pytest.raises(ShapeMismatch, match=r"shape \(3, 8\), expected \(3, 16\)"):
        list(iter_score_tiles([fitted[0]], [np.zeros((3, 8))]))
    with pytest.raises(InvalidInput, match="2 test feature sets for 1 checkpoints"):
        list(iter_score_tiles([fitted[0]], [np.zeros((3, 16))] * 2))
    with pytest.raises(InvalidInput, match="ensemble must be one of"):
        self_influence_scores([fitted[0]], ensemble="median")
    with pytest.raises(InvalidInput, match="ridge must be a finite number"):
        fit_checkpoint(a, -1.0)


def test_tile_plans_fit_the_budget_at_the_issues_scale() -> None:
    # 10⁵ training × 10⁴ test examples, D = 2048, 10 checkpoints, 4 GB: the dense float32 matrix alone is 4 GB
    budget = 4 * 10**9
    plan = plan_score_tiles(100_000, 10_000, 2048, 10, budget)
    assert plan.bytes <= budget and plan.bytes == score_memory(plan.train_rows, 10_000, plan.test_rows, 2048, 10)
    assert plan.train_rows >= 1024 and plan.test_rows == 10_000
    small = plan_score_tiles(100_000, 10_000, 2048, 10, 10**9)
    assert small.bytes <= 10**9 and small.train_rows < plan.train_rows
    with pytest.raises(MemoryEstimateExceeded, match="the solved test features"):
        plan_score_tiles(100_000, 10_000, 2048, 10, 10**8)


def test_blocks_scored_one_at_a_time_from_a_stored_side_equal_the_tiles(problem: Problem, tmp_path: Path) -> None:
    """The attribution job's path: G' read from a zarr store, F memory-mapped, the test features solved once and
    the training rows scored block by block (``solve_targets`` + ``score_train_rows``), in any order."""
    options = AttributionOptions(dim=16)
    side = train_features(problem.model, problem.x, problem.labels, options=options)
    store = zarr.open_group(str(tmp_path / "side.zarr"), mode="w")
    store.create_array("features", shape=side.features.shape, chunks=(5, 16), dtype=side.features.dtype)
    store["features"][:] = side.features  # type: ignore[index]
    np.save(tmp_path / "gram.npy", side.gram)
    stored = dataclasses.replace(side, features=store["features"], gram=np.load(tmp_path / "gram.npy", mmap_mode="r"))
    tests = [target_features(problem.model, problem.xq, problem.labels_q, train=side, options=options)]
    expected = list(iter_score_tiles([fit_checkpoint(side)], tests, train_rows=7))
    fitted = [fit_checkpoint(stored)]
    solved = solve_targets(fitted, tests)
    for j0 in (21, 7, 0, 14):  # out of order: each block stands alone
        (tile,) = score_train_rows(fitted, solved, (j0, min(24, j0 + 7)))
        np.testing.assert_array_equal(tile.block, expected[j0 // 7].block)
        assert (tile.test_start, tile.train_start) == (0, j0)
