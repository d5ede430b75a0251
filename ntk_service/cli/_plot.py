"""``ntk-service plot heatmap|spectrum|training``: PNGs from saved kernels, eigenvalues and predictions.

    $ ntk-service kernel mlp --x1 x.npy -o theta.npy && ntk-service plot heatmap theta.npy -o theta.png
    $ ntk-service analyze spectrum mlp --x x.npy -o eig.npy && ntk-service plot spectrum eig.npy -o spectrum.png
    $ ntk-service analyze predict mlp ... -o pred.npz && ntk-service plot training pred.npz -o curves.png

Needs matplotlib (``pip install 'ntk-service[plot]'``); runs locally, no server, and without torch (a client-only
install): only the eigenvalues of a square kernel file are computed with the engine's install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ntk_service.cli._app import UsageError
from ntk_service.cli._inputs import read_npy

__all__ = ["plot_app"]

plot_app = typer.Typer(
    help="Plot kernels, spectra and training curves to PNG files (needs ntk-service[plot]).",
    no_args_is_help=True,
    rich_markup_mode=None,
)

OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="The PNG to write.", dir_okay=False)]


def _save(fig: Any, output: Path) -> None:
    from ntk_service.plot import save_figure

    save_figure(fig, output)
    typer.echo(f"wrote {output}")


def _npz(path: Path, *, option: str) -> dict[str, Any]:
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:
        raise UsageError(f"{option}: cannot read {str(path)!r} as .npz ({exc})") from exc


@plot_app.command()
def heatmap(
    kernel: Annotated[Path, typer.Argument(help="A kernel .npy: (N, M, k, k) full or (N, M) trace.")],
    output: OutputOpt,
    title: Annotated[str | None, typer.Option(help="Title. Default: the shape and layout.")] = None,
) -> None:
    """A heatmap of the kernel as the (N·k, M·k) matrix, row n·k + a."""
    from ntk_service.plot import plot_kernel

    _save(plot_kernel(read_npy(kernel, option="KERNEL"), title=title), output)


@plot_app.command("spectrum")
def spectrum_plot(
    files: Annotated[list[Path], typer.Argument(help="Eigenvalue .npy files (r,), or square kernels (computed).")],
    output: OutputOpt,
    label: Annotated[list[str] | None, typer.Option("--label", help="One label per file.")] = None,
) -> None:
    """Eigenvalues on a log scale, one curve per file (e.g. one per checkpoint)."""
    from ntk_service.plot import plot_spectrum

    spectra = []
    for path in files:
        array = read_npy(path, option="FILES")
        spectra.append(array if array.ndim == 1 else _eigenvalues(array, path))
    _save(plot_spectrum(spectra, labels=label or [p.stem for p in files]), output)


def _eigenvalues(kernel: Any, path: Path) -> Any:
    """``analysis.spectrum`` of a square kernel file, imported only here: it needs the engine's install (torch,
    scipy), which the other plots do not."""
    try:
        from ntk_service.analysis import spectrum
    except ImportError as exc:  # a client-only install with the [plot] extra
        raise UsageError(
            f"FILES: {str(path)!r} is a kernel, and computing its eigenvalues here needs "
            f"pip install 'ntk-service[server]' ({exc}); or plot the eigenvalues `ntk-service analyze spectrum -o` "
            "wrote (the server computes them)"
        ) from exc
    return spectrum(kernel).eigenvalues


@plot_app.command()
def training(
    predictions: Annotated[Path, typer.Argument(help="The .npz of `analyze predict -o` (times, train, test).")],
    output: OutputOpt,
    given: Annotated[
        Path | None, typer.Option(help=".npz with times and train/test of the real network, drawn as dots.")
    ] = None,
    split: Annotated[str, typer.Option(help="train or test outputs.")] = "test",
    max_curves: Annotated[int, typer.Option(min=1, help="(example, output) curves to draw.")] = 6,
) -> None:
    """Linearized outputs over time, beside the given ones."""
    from ntk_service.plot import plot_training

    if split not in ("train", "test"):
        raise UsageError(f"--split: expected train or test, got {split!r}")
    pred = _npz(predictions, option="PREDICTIONS")
    if split not in pred or "times" not in pred:
        raise UsageError(f"PREDICTIONS: {str(predictions)!r} has no times/{split} arrays (it has {sorted(pred)})")
    other = None if given is None else _npz(given, option="--given")
    if other is not None and (split not in other or "times" not in other):
        raise UsageError(f"--given: {str(given)!r} needs times and {split} arrays (it has {sorted(other)})")
    fig = plot_training(
        pred["times"],
        pred[split],
        None if other is None else other["times"],
        None if other is None else other[split],
        max_curves=max_curves,
        title=f"{split} outputs: linearized" + (" (lines) vs given (dots)" if other is not None else ""),
    )
    _save(fig, output)
