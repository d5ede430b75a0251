"""``ntk-service models register|register-program|list|show|delete|architectures|upload-weights|versions|
download-weights``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from ntk_service.cli._app import JsonFlag, ModelArg, UsageError, print_json, state_of, wants_json
from ntk_service.cli._output import print_answer, print_table

__all__ = ["models_app"]

models_app = typer.Typer(
    help="Register, inspect and delete models; upload weight versions.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


_LIST_COLUMNS = ("name", "version", "family", "num_params", "input_shape", "output_dim")
_VERSION_COLUMNS = ("version", "created_at", "label", "seed", "weights_sha256")

LabelOption = Annotated[
    str | None, typer.Option("--label", "-l", help="A label for the version, e.g. 'epoch 3'.", show_default=False)
]


def _inputs_text(record: Mapping[str, Any]) -> str | None:
    """A model taking several inputs: ``input_ids [5] int64, attention_mask [5] int64``; None for one input."""
    inputs = record.get("inputs")
    leaves = inputs.get("leaves") if isinstance(inputs, dict) else None
    if not isinstance(leaves, list):
        return None
    return ", ".join(f"{leaf.get('name')} {leaf.get('shape')} {leaf.get('dtype')}" for leaf in leaves)


def _input_text(record: Mapping[str, Any]) -> str:
    named = _inputs_text(record)
    if named is not None:
        return f"inputs {named}"
    return f"input {record.get('input_shape')} {record.get('input_dtype', '')}"


def _with_family(record: Mapping[str, Any]) -> dict[str, Any]:
    architecture = record.get("architecture")
    family = architecture.get("family") if isinstance(architecture, dict) else None
    named = _inputs_text(record)  # the input_shape column shows every named input
    return {**record, "family": family, **({} if named is None else {"input_shape": named})}


def _read_architecture(value: str) -> dict[str, Any]:
    """``--architecture``: inline JSON, or ``@path`` to a JSON file."""
    source = "--architecture"
    if value.startswith("@"):
        path = Path(value[1:])
        source = f"--architecture file {str(path)!r}"
        try:
            value = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"{source}: cannot read it ({exc.strerror or exc})") from exc
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{source}: not valid JSON ({exc.msg} at column {exc.colno}); "
            'expected e.g. \'{"family": "mlp", "input_dim": 4, "hidden": [16], "output_dim": 3}\' or @spec.json'
        ) from exc
    if not isinstance(spec, dict):
        raise UsageError(f"{source}: expected a JSON object with a 'family' field, got {type(spec).__name__}")
    return spec


def _input_file(help: str) -> Any:
    """A positional argument naming a file that must exist and be readable (typer checks it before the call)."""
    return typer.Argument(help=help, exists=True, dir_okay=False, readable=True, show_default=False)


@models_app.command("register")
def register(
    ctx: typer.Context,
    name: ModelArg,
    architecture: Annotated[
        str,
        typer.Option(
            "--architecture",
            "-a",
            help='Architecture spec as JSON, e.g. \'{"family": "mlp", "input_dim": 4, "hidden": [16], '
            '"output_dim": 3}\', or @file.json.',
            show_default=False,
        ),
    ],
    seed: Annotated[int, typer.Option(help="Seed of the initial weights (version 1).")] = 0,
    label: LabelOption = None,
    json_output: JsonFlag = False,
) -> None:
    """Register a model from an architecture spec (needs a write key)."""
    record = state_of(ctx).client().register_model(name, _read_architecture(architecture), seed=seed, label=label)
    if wants_json(ctx, json_output):
        print_json(record)
    else:
        typer.echo(
            f"registered {record['name']} version {record['version']}: {record.get('num_params')} parameters, "
            f"{_input_text(record)}, {record.get('output_dim')} outputs"
        )


@models_app.command("register-program")
def register_program(
    ctx: typer.Context,
    name: ModelArg,
    program: Annotated[
        Path, _input_file("A torch.export archive (.pt2) written by torch.export.save, the batch dimension dynamic.")
    ],
    label: LabelOption = None,
    json_output: JsonFlag = False,
) -> None:
    """Register a torch.export program with the weights it was saved with as version 1 (needs a write key).

    The server loads it without unpickling anything; further checkpoints are `models upload-weights` of the
    module's state_dict() saved as .safetensors."""
    record = state_of(ctx).client().register_program(name, program.read_bytes(), label=label)
    if wants_json(ctx, json_output):
        print_json(record)
    else:
        operators = record.get("architecture", {}).get("operators")
        count = len(operators) if isinstance(operators, list) else "?"
        typer.echo(
            f"registered {record['name']} version {record['version']} (exported, {count} operators): "
            f"{record.get('num_params')} parameters, {_input_text(record)}, {record.get('output_dim')} outputs"
        )


@models_app.command("list")
def list_models(ctx: typer.Context, json_output: JsonFlag = False) -> None:
    """List registered models (latest version of each)."""
    records = state_of(ctx).client().list_models()
    print_answer(
        ctx,
        json_output,
        records,
        lambda: print_table([_with_family(r) for r in records], _LIST_COLUMNS, empty="no models registered"),
    )


@models_app.command("show")
def show(ctx: typer.Context, name: ModelArg, json_output: JsonFlag = False) -> None:
    """Show a model's record: architecture, parameters, latest version, weights hash."""
    record = state_of(ctx).client().get_model(name)
    print_answer(ctx, json_output, record)


@models_app.command("delete")
def delete(ctx: typer.Context, name: ModelArg, json_output: JsonFlag = False) -> None:
    """Delete a model and all its versions (needs a write key)."""
    state_of(ctx).client().delete_model(name)
    print_answer(ctx, json_output, {"deleted": name}, f"deleted model {name}")


@models_app.command("architectures")
def architectures(ctx: typer.Context, json_output: JsonFlag = False) -> None:
    """List the families, their config fields, an example spec for --architecture, sequential's layer types and
    the factories this server allows."""
    infos = state_of(ctx).client().architectures()
    if wants_json(ctx, json_output):
        print_json(infos)
        return
    for info in infos:
        typer.echo(f"{info.get('name')}: {info.get('description', '')}")
        for item in info.get("fields", []):
            default = "required" if item.get("required") else f"default {json.dumps(item.get('default'))}"
            typer.echo(f"  {item.get('name')} ({item.get('type')}, {default}): {item.get('description', '')}")
        typer.echo(f"  example: {json.dumps(info.get('example'))}")
        for layer in info.get("layers") or []:
            keywords = ", ".join(str(item.get("name")) for item in layer.get("fields", []))
            typer.echo(f"  layer {layer.get('type')}({keywords})")
        if info.get("factories") is not None:
            typer.echo(f"  allowed on this server: {', '.join(info['factories']) or 'none'}")


@models_app.command("upload-weights")
def upload_weights(
    ctx: typer.Context,
    name: ModelArg,
    weights: Annotated[Path, _input_file("A .safetensors file with every parameter by its named_parameters() name.")],
    label: LabelOption = None,
    json_output: JsonFlag = False,
) -> None:
    """Upload weights as a new immutable version of a model (needs a write key)."""
    record = state_of(ctx).client().upload_weights(name, weights.read_bytes(), label=label)
    print_answer(
        ctx,
        json_output,
        record,
        f"uploaded {name} version {record['version']} (sha256 {record.get('weights_sha256', '?')})",
    )


@models_app.command("versions")
def versions(ctx: typer.Context, name: ModelArg, json_output: JsonFlag = False) -> None:
    """List a model's versions, oldest first: upload time, label, seed, weights hash."""
    records = state_of(ctx).client().list_versions(name)
    print_answer(
        ctx, json_output, records, lambda: print_table(records, _VERSION_COLUMNS, empty=f"model {name} has no versions")
    )


@models_app.command("download-weights")
def download_weights(
    ctx: typer.Context,
    name: ModelArg,
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="The .safetensors file to write.", dir_okay=False, show_default=False),
    ],
    version: Annotated[int | None, typer.Option(help="The version. Default: the latest.", show_default=False)] = None,
    json_output: JsonFlag = False,
) -> None:
    """Download a version's weights as a .safetensors file (load it with safetensors.torch.load_file)."""
    from ntk_service import wire  # numpy: only when a command needs it, so --help stays light

    client = state_of(ctx).client()
    record = client.get_model(name, version)
    tensors = client.download_weights(name, int(record["version"]))
    try:
        output.write_bytes(wire.encode_safetensors(tensors))
    except OSError as exc:
        raise UsageError(f"--output {str(output)!r}: cannot write it ({exc.strerror or exc})") from exc
    summary = {"name": name, "version": record["version"], "tensors": len(tensors), "path": str(output)}
    print_answer(
        ctx, json_output, summary, f"wrote {len(tensors)} tensors of {name} version {record['version']} to {output}"
    )
