"""ntk_service.plot: each figure holds the data it claims (the image is as_matrix's layout, the spectrum's
points are the positive eigenvalues in order, the curves are the predictions) and saves as a PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from ntk_service.errors import InvalidInput, ShapeMismatch  # noqa: E402
from ntk_service.plot import plot_kernel, plot_lazy_training, plot_spectrum, plot_training, save_figure  # noqa: E402
from tests.analysis.conftest import Features  # noqa: E402


def test_heatmap_shows_the_example_major_matrix(features: Features, tmp_path: Path) -> None:
    fig = plot_kernel(features.theta)
    image = fig.axes[0].images[0].get_array()
    np.testing.assert_allclose(np.asarray(image), features.matrix, atol=1e-14)
    path = save_figure(fig, tmp_path / "heat.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_spectrum_plots_positive_eigenvalues_in_descending_order() -> None:
    values = np.array([0.5, 3.0, -1.0, 0.0, 10.0])
    fig = plot_spectrum([values, values * 2], labels=["a", "b"])
    ax = fig.axes[0]
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), [10.0, 3.0, 0.5])
    np.testing.assert_array_equal(ax.lines[1].get_ydata(), [20.0, 6.0, 1.0])
    assert ax.get_yscale() == "log"
    assert "2 ≤ 0 not shown" in ax.get_legend().get_texts()[0].get_text()


def test_training_curves_hold_the_predictions() -> None:
    times = np.array([0.0, 1.0, 10.0, 1000.0, np.inf])
    pred = np.random.default_rng(0).standard_normal((5, 3, 2))
    given = pred[:4] + 0.1
    fig = plot_training(times, pred, times[:4], given, max_curves=2)
    ax = fig.axes[0]
    lines = [line for line in ax.lines if line.get_linestyle() == "-"]
    np.testing.assert_array_equal(lines[0].get_ydata(), pred[:4, 0, 0])  # inf is drawn as a horizontal line
    np.testing.assert_array_equal(lines[1].get_ydata(), pred[:4, 0, 1])
    dots = [line for line in ax.lines if line.get_marker() == "o"]
    np.testing.assert_array_equal(dots[0].get_ydata(), given[:, 0, 0])
    assert ax.get_xscale() == "symlog"
    with pytest.raises(ShapeMismatch, match="expected \\(5, N, k\\)"):
        plot_training(times, pred[:3], None, None)


def test_lazy_training_panels_hold_the_comparison(tmp_path: Path) -> None:
    from types import SimpleNamespace

    steps = np.arange(6)
    run = SimpleNamespace(
        steps=steps,
        train_gap=np.array([0.0, 1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3]),
        test_gap=np.array([0.0, 2e-4, 3e-4, 5e-4, 9e-4, 2e-3]),
        train_moved=np.array([0.0, 0.1, 0.2, 0.4, 0.8, 1.6]),
        test_moved=np.array([0.0, 0.2, 0.3, 0.5, 0.9, 2.0]),
        network_loss=np.linspace(1.1, 0.5, 6),
        linearized_loss=np.linspace(1.1, 0.6, 6),
        kernel_steps=np.array([0, 5]),
        kernel_distance=np.array([0.0, 0.02]),
        kernel_mode="trace",
    )
    fig = plot_lazy_training([run, run], labels=["w=8", "w=64"])
    gap_ax, loss_ax, kernel_ax = fig.axes
    np.testing.assert_array_equal(gap_ax.lines[0].get_xdata(), steps[1:])  # step 0's exact zero is left out
    np.testing.assert_array_equal(gap_ax.lines[0].get_ydata(), run.train_gap[1:])
    np.testing.assert_array_equal(gap_ax.lines[1].get_ydata(), run.test_gap[1:])
    assert gap_ax.get_yscale() == "log"
    np.testing.assert_array_equal(loss_ax.lines[1].get_ydata(), run.linearized_loss)
    np.testing.assert_array_equal(kernel_ax.lines[0].get_ydata(), [0.02])  # the exact 0 of step 0 left out
    np.testing.assert_array_equal(kernel_ax.lines[0].get_xdata(), [5])
    assert kernel_ax.get_yscale() == "log"
    rel = plot_lazy_training(run, relative=True).axes[0]
    np.testing.assert_allclose(rel.lines[0].get_ydata(), run.train_gap[1:] / run.train_moved[1:])
    np.testing.assert_allclose(rel.lines[1].get_ydata(), run.test_gap[1:] / run.test_moved[1:])
    assert save_figure(fig, tmp_path / "lazy.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(InvalidInput, match="without steps"):
        plot_lazy_training(object())
    with pytest.raises(InvalidInput, match="1 labels for 2 comparisons"):
        plot_lazy_training([run, run], labels=["a"])
