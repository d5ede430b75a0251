"""Output functions and loss weights: TRAK's margin gradient and Q against finite differences and the softmax
identity written out by hand; labels of the wrong shape or kind are refused with a message that says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ntk_service.attribution.options import AttributionLoss
from ntk_service.attribution.targets import check_labels, measurement_weights, train_weights
from ntk_service.errors import InvalidInput, NonFiniteInput, ShapeMismatch

CE, MSE = AttributionLoss.CROSS_ENTROPY, AttributionLoss.MSE


def _margin(f: np.ndarray, y: int) -> float:
    others = np.delete(f, y)
    return float(f[y] - (others.max() + np.log(np.exp(others - others.max()).sum())))


def test_the_margin_rows_are_the_margins_gradient_and_q_times_them_is_minus_the_loss_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 3
    y = torch.tensor([0, 3, 1, 2, 3])
    weights = train_weights(f, y, CE)
    assert weights.rows is not None
    eps = 1e-6
    for n in range(5):
        for a in range(4):
            up, down = f[n].numpy().copy(), f[n].numpy().copy()
            up[a] += eps
            down[a] -= eps
            numeric = (_margin(up, int(y[n])) - _margin(down, int(y[n]))) / (2 * eps)
            assert abs(float(weights.rows[n, a]) - numeric) < 1e-7
    p = np.exp(f.numpy()) / np.exp(f.numpy()).sum(axis=1, keepdims=True)
    onehot = np.eye(4)[y.numpy()]
    np.testing.assert_allclose(weights.loss.numpy(), 1 - p[np.arange(5), y.numpy()], rtol=1e-12)
    np.testing.assert_allclose(weights.loss.numpy()[:, None] * weights.rows.numpy(), onehot - p, atol=1e-12)


def test_confident_logits_stay_finite() -> None:
    f = torch.tensor([[1000.0, -1000.0, 0.0], [-800.0, 800.0, 799.0]])
    weights = train_weights(f, torch.tensor([0, 2]), CE)
    assert weights.rows is not None and torch.isfinite(weights.rows).all() and torch.isfinite(weights.loss).all()
    assert float(weights.loss[0]) == 0.0 and abs(float(weights.loss[1]) - 1 / (1 + np.exp(-1))) < 1e-12


def test_mse_rows_are_all_outputs_and_the_weights_are_residuals() -> None:
    f, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 3.0]], dtype=torch.float64)
    weights = train_weights(f, y, MSE)
    assert weights.rows is None
    np.testing.assert_array_equal(weights.loss.numpy(), [[-0.5, 1.0]])
    np.testing.assert_array_equal(measurement_weights(f, y, MSE).numpy(), [[-0.5, 1.0]])
    with pytest.raises(InvalidInput, match="y_test"):
        measurement_weights(f, None, MSE)


def test_an_unlabelled_test_example_is_measured_at_its_predicted_class() -> None:
    f = torch.tensor([[0.1, 2.0, -1.0]])
    np.testing.assert_array_equal(
        measurement_weights(f, None, CE).numpy(), measurement_weights(f, torch.tensor([1]), CE).numpy()
    )


@pytest.mark.parametrize(
    ("y", "loss", "error", "match"),
    [
        (torch.zeros(4, 1, dtype=torch.int64), CE, ShapeMismatch, r"shape \(4, 1\), expected \(4,\)"),
        (torch.zeros(4), CE, InvalidInput, "integer class indices"),
        (torch.tensor([0, 1, 3, 0]), CE, InvalidInput, r"y_train\[2\] = 3 is not a class index in \[0, 3\)"),
        (torch.tensor([0, -1, 1, 0]), CE, InvalidInput, r"y_train\[1\] = -1"),
        (torch.zeros(4, 2), MSE, ShapeMismatch, r"shape \(4, 2\), expected \(4, 3\)"),
        (torch.zeros(3, 3), MSE, ShapeMismatch, r"shape \(3, 3\)"),
        (torch.full((4, 3), float("nan")), MSE, NonFiniteInput, "NaN"),
        (np.array([["a"] * 3] * 4), MSE, InvalidInput, "must be an array of numbers"),
        (torch.zeros(4, 3, dtype=torch.bool), MSE, InvalidInput, "must hold numbers"),
    ],
)
def test_labels_of_the_wrong_shape_or_kind_are_refused(
    y: object, loss: AttributionLoss, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        check_labels(y, n=4, out_shape=(3,), loss=loss, name="y_train", operation="attribution")


def test_cross_entropy_needs_class_logits_and_a_scalar_regression_takes_flat_targets() -> None:
    with pytest.raises(InvalidInput, match="at least 2 outputs"):
        check_labels(torch.zeros(4, dtype=torch.int64), n=4, out_shape=(1,), loss=CE, name="y", operation="op")
    flat = check_labels(torch.arange(4.0), n=4, out_shape=(1,), loss=MSE, name="y", operation="op")
    assert flat.shape == (4, 1) and flat.dtype == torch.float64
    image = check_labels(torch.zeros(4, 2, 3), n=4, out_shape=(2, 3), loss=MSE, name="y", operation="op")
    assert image.shape == (4, 6)
