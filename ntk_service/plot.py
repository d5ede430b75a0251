"""Pictures of what Θ says: a kernel heatmap, a spectrum on a log scale, training curves (``pip install
'ntk-service[plot]'`` for matplotlib).

Each function returns a ``matplotlib.figure.Figure`` built without pyplot (no global figure state, no display
backend), so it works in servers, scripts and notebooks alike; ``save_figure`` writes a PNG.

    >>> fig = plot_kernel(theta)                     # (N, N, k, k) -> the (N·k, N·k) matrix   # doctest: +SKIP
    >>> save_figure(plot_spectrum(spectrum(theta).eigenvalues), "spectrum.png")             # doctest: +SKIP
    >>> save_figure(plot_training(pred.times, pred.test, given_times, given_test), "curves.png")  # doctest: +SKIP
    >>> save_figure(plot_lazy_training([cmp16, cmp256], labels=["w=16", "w=256"]), "lazy.png")   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ntk_service._tensors import is_torch_tensor
from ntk_service.errors import InvalidInput, NonFiniteInput, OptionalDependencyMissing, ShapeMismatch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["DEFAULT_MAX_CURVES", "plot_kernel", "plot_lazy_training", "plot_spectrum", "plot_training", "save_figure"]

DEFAULT_MAX_CURVES = 6
"""Training curves drawn by default (examples × outputs, in order): more lines than this stop being readable."""

_DPI = 120


def _figure(width: float = 6.0, height: float = 4.5) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise OptionalDependencyMissing(
            "ntk_service.plot needs matplotlib; install it with pip install 'ntk-service[plot]'"
        ) from exc
    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def _kernel_matrix(theta: Any) -> np.ndarray:
    """``analysis.as_matrix`` with numpy alone: (N·k, M·k) float64 with row n·k + a for a FULL kernel, the (N, M)
    TRACE kernel itself. Not imported from ``ntk_service.analysis``, which loads the engine (torch) for its modes:
    plotting a kernel file must work in a client-only install with the [plot] extra (tests/cli/test_plot_cli.py)."""
    if is_torch_tensor(theta):
        theta = theta.detach().cpu().double().numpy()
    matrix = np.asarray(theta, dtype=np.float64)
    if matrix.ndim == 4 and matrix.shape[2] == matrix.shape[3]:
        n, m, k, _ = matrix.shape
        matrix = np.ascontiguousarray(matrix.transpose(0, 2, 1, 3)).reshape(n * k, m * k)
    elif matrix.ndim != 2:
        raise ShapeMismatch(
            f"plot_kernel: theta has shape {matrix.shape}; expected a FULL kernel (N, M, k, k) or a TRACE kernel (N, M)"
        )
    if not np.all(np.isfinite(matrix)):
        raise NonFiniteInput("plot_kernel: theta has NaN or infinite entries")
    return matrix


def plot_kernel(theta: Any, *, title: str | None = None, symmetric_scale: bool = True) -> Figure:
    """A heatmap of a kernel as the matrix of NOTE [layout] (``analysis/layout.py``).

    Args:
        theta: (N, M, k, k) FULL (drawn as (N·k, M·k), row n·k + a) or (N, M) TRACE, numpy or torch.
        title: the axes title. Default: the shape and the layout.
        symmetric_scale: a diverging colour map centred on 0 (kernels have signed off-diagonal entries).
            Default: True.

    Returns:
        The figure (one image axes and a colour bar).

    Raises:
        ShapeMismatch: not a FULL or TRACE kernel. NonFiniteInput: NaN or ±inf entries.
    """
    matrix = _kernel_matrix(theta)
    fig = _figure(6.0, 5.0)
    ax = fig.add_subplot()
    bound = float(np.max(np.abs(matrix))) or 1.0
    kwargs = {"cmap": "RdBu_r", "vmin": -bound, "vmax": bound} if symmetric_scale else {"cmap": "viridis"}
    image = ax.imshow(matrix, interpolation="nearest", **kwargs)
    fig.colorbar(image, ax=ax, shrink=0.85, label="Θ")
    layout = "rows n·k + a" if np.ndim(theta) == 4 else "trace over outputs"
    ax.set_title(title or f"kernel {matrix.shape[0]}×{matrix.shape[1]} ({layout})")
    ax.set_xlabel("column")
    ax.set_ylabel("row")
    return fig


def plot_spectrum(
    eigenvalues: Any | Sequence[Any], *, labels: Sequence[str] | None = None, title: str | None = None
) -> Figure:
    """Eigenvalues in descending order on a log scale (one curve per spectrum).

    Args:
        eigenvalues: (r,) eigenvalues, or a list of them to compare (e.g. checkpoints). Non-positive values cannot
            be drawn on a log axis: they are counted in the legend instead.
        labels: one per spectrum. Default: "spectrum 1", ...
        title: Default: "kernel spectrum".
    """
    spectra = (
        [np.asarray(eigenvalues, dtype=np.float64)]
        if np.ndim(eigenvalues[0]) == 0
        else [np.asarray(e, dtype=np.float64) for e in eigenvalues]
    )
    if labels is not None and len(labels) != len(spectra):
        raise InvalidInput(f"plot_spectrum: {len(labels)} labels for {len(spectra)} spectra")
    fig = _figure()
    ax = fig.add_subplot()
    for i, values in enumerate(spectra):
        values = np.sort(values)[::-1]
        positive = values[values > 0]
        label = labels[i] if labels is not None else f"spectrum {i + 1}"
        dropped = values.size - positive.size
        if dropped:
            label += f" ({dropped} ≤ 0 not shown)"
        ax.plot(np.arange(1, positive.size + 1), positive, marker="o", markersize=3, linewidth=1, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("index i (descending)")
    ax.set_ylabel("eigenvalue λ_i")
    ax.set_title(title or "kernel spectrum")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _finite(times: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(times)
    return times[keep], values[keep]


def plot_training(
    times: Any,
    predictions: Any,
    given_times: Any = None,
    given: Any = None,
    *,
    max_curves: int = DEFAULT_MAX_CURVES,
    title: str | None = None,
    time_label: str = "time t",
) -> Figure:
    """Training curves: the linearized outputs over time (lines) beside given outputs (markers), e.g. the real
    network trained with the same optimizer.

    Args:
        times: (T,) times or steps of ``predictions`` (``inf`` is drawn as a dotted horizontal line).
        predictions: (T, N, k) outputs (``LinearizedPredictions.train`` / ``.test``).
        given_times, given: (T',) and (T', N, k) outputs to compare with. Default: none.
        max_curves: how many (example, output) curves to draw, in order. Default: 6.
        title, time_label: labels. Default: "linearized vs given outputs", "time t".

    Raises:
        ShapeMismatch: predictions not (T, N, k) matching ``times``, or ``given`` of another (N, k).
    """
    t = np.asarray(times, dtype=np.float64).reshape(-1)
    pred = np.asarray(predictions, dtype=np.float64)
    if pred.ndim != 3 or pred.shape[0] != t.size:
        raise ShapeMismatch(f"plot_training: predictions have shape {pred.shape}; expected ({t.size}, N, k)")
    other = None if given is None else np.asarray(given, dtype=np.float64)
    other_t = None if given_times is None else np.asarray(given_times, dtype=np.float64).reshape(-1)
    if other is not None and (other_t is None or other.shape[1:] != pred.shape[1:] or other.shape[0] != other_t.size):
        raise ShapeMismatch(
            f"plot_training: given has shape {None if other is None else other.shape} with "
            f"{None if other_t is None else other_t.size} times; expected (T', {pred.shape[1]}, {pred.shape[2]})"
        )
    fig = _figure(7.0, 4.5)
    ax = fig.add_subplot()
    colors = [f"C{i}" for i in range(10)]
    pairs = [(n, a) for n in range(pred.shape[1]) for a in range(pred.shape[2])][:max_curves]
    for i, (n, a) in enumerate(pairs):
        color = colors[i % len(colors)]
        ft, fv = _finite(t, pred[:, n, a])
        ax.plot(ft, fv, color=color, linewidth=1.5, label=f"linearized x{n}[{a}]")
        if np.any(np.isinf(t)):
            ax.axhline(float(pred[np.isinf(t)][0, n, a]), color=color, linestyle=":", linewidth=1)
        if other is not None and other_t is not None:
            gt, gv = _finite(other_t, other[:, n, a])
            ax.plot(gt, gv, color=color, linestyle="none", marker="o", markersize=3.5, label=f"given x{n}[{a}]")
    positive = t[np.isfinite(t) & (t > 0)]
    if positive.size and positive.max() / positive.min() > 100:  # steps 1..1000: a log-like axis, 0 kept linear
        ax.set_xscale("symlog", linthresh=float(positive.min()))
        ax.set_xlim(left=0, right=float(positive.max()) * 1.1)  # times are ≥ 0: no empty negative half
    ax.set_xlabel(time_label)
    ax.set_ylabel("output")
    heading = title or ("linearized vs given outputs" if other is not None else "linearized outputs")
    ax.set_title(heading + (" (dotted: t = ∞)" if np.any(np.isinf(t)) else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, never over the curves
    return fig


_COMPARISON_FIELDS = (
    "steps",
    "train_gap",
    "test_gap",
    "network_loss",
    "linearized_loss",
    "kernel_steps",
    "kernel_distance",
    "kernel_mode",
)
"""The fields of ``analysis.TrainingComparison`` the plot reads (checked on entry: the plot is drawn from them)."""


def _comparisons(comparisons: Any) -> list[Any]:
    items = list(comparisons) if isinstance(comparisons, (list, tuple)) else [comparisons]
    for item in items:
        missing = [name for name in _COMPARISON_FIELDS if not hasattr(item, name)]
        if missing:
            raise InvalidInput(
                f"plot_lazy_training: expected analysis.compare_training results, got {type(item).__name__} "
                f"without {', '.join(missing)}"
            )
    if not items:
        raise InvalidInput("plot_lazy_training: no comparison to draw; pass compare_training's result(s)")
    return items


def plot_lazy_training(
    comparisons: Any, *, labels: Sequence[str] | None = None, title: str | None = None, relative: bool = False
) -> Figure:
    """The lazy-training diagnostic: the network-vs-linearization gap, both losses, and the kernel's motion.

    Three panels against the step: (1) the RMS gap f_network − f_linearized on train (solid) and test (dashed),
    on a log scale; (2) the training loss of the network (solid) and the linearization (dotted); (3) the kernel
    distance 1 − cos(Θ_0, Θ_s) at the kernel steps, on a log scale (step 0, where it is 0, is not drawn). One
    colour per comparison (e.g. per width).

    Args:
        comparisons: one ``TrainingComparison`` (``analysis.compare_training``) or a list of them.
        labels: one per comparison. Default: "run 1", ...
        title: the figure title. Default: "network vs its linearization".
        relative: divide each gap by how far the network's outputs moved on that set (``train_moved``,
            ``test_moved``), so runs of different output scale compare. Default: False.

    Returns:
        The figure (three axes).

    Raises:
        InvalidInput: no comparison, an object without compare_training's fields, labels of the wrong count.
    """
    items = _comparisons(comparisons)
    if labels is not None and len(labels) != len(items):
        raise InvalidInput(f"plot_lazy_training: {len(labels)} labels for {len(items)} comparisons")
    fig = _figure(12.0, 4.0)
    gap_ax, loss_ax, kernel_ax = fig.subplots(1, 3)
    for i, item in enumerate(items):
        color, label = f"C{i % 10}", labels[i] if labels is not None else f"run {i + 1}"
        steps = np.asarray(item.steps, dtype=np.float64)
        ones = np.ones_like(steps)
        scale = np.asarray(item.train_moved, dtype=np.float64) if relative else ones
        test_moved = getattr(item, "test_moved", None)
        test_scale = np.asarray(test_moved, dtype=np.float64) if relative and test_moved is not None else ones
        with np.errstate(divide="ignore", invalid="ignore"):
            train = np.asarray(item.train_gap, dtype=np.float64) / scale
            test = None if item.test_gap is None else np.asarray(item.test_gap, dtype=np.float64) / test_scale
        keep = steps > 0  # the gap is exactly 0 at step 0: nothing to draw on a log axis
        gap_ax.plot(steps[keep], train[keep], color=color, label=f"{label} train")
        if test is not None:
            gap_ax.plot(steps[keep], test[keep], color=color, linestyle="--", label=f"{label} test")
        loss_ax.plot(steps, item.network_loss, color=color, label=f"{label} network")
        loss_ax.plot(steps, item.linearized_loss, color=color, linestyle=":", label=f"{label} linearized")
        distance = np.asarray(item.kernel_distance, dtype=np.float64)
        shown = distance > 0  # Θ_0 against itself is exactly 0: nothing to draw on a log axis
        kernel_steps = np.asarray(item.kernel_steps)[shown]
        kernel_ax.plot(kernel_steps, distance[shown], color=color, marker="o", markersize=4, label=label)
    gap_ax.set_yscale("log")
    gap_ax.set_ylabel("gap / RMS movement" if relative else "RMS gap ‖f − f_lin‖")
    gap_ax.set_title("network − linearization")
    loss_ax.set_ylabel("training loss")
    loss_ax.set_title("loss (dotted: linearized)")
    kernel_ax.set_yscale("log")
    kernel_ax.set_ylabel("1 − cos(Θ_0, Θ_s)")
    kernel_ax.set_title(f"kernel distance ({items[0].kernel_mode})")
    for ax in (gap_ax, loss_ax, kernel_ax):
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "network vs its linearization")
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (or the format of the suffix) and return the path.

    Raises:
        InvalidInput: the file cannot be written.
    """
    target = Path(path)
    try:
        fig.savefig(target, dpi=_DPI)
    except OSError as exc:
        raise InvalidInput(f"save_figure: cannot write {str(target)!r} ({exc.strerror or exc})") from exc
    return target
