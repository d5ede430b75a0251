"""``ntk-service datasets upload|list|show|delete``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ntk_service.cli._app import JsonFlag, UsageError, state_of
from ntk_service.cli._inputs import read_npy
from ntk_service.cli._output import print_answer, print_table

if TYPE_CHECKING:
    import numpy as np

__all__ = ["datasets_app", "read_dataset_file"]

datasets_app = typer.Typer(
    help="Upload inputs once, then reference their rows in kernels as dataset:<id>[start:stop].",
    no_args_is_help=True,
    rich_markup_mode=None,
)

IdArg = Annotated[str, typer.Argument(help="The data set id (from `datasets upload` or `datasets list`).")]

_LIST_COLUMNS = ("id", "name", "shape", "dtype", "created_at")


def read_dataset_file(path: Path, *, option: str) -> np.ndarray | dict[str, np.ndarray]:
    """A data set file: .npy (one array), .npz (named arrays) or .safetensors (tensor ``x`` alone: one array; else
    named arrays). Nothing is unpickled.

    Raises:
        UsageError: another suffix, or a file that cannot be read.
    """
    import numpy as np

    from ntk_service import wire
    from ntk_service.errors import NtkServiceError

    suffix = path.suffix.lower()
    if suffix == ".npy":
        return read_npy(path, option=option)
    if suffix not in (".npz", ".safetensors"):
        raise UsageError(f"{option}: {str(path)!r} must end in .npy, .npz or .safetensors")
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {key: archive[key] for key in archive.files}
        tensors = wire.decode_safetensors(path.read_bytes(), name=str(path))[0]
    except (OSError, ValueError, NtkServiceError) as exc:
        raise UsageError(f"{option}: cannot read {str(path)!r} as {suffix}: {exc}") from exc
    return tensors["x"] if set(tensors) == {"x"} else tensors


def _describe(record: dict[str, Any]) -> str:
    arrays = record.get("arrays")
    if not arrays:
        return f"shape {record.get('shape')} {record.get('dtype')}"
    shown = ", ".join(f"{a['name']} {a['shape']} {a['dtype']}" for a in arrays)
    return f"{record.get('shape', [0])[0]} rows of {shown}"


@datasets_app.command("upload")
def upload(
    ctx: typer.Context,
    path: Annotated[
        Path,
        typer.Argument(
            help="A .npy file of shape (N, *input), or an .npz / .safetensors of named arrays with one N "
            "(the model's forward argument names, e.g. input_ids and attention_mask).",
            exists=True,
            dir_okay=False,
            show_default=False,
        ),
    ],
    name: Annotated[str | None, typer.Option(help="A human-readable name.", show_default=False)] = None,
    json_output: JsonFlag = False,
) -> None:
    """Upload a .npy, .npz or .safetensors file as a data set (needs a write key); prints its id."""
    array = read_dataset_file(path, option="datasets upload")
    record = state_of(ctx).client().upload_dataset(array, name=name)
    print_answer(ctx, json_output, record, f"uploaded data set {record['id']}: {_describe(dict(record))}")


@datasets_app.command("list")
def list_datasets(ctx: typer.Context, json_output: JsonFlag = False) -> None:
    """List data sets."""
    records = state_of(ctx).client().list_datasets()
    print_answer(ctx, json_output, records, lambda: print_table(records, _LIST_COLUMNS, empty="no data sets"))


@datasets_app.command("show")
def show(ctx: typer.Context, dataset_id: IdArg, json_output: JsonFlag = False) -> None:
    """Show a data set's record."""
    record = state_of(ctx).client().get_dataset(dataset_id)
    print_answer(ctx, json_output, record)


@datasets_app.command("delete")
def delete(ctx: typer.Context, dataset_id: IdArg, json_output: JsonFlag = False) -> None:
    """Delete a data set (needs a write key)."""
    state_of(ctx).client().delete_dataset(dataset_id)
    print_answer(ctx, json_output, {"deleted": dataset_id}, f"deleted data set {dataset_id}")
