"""``ntk-service kernel``: compute Θ(x1, x2) of a registered model and write it as .npy (with ``--groups``: one
kernel per parameter group, written as one safetensors file)."""

from __future__ import annotations

import warnings
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from ntk_service.cli._app import JsonFlag, ModelArg, UsageError, app, print_json, state_of, wants_json
from ntk_service.cli._inputs import read_side
from ntk_service.cli._output import print_table, write_output
from ntk_service.vocabulary import ImplementationName, ModeName, mode_help

__all__ = ["Dtype", "Implementation", "Mode", "kernel"]

Mode = ModeName
"""The kernel modes' wire values (``ntk_service.vocabulary``, torch-free): the choices of ``--mode``."""

Implementation = ImplementationName
"""The implementations' wire values; auto picks by cost."""


class Dtype(StrEnum):
    """Compute dtypes a kernel may ask for."""

    FLOAT32 = "float32"
    FLOAT64 = "float64"


_SIDE_HELP = (
    "a .npy file of shape ({rows}, *input), a .safetensors or .npz file of named arrays ({rows}, ...) for a model "
    "taking several inputs, or dataset:<id>[start:stop] (rows of an uploaded data set)"
)

_PRINT_LIMIT = 1000
"""Without -o, a theta of at most this many values is printed; a bigger one needs a file."""


def _header(result: Any) -> dict[str, Any]:
    """What every kernel answer (``KernelResult``, ``GroupKernels``) reports first: the model, its version, the mode,
    the implementation, the time."""
    return {
        "model": result.model,
        "version": result.version,
        "mode": result.mode,
        "implementation": result.implementation,
        "elapsed_ms": result.elapsed_ms,
    }


@app.command()
def kernel(
    ctx: typer.Context,
    model: ModelArg,
    x1: Annotated[str, typer.Option("--x1", help="x1: " + _SIDE_HELP.format(rows="N"), show_default=False)],
    x2: Annotated[
        str | None, typer.Option("--x2", help="x2: " + _SIDE_HELP.format(rows="M") + ". Default: x1.")
    ] = None,
    mode: Annotated[Mode, typer.Option(help="Kernel mode: " + mode_help() + ".")] = "full",
    implementation: Annotated[Implementation, typer.Option(help="Algorithm; auto picks by cost.")] = "auto",
    params: Annotated[
        list[str] | None,
        typer.Option(
            "--params", help="Parameter name globs, repeatable or comma-separated, e.g. 'head.*'. Default: all."
        ),
    ] = None,
    dtype: Annotated[
        Dtype | None, typer.Option(help="Compute dtype. Default: the model's.", show_default=False)
    ] = None,
    version: Annotated[int | None, typer.Option(min=1, help="Model version. Default: the latest.")] = None,
    groups: Annotated[
        list[str] | None,
        typer.Option(
            "--groups",
            help="Per-layer kernels: 'modules' (one group per module with parameters), or NAME=GLOB[,GLOB...], "
            "repeatable, e.g. --groups 'features=features.*' --groups 'head=head.*'. -o then writes a "
            ".safetensors file with one tensor per group.",
            show_default=False,
        ),
    ] = None,
    rest: Annotated[
        bool, typer.Option("--rest", help="With --groups: the parameters no group lists, as a group 'rest'.")
    ] = False,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write theta to this .npy file.", dir_okay=False)
    ] = None,
    model_output: Annotated[
        str | None,
        typer.Option(
            "--model-output",
            help='For a model returning a dict: the tensor the kernel is of, e.g. "logits[:, 0]".',
            show_default=False,
        ),
    ] = None,
    json_output: JsonFlag = False,
) -> None:
    """Compute the empirical NTK of MODEL between x1 and x2 (needs a read key); theta's shape is the mode's."""
    import numpy as np

    side1 = read_side(x1, option="--x1")
    side2 = read_side(x2, option="--x2") if x2 is not None else None
    globs = [g.strip() for item in params or [] for g in item.split(",") if g.strip()] or None
    if groups is not None or rest:
        if globs is not None:
            raise UsageError("--params and --groups both select parameters; give the globs inside --groups")
        if groups is None:
            raise UsageError("--rest needs --groups")
        if model_output is not None:
            raise UsageError("--model-output is not supported with --groups; compute the groups without it")
        _kernel_groups(ctx, model, side1, side2, _parse_groups(groups), rest, mode, implementation, dtype, version,
                       output, json_output)  # fmt: skip
        return
    with warnings.catch_warnings():  # the server's note is printed below as one line, not as a Python warning
        warnings.simplefilter("ignore", UserWarning)
        result = (
            state_of(ctx)
            .client()
            .ntk_result(
                model,
                side1,
                side2,
                mode=mode,
                implementation=implementation,
                params=globs,
                dtype=None if dtype is None else dtype.value,
                version=version,
                output=model_output,
            )
        )
    if result.note:
        typer.echo(f"note: {result.note}", err=True)
    theta = result.theta
    if output is not None:
        write_output(output, lambda path: np.save(path, theta, allow_pickle=False))
    elif theta.size > _PRINT_LIMIT and not wants_json(ctx, json_output):
        raise UsageError(f"theta {theta.shape} has {theta.size} values; write it to a file with -o theta.npy")
    summary = {
        **_header(result),
        "shape": list(theta.shape),
        "dtype": str(theta.dtype),
        "output": str(output) if output is not None else None,
    }
    if wants_json(ctx, json_output):
        from ntk_service.wire import tensor_to_json

        print_json(summary if output is not None else {**summary, "theta": tensor_to_json(theta)})
        return
    where = f"wrote {output}" if output is not None else "theta"
    typer.echo(
        f"{where}: {tuple(theta.shape)} {theta.dtype} ({result.mode}, {result.implementation}, "
        f"model {result.model} v{result.version}, {result.elapsed_ms:.1f} ms)"
    )
    if output is None:
        typer.echo(np.array2string(theta, threshold=_PRINT_LIMIT))


def _parse_groups(items: list[str]) -> str | dict[str, list[str]]:
    """``--groups``: "modules", or NAME=GLOB[,GLOB...] items (one group each)."""
    if items == ["modules"]:
        return "modules"
    spec: dict[str, list[str]] = {}
    for item in items:
        name, sep, globs = item.partition("=")
        name = name.strip()
        patterns = [g.strip() for g in globs.split(",") if g.strip()]
        if not sep or not name or not patterns:
            raise UsageError(
                f"--groups: {item!r} is not NAME=GLOB[,GLOB...]; write e.g. --groups 'head=head.*' "
                "(repeat for each group), or --groups modules"
            )
        if name in spec:
            raise UsageError(f"--groups: group {name!r} is given twice; list all its globs in one NAME=GLOB,GLOB")
        spec[name] = patterns
    return spec


def _kernel_groups(
    ctx: typer.Context,
    model: str,
    side1: object,
    side2: object,
    groups: str | dict[str, list[str]],
    rest: bool,
    mode: Mode,
    implementation: Implementation,
    dtype: Dtype | None,
    version: int | None,
    output: Path | None,
    json_output: bool,
) -> None:
    """``kernel --groups``: one kernel per group, -o as one safetensors file (a tensor per group)."""
    import numpy as np

    from ntk_service.wire import encode_safetensors, tensor_to_json

    client = state_of(ctx).client()
    result = client.ntk_groups(
        model, side1, side2, groups=groups, rest=rest, mode=mode, implementation=implementation, dtype=dtype,
        version=version,
    )  # fmt: skip
    size = sum(theta.size for theta in result.thetas.values())
    if output is not None:
        import json

        metadata = {"mode": result.mode, "model": result.model, "version": str(result.version)}
        metadata["parameters"] = json.dumps(result.parameters)
        write_output(output, lambda path: path.write_bytes(encode_safetensors(result.thetas, metadata)))
    elif size > _PRINT_LIMIT and not wants_json(ctx, json_output):
        raise UsageError(f"the group kernels have {size} values; write them to a file with -o kernels.safetensors")
    rows = [
        {
            "group": name,
            "parameters": len(result.parameters[name]),
            "shape": list(theta.shape),
            "frobenius": float(np.linalg.norm(theta.reshape(-1))),
        }
        for name, theta in result.thetas.items()
    ]
    summary = {
        **_header(result),
        "groups": rows,
        "output": str(output) if output is not None else None,
    }
    if wants_json(ctx, json_output):
        if output is None:
            for row, theta in zip(rows, result.thetas.values(), strict=True):
                row["theta"] = tensor_to_json(theta)
        print_json(summary)
        return
    where = f"wrote {output}" if output is not None else "group kernels"
    typer.echo(
        f"{where}: {len(rows)} groups ({result.mode}, {result.implementation}, model {result.model} "
        f"v{result.version}, {result.elapsed_ms:.1f} ms)"
    )
    print_table(rows, ["group", "parameters", "shape", "frobenius"], empty="no groups")
    if output is None:
        for name, theta in result.thetas.items():
            typer.echo(f"{name}:")
            typer.echo(np.array2string(theta, threshold=_PRINT_LIMIT))
