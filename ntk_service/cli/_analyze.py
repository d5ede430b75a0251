"""``ntk-service analyze predict|spectrum|compare``: what the kernel says, computed by the server.

    $ ntk-service analyze predict mlp --x-train x.npy --y-train y.npy --x-test xt.npy \\
          --times 0,100,inf --learning-rate 0.05 -o pred.npz
    $ ntk-service analyze spectrum mlp --x x.npy --top 20 -o eigenvalues.npy
    $ ntk-service analyze compare mlp --x probe.npy --versions 1,2,3 --y labels.npy --variant centered
"""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from ntk_service.cli._app import JsonFlag, ModelArg, UsageError, print_json, state_of, wants_json
from ntk_service.cli._inputs import read_npy, read_side
from ntk_service.cli._output import print_answer, print_record, print_table, write_output

if TYPE_CHECKING:  # the client (httpx, numpy) is imported when a command runs, not for --help
    from ntk_service.client import SpectrumMethodName

__all__ = ["analyze_app"]

analyze_app = typer.Typer(
    help="Analyses of a model's kernel on given inputs: linearized training, spectrum, checkpoint comparison.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


class AnalysisMode(StrEnum):
    """Kernel modes an analysis can use: the whole (N·k)² kernel, or its trace read as (trace / k) ⊗ I_k."""

    FULL = "full"
    TRACE = "trace"


class Loss(StrEnum):
    MSE = "mse"  # MSELoss()
    SUM = "sum"  # MSELoss(reduction="sum")
    HALF_MSE = "half_mse"  # ½·mean (neural-tangents' convention)
    CROSS_ENTROPY = "cross_entropy"  # CrossEntropyLoss() on integer class indices


class Flow(StrEnum):
    GRADIENT_FLOW = "gradient_flow"
    GRADIENT_DESCENT = "gradient_descent"


class Variant(StrEnum):
    UNCENTERED = "uncentered"
    CENTERED = "centered"
    CENTERED_VEC_Y = "centered_vec_y"
    RAYLEIGH = "rayleigh"


ModeOpt = Annotated[AnalysisMode, typer.Option(help="full (N·k)² kernel, or trace read as trace/k ⊗ I_k.")]
VersionOpt = Annotated[int | None, typer.Option(min=1, help="Model version. Default: the latest.")]


def _numbers(text: str, *, option: str, integers: bool = False) -> list[Any]:
    """``"0,10,inf"`` -> [0.0, 10.0, inf] (or ints)."""
    out: list[Any] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            out.append(int(part) if integers else (math.inf if part.lower() == "inf" else float(part)))
        except ValueError:
            kind = "integers" if integers else "numbers (or inf)"
            raise UsageError(
                f"{option}: {part!r} is not a number; give comma-separated {kind}, e.g. 0,10,inf"
            ) from None
    if not out:
        raise UsageError(f"{option}: give at least one value")
    return out


_SIDE = "({rows}, *input) .npy, named arrays (.safetensors, .npz: one per input) or dataset:<id>[a:b]."


@analyze_app.command()
def predict(
    ctx: typer.Context,
    model: ModelArg,
    x_train: Annotated[str, typer.Option("--x-train", help=_SIDE.format(rows="N"))],
    y_train: Annotated[
        Path,
        typer.Option(
            "--y-train", help="(N, k) targets, or (N,) integer labels for cross_entropy, .npy.", dir_okay=False
        ),
    ],
    times: Annotated[str, typer.Option(help="Comma-separated times or steps; inf allowed, e.g. 0,10,inf.")],
    learning_rate: Annotated[float, typer.Option("--learning-rate", help="η of the optimizer on the loss.")],
    x_test: Annotated[str | None, typer.Option("--x-test", help=_SIDE.format(rows="M"))] = None,
    loss: Annotated[
        Loss, typer.Option(help="mse = MSELoss(), sum, half_mse = ½·mean, cross_entropy = CrossEntropyLoss().")
    ] = Loss.MSE,
    flow: Annotated[Flow, typer.Option(help="Closed-form flow, or exact gradient descent (integer steps).")] = (
        Flow.GRADIENT_FLOW
    ),
    ridge: Annotated[float, typer.Option(min=0.0, help="λ added to Θ's diagonal.")] = 0.0,
    mode: ModeOpt = AnalysisMode.FULL,
    version: VersionOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write times/train/test/f0 to this .npz.", dir_okay=False)
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Outputs of the linearized network trained on (x_train, y_train), at each time (needs a read key)."""
    import numpy as np

    result = (
        state_of(ctx)
        .client()
        .predict(
            model,
            read_side(x_train, option="--x-train"),
            read_npy(y_train, option="--y-train"),
            None if x_test is None else read_side(x_test, option="--x-test"),
            times=_numbers(times, option="--times"),
            learning_rate=learning_rate,
            loss=loss.value,
            flow=flow.value,
            ridge=ridge,
            mode=mode.value,
            version=version,
        )
    )
    if output is not None:
        arrays: dict[str, Any] = {"times": result.times, "train": result.train, "f0_train": result.f0_train}
        if result.test is not None and result.f0_test is not None:
            arrays.update(test=result.test, f0_test=result.f0_test)
        write_output(output, lambda path: np.savez(path, **arrays))
    summary = {
        "model": result.model,
        "version": result.version,
        "times": result.times.tolist(),
        "train_shape": list(result.train.shape),
        "test_shape": None if result.test is None else list(result.test.shape),
        "lambda_min": result.lambda_min,
        "lambda_max": result.lambda_max,
        "frozen_modes": result.frozen_modes,
        "max_learning_rate": result.max_learning_rate,
        "path": result.path,
        "rtol": result.rtol,
        "atol": result.atol,
        "kernel_ms": result.kernel_ms,
        "analysis_ms": result.analysis_ms,
        "output": None if output is None else str(output),
    }
    print_answer(ctx, json_output, summary)


@analyze_app.command()
def spectrum(
    ctx: typer.Context,
    model: ModelArg,
    x: Annotated[str, typer.Option("--x", help=_SIDE.format(rows="N"))],
    top: Annotated[int | None, typer.Option(min=1, help="Only the top eigenvalues. Default: all.")] = None,
    method: Annotated[str, typer.Option(help="auto | eigh | lanczos | operator (matrix-free, needs --top).")] = "auto",
    ridge: Annotated[
        list[float] | None, typer.Option("--ridge", help="λ for effective_dof; repeatable (needs all eigenvalues).")
    ] = None,
    mode: ModeOpt = AnalysisMode.FULL,
    version: VersionOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the eigenvalues to this .npy.", dir_okay=False)
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Eigenvalues (descending), condition number and effective ranks of Θ(x, x) (needs a read key)."""
    import numpy as np

    result = (
        state_of(ctx)
        .client()
        .spectrum(
            model,
            read_side(x, option="--x"),
            top=top,
            method=cast("SpectrumMethodName", method),  # the server refuses another value, naming the three
            ridges=ridge or [],
            mode=mode.value,
            version=version,
        )
    )
    if output is not None:
        write_output(output, lambda path: np.save(path, result.eigenvalues, allow_pickle=False))
    summary = {
        "model": result.model,
        "version": result.version,
        "n": result.n,
        "method": result.method,
        "lambda_max": result.lambda_max,
        "lambda_min": result.lambda_min,
        "condition_number": result.condition_number,
        **result.ranks,
        **{f"effective_dof({r:g})": v for r, v in result.effective_dof.items()},
        "output": None if output is None else str(output),
    }
    if wants_json(ctx, json_output):
        print_json({**summary, "eigenvalues": result.eigenvalues.tolist()})
        return
    print_record(summary)
    if output is None:
        typer.echo("eigenvalues: " + np.array2string(result.eigenvalues[:20], precision=6) + (" ..." * (result.n > 20)))


@analyze_app.command()
def compare(
    ctx: typer.Context,
    model: ModelArg,
    x: Annotated[str, typer.Option("--x", help="Probe inputs (N, *input): .npy or dataset:<id>[a:b].")],
    versions: Annotated[str, typer.Option(help="Comma-separated versions (checkpoints), e.g. 1,2,3.")],
    y: Annotated[
        Path | None, typer.Option("--y", help="Labels (N,) int or targets (N, c), .npy.", dir_okay=False)
    ] = None,
    variant: Annotated[Variant | None, typer.Option(help="Alignment variant (required with --y).")] = None,
    mode: ModeOpt = AnalysisMode.FULL,
    json_output: JsonFlag = False,
) -> None:
    """Kernel distance between versions, relative change from the first, alignment per version (read key)."""
    result = (
        state_of(ctx)
        .client()
        .compare(
            model,
            read_side(x, option="--x"),
            versions=_numbers(versions, option="--versions", integers=True),
            y=None if y is None else read_npy(y, option="--y"),
            variant=None if variant is None else variant.value,
            mode=mode.value,
        )
    )
    rows = [
        {
            "version": f"{name} v{number}",
            "distance_from_first": float(result.distance[0, i]),
            "relative_change": float(result.relative_change[i]),
            "alignment": None if result.alignment is None else float(result.alignment[i]),
        }
        for i, (name, number) in enumerate(result.versions)
    ]
    if wants_json(ctx, json_output):
        print_json({"versions": rows, "distance": result.distance.tolist(), "variant": result.variant})
        return
    print_table(rows, ("version", "distance_from_first", "relative_change", "alignment"), empty="no versions")
