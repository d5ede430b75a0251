"""The linear datamodeling score against scipy's Spearman correlation, test example by test example."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from ntk_service.attribution import linear_datamodeling_score
from ntk_service.errors import InvalidInput, ShapeMismatch


def test_lds_is_the_mean_spearman_correlation_of_summed_scores_and_outputs() -> None:
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((7, 30))
    masks = rng.random((25, 30)) < 0.5
    outputs = masks @ scores.T + rng.standard_normal((25, 7))  # a datamodel plus noise
    outputs[:5, 2] = outputs[0, 2]  # ties in one column
    result = linear_datamodeling_score(scores, masks, outputs)
    expected = [spearmanr(masks @ scores[i], outputs[:, i]).statistic for i in range(7)]
    np.testing.assert_allclose(result.per_example, expected, rtol=1e-12)
    assert result.mean == pytest.approx(np.mean(expected))
    assert 0.3 < result.mean < 1


def test_constant_columns_are_left_out_of_the_mean() -> None:
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((3, 10))
    masks = rng.random((8, 10)) < 0.5
    outputs = rng.standard_normal((8, 3))
    outputs[:, 1] = 4.0
    result = linear_datamodeling_score(scores, masks, outputs)
    assert np.isnan(result.per_example[1])
    assert result.mean == pytest.approx(np.nanmean(result.per_example))


def test_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ShapeMismatch, match="do not fit together"):
        linear_datamodeling_score(np.zeros((3, 10)), np.zeros((8, 9)), np.zeros((8, 3)))
    with pytest.raises(ShapeMismatch, match="expected scores"):
        linear_datamodeling_score(np.zeros(10), np.zeros((8, 10)), np.zeros((8, 1)))
    with pytest.raises(InvalidInput, match="at least 3 subsets"):
        linear_datamodeling_score(np.zeros((3, 10)), np.zeros((2, 10)), np.zeros((2, 3)))
    with pytest.raises(InvalidInput, match="finite"):
        linear_datamodeling_score(np.full((3, 10), np.nan), np.zeros((4, 10)), np.zeros((4, 3)))
