"""Top-k proponents and opponents from tiles equal numpy's sort of the dense scores, whatever the tiling."""

from __future__ import annotations

import numpy as np
import pytest

from ntk_service.attribution import AttributionOptions, RunningTop, ScoreTile, fit_attributor, top_influences
from ntk_service.errors import InvalidInput
from tests.attribution.conftest import Problem


def _tiles(scores: np.ndarray, rows: int, cols: int) -> list[ScoreTile]:
    return [
        ScoreTile(i, j, scores[i : i + rows, j : j + cols])
        for j in range(0, scores.shape[1], cols)
        for i in range(0, scores.shape[0], rows)
    ]


@pytest.mark.parametrize(("rows", "cols"), [(9, 50), (4, 7), (1, 1), (3, 2)])
def test_top_influences_equal_the_sorted_dense_scores(rows: int, cols: int) -> None:
    scores = np.random.default_rng(0).standard_normal((9, 50)).astype(np.float32)  # distinct values: no ties
    top = top_influences(_tiles(scores, rows, cols), n_test=9, n_train=50, k=5)
    order = np.argsort(-scores, axis=1)
    np.testing.assert_array_equal(top.proponents, order[:, :5])
    np.testing.assert_array_equal(top.proponent_scores, np.take_along_axis(scores, order[:, :5], 1))
    np.testing.assert_array_equal(top.opponents, order[:, ::-1][:, :5])
    np.testing.assert_array_equal(top.opponent_scores, np.take_along_axis(scores, order[:, ::-1][:, :5], 1))


def test_k_equal_to_n_sorts_everything() -> None:
    scores = np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32)
    top = top_influences(_tiles(scores, 1, 4), n_test=2, n_train=6, k=6)
    np.testing.assert_array_equal(top.proponents, np.argsort(-scores, axis=1))


def test_bad_k_and_incomplete_tiles_are_refused() -> None:
    scores = np.zeros((2, 6), dtype=np.float32)
    with pytest.raises(InvalidInput, match=r"k must be an integer in \[1, N=6\], got 7"):
        top_influences(_tiles(scores, 2, 6), n_test=2, n_train=6, k=7)
    with pytest.raises(InvalidInput, match="pass every tile exactly once"):
        top_influences(_tiles(scores, 2, 3)[:1], n_test=2, n_train=6, k=2)
    with pytest.raises(InvalidInput, match="lies outside"):
        top_influences([ScoreTile(1, 0, np.zeros((2, 6), dtype=np.float32))], n_test=2, n_train=6, k=2)


def test_the_attributor_streams_top_influences_through_tiles(problem: Problem) -> None:
    attributor = fit_attributor(
        problem.model,
        problem.x,
        problem.labels,
        options=AttributionOptions(features="exact", memory_budget_bytes=2**30),
    )
    dense = attributor.scores(problem.xq, problem.labels_q)
    top = attributor.top_influences(problem.xq, problem.labels_q, k=3)
    assert top.proponents.shape == top.opponents.shape == (6, 3)
    np.testing.assert_allclose(top.proponent_scores, -np.sort(-dense, axis=1)[:, :3], rtol=1e-5)
    np.testing.assert_allclose(top.opponent_scores, np.sort(dense, axis=1)[:, :3], rtol=1e-5)


def test_a_running_top_saved_and_restored_mid_stream_gives_the_same_answer() -> None:
    scores = np.random.default_rng(2).standard_normal((9, 50)).astype(np.float32)
    tiles = _tiles(scores, 4, 7)  # test rows in three groups of different widths as the stream goes
    whole = top_influences(tiles, n_test=9, n_train=50, k=5)
    running = RunningTop(n_test=9, n_train=50, k=5)
    for tile in tiles[:11]:
        running.add(tile)
    restored = RunningTop.from_arrays(running.arrays(), n_test=9, n_train=50, k=5)
    for tile in tiles[11:]:
        restored.add(tile)
    again = restored.result()
    for name in ("proponents", "proponent_scores", "opponents", "opponent_scores"):
        np.testing.assert_array_equal(getattr(again, name), getattr(whole, name))
    with pytest.raises(InvalidInput, match="pass every tile exactly once"):
        RunningTop.from_arrays(running.arrays(), n_test=9, n_train=50, k=5).result()
