"""``ntk-service nngp | monte-carlo | matvec``: the kernel family of a registered model, written as .npy.

    $ ntk-service nngp mlp --x1 x.npy --layer activation --mode trace -o k.npy      # (N, N) conjugate kernel
    $ ntk-service monte-carlo mlp --x1 x.npy --seeds 0-15 --mode trace -o mc.npy    # mean; mc.stderr.npy beside
    $ ntk-service matvec mlp --x1 x.npy --v v.npy -o y.npy                           # (N, k) = Θ v

The pseudo-NTK is ``ntk-service kernel ... --mode pseudo``.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ntk_service.cli._app import JsonFlag, ModelArg, UsageError, app, print_json, state_of, wants_json
from ntk_service.cli._inputs import read_side
from ntk_service.cli._kernel import Dtype, Mode
from ntk_service.cli._output import write_output
from ntk_service.vocabulary import OPERATOR_MODES, OperatorModeName, mode_help

if TYPE_CHECKING:  # the client (httpx, numpy) is imported when a command runs, not for --help
    from ntk_service.client import DtypeName

__all__ = ["MAX_SEEDS", "KernelKind", "OperatorMode", "matvec", "monte_carlo", "nngp"]

_PRINT_LIMIT = 1000
"""Without -o, a result of at most this many values is printed; a bigger one needs a file."""

_SIDE_HELP = "a .npy file of shape ({rows}, *input), or dataset:<id>[start:stop]"

X1Option = Annotated[str, typer.Option("--x1", help="x1: " + _SIDE_HELP.format(rows="N"), show_default=False)]
X2Option = Annotated[str | None, typer.Option("--x2", help="x2: " + _SIDE_HELP.format(rows="M") + ". Default: x1.")]
DtypeOption = Annotated[Dtype | None, typer.Option(help="Compute dtype. Default: the model's.", show_default=False)]
OutputOption = Annotated[
    Path | None, typer.Option("--output", "-o", help="Write the result to this .npy file.", dir_okay=False)
]


class KernelKind(StrEnum):
    """Which kernel ``monte-carlo`` averages."""

    NTK = "ntk"
    NNGP = "nngp"


OPERATOR_NAMES = tuple(m.value for m in OPERATOR_MODES)

OperatorMode = OperatorModeName
"""The modes whose kernel is a linear operator (``ntk_service.vocabulary.OPERATOR_MODES``): the choices of
``matvec --mode``."""


def _save(path: Path, array: Any) -> None:
    import numpy as np

    write_output(path, lambda path: np.save(path, array, allow_pickle=False))


def _emit(
    ctx: typer.Context, name: str, array: Any, output: Path | None, summary: dict[str, Any], json_output: bool
) -> None:
    """Write ``array`` to ``output`` (or print it when small), then the summary line or JSON."""
    import numpy as np

    as_json = wants_json(ctx, json_output)
    if output is not None:
        _save(output, array)
    elif array.size > _PRINT_LIMIT and not as_json:
        raise UsageError(f"{name} {array.shape} has {array.size} values; write it to a file with -o {name}.npy")
    summary = {**summary, "shape": list(array.shape), "dtype": str(array.dtype), "output": output and str(output)}
    if as_json:
        from ntk_service.wire import tensor_to_json

        print_json(summary if output is not None else {**summary, name: tensor_to_json(array)})
        return
    details = ", ".join(f"{key} {value}" for key, value in summary.items() if key not in ("shape", "dtype", "output"))
    where = f"wrote {output}" if output is not None else name
    typer.echo(f"{where}: {tuple(array.shape)} {array.dtype} ({details})")
    if output is None:
        typer.echo(np.array2string(array, threshold=_PRINT_LIMIT))


MAX_SEEDS = 1024
"""The server's ``MAX_MONTE_CARLO_SEEDS`` (a test keeps them equal; the CLI does not import the torch side)."""


def _dtype(dtype: Dtype | None) -> DtypeName | None:
    return None if dtype is None else dtype.value


def _seeds(text: str) -> list[int]:
    """``"0-15"``, ``"1,2,5"`` or a mix (``"0-3,9"``) as a list of ints, at most ``MAX_SEEDS`` of them: a typo
    like ``0-1000000000`` is refused here instead of building a billion-element list before the server says no."""
    seeds: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            if "-" in part[1:]:
                low, high = (int(end) for end in part.split("-", 1))
                if high < low:
                    raise UsageError(f"--seeds: the range {part!r} is empty; write it low-high, e.g. 0-15")
                if len(seeds) + (high - low + 1) > MAX_SEEDS:
                    raise UsageError(f"--seeds: {text!r} lists more than {MAX_SEEDS} seeds, the most one call takes")
                seeds.extend(range(low, high + 1))
            else:
                seeds.append(int(part))
    except ValueError as exc:
        raise UsageError(f"--seeds: expected integers and ranges like 0-15,20, got {text!r}") from exc
    if len(seeds) > MAX_SEEDS:
        raise UsageError(f"--seeds: {text!r} lists more than {MAX_SEEDS} seeds, the most one call takes")
    return seeds


@app.command()
def nngp(
    ctx: typer.Context,
    model: ModelArg,
    x1: X1Option,
    x2: X2Option = None,
    layer: Annotated[str | None, typer.Option(help="A module name: its output's features. Default: outputs.")] = None,
    mode: Annotated[Mode, typer.Option(help="Kernel mode, with d features in place of k.")] = "full",
    dtype: DtypeOption = None,
    version: Annotated[int | None, typer.Option(min=1, help="Model version. Default: the latest.")] = None,
    output: OutputOption = None,
    json_output: JsonFlag = False,
) -> None:
    """The empirical NNGP f(x1) f(x2)ᵀ of MODEL, or the conjugate kernel at --layer (needs a read key)."""
    side1 = read_side(x1, option="--x1")
    side2 = read_side(x2, option="--x2") if x2 is not None else None
    result = (
        state_of(ctx)
        .client()
        .nngp_result(model, side1, side2, layer=layer, mode=mode, dtype=_dtype(dtype), version=version)
    )
    summary = {"mode": result.mode, "layer": result.layer, "features": result.features, "model": result.model}
    _emit(ctx, "kernel", result.kernel, output, {**summary, "elapsed_ms": result.elapsed_ms}, json_output)


@app.command("monte-carlo")
def monte_carlo(
    ctx: typer.Context,
    model: ModelArg,
    x1: X1Option,
    seeds: Annotated[str, typer.Option(help="Seeds, e.g. 0-15 or 1,2,5: one network of MODEL's architecture each.")],
    x2: X2Option = None,
    kernel: Annotated[KernelKind, typer.Option(help="The kernel averaged.")] = KernelKind.NTK,
    mode: Annotated[Mode, typer.Option(help="Kernel mode.")] = "full",
    layer: Annotated[str | None, typer.Option(help="--kernel nngp only: a module's features.")] = None,
    dtype: DtypeOption = None,
    output: OutputOption = None,
    json_output: JsonFlag = False,
) -> None:
    """The kernel of MODEL's architecture averaged over --seeds initializations; with -o, the standard error is
    written beside it as <name>.stderr.npy (needs a read key)."""
    side1 = read_side(x1, option="--x1")
    side2 = read_side(x2, option="--x2") if x2 is not None else None
    result = (
        state_of(ctx)
        .client()
        .monte_carlo(
            model,
            side1,
            side2,
            seeds=_seeds(seeds),
            kernel=kernel.value,
            mode=mode,
            layer=layer,
            dtype=_dtype(dtype),
        )
    )
    if output is not None and result.stderr is not None:
        _save(output.with_suffix(".stderr.npy"), result.stderr)
    summary = {"kernel": result.kernel, "mode": result.mode, "n_samples": result.n_samples, "model": result.model}
    _emit(ctx, "mean", result.mean, output, {**summary, "elapsed_ms": result.elapsed_ms}, json_output)


@app.command()
def matvec(
    ctx: typer.Context,
    model: ModelArg,
    x1: X1Option,
    v: Annotated[Path, typer.Option("--v", help=".npy vector: (M, k) for full, (M,) for trace and pseudo.")],
    x2: X2Option = None,
    mode: Annotated[OperatorMode, typer.Option(help="Operator mode: " + mode_help(OPERATOR_NAMES) + ".")] = "full",
    transpose: Annotated[bool, typer.Option(help="Θ(x2, x1) v instead of Θ(x1, x2) v.")] = False,
    dtype: DtypeOption = None,
    version: Annotated[int | None, typer.Option(min=1, help="Model version. Default: the latest.")] = None,
    output: OutputOption = None,
    json_output: JsonFlag = False,
) -> None:
    """One product Θ(x1, x2) v of MODEL without building Θ (needs a read key)."""
    import numpy as np

    try:
        vector = np.load(v, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--v: cannot read {str(v)!r} as .npy ({exc})") from exc
    side1 = read_side(x1, option="--x1")
    side2 = read_side(x2, option="--x2") if x2 is not None else None
    client = state_of(ctx).client()
    product = client.matvec(
        model, side1, side2, v=vector, mode=mode, transpose=transpose, dtype=_dtype(dtype), version=version
    )
    _emit(ctx, "product", product, output, {"mode": mode, "model": model}, json_output)
