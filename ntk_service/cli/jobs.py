"""``ntk-service jobs submit|list|status|watch|result|cancel|delete``: batch kernels of whole data sets.

$ ntk-service jobs submit mlp --x1 dataset:ds_ab12 --mode trace --watch
$ ntk-service jobs list                        # every job: status, tiles, duration, result size
$ ntk-service jobs status 3f2a...              # one job's record
$ ntk-service jobs watch 3f2a...               # a live progress bar with ETA until the job ends
$ ntk-service jobs result 3f2a... -o theta.npy --rows 0:512
$ ntk-service jobs result 3f2a... -o kernel.zarr.zip   # the result's Zarr group (xarray opens it)
$ ntk-service jobs cancel 3f2a...
$ ntk-service jobs delete 3f2a...              # a finished job: its result leaves the server's disk

The progress bar goes to stderr, so ``--json ... --watch`` still draws it on a terminal (stdout keeps the JSON).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ntk_service.cli._app import JsonFlag, ModelArg, UsageError, print_json, state_of, wants_json
from ntk_service.cli._datasets import read_dataset_file
from ntk_service.cli._kernel import Dtype, Implementation
from ntk_service.cli._output import print_answer, print_table
from ntk_service.vocabulary import CONTRACTED_MODES, ContractedModeName, mode_help

if TYPE_CHECKING:  # the client (httpx, numpy) is imported when a command runs, not for --help
    from ntk_service.client import JobInfo

__all__ = ["jobs_app"]

_JOB_MODES = tuple(m.value for m in CONTRACTED_MODES)
"""What a job stores: the contracted modes (not "pseudo")."""

jobs_app = typer.Typer(
    help="Batch kernel jobs over whole data sets: tiled, resumable, with progress; results downloadable by slice.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

JobIdArg = Annotated[str, typer.Argument(help="The job id (from `jobs submit` or `jobs status`).", show_default=False)]

_LIST_COLUMNS = ("id", "status", "model", "version", "mode", "tiles", "duration", "eta", "size", "created_at")

_SIDE_HELP = (
    "a data set id (dataset:<id> or <id>, dataset:<id>[a:b] for rows a..b-1), or a .npy file of shape "
    "({rows}, *input) (or an .npz / .safetensors of named arrays) to upload first"
)


def _dataset_id(ctx: typer.Context, value: str, *, option: str) -> str | dict[str, Any]:
    """A data set id from ``dataset:<id>``, ``<id>`` or a .npy path (uploaded now); ``dataset:<id>[a:b]`` gives
    ``{"dataset": id, "start": a, "stop": b}``."""
    path = Path(value)
    if value.endswith((".npy", ".npz", ".safetensors")) or path.is_file():
        if not path.is_file():
            raise UsageError(f"{option}: no such file {value!r}")
        record = state_of(ctx).client().upload_dataset(read_dataset_file(path, option=option), name=path.name)
        return str(record["id"])
    dataset, bracket, rows = value.removeprefix("dataset:").partition("[")
    if not dataset:
        raise UsageError(f"{option}: pass dataset:<id>, dataset:<id>[a:b] or a .npy file, got {value!r}")
    if not bracket:
        return dataset
    start, colon, stop = rows.removesuffix("]").partition(":")
    try:
        if not colon or not rows.endswith("]"):
            raise ValueError
        side: dict[str, Any] = {"dataset": dataset}
        if start.strip():
            side["start"] = int(start)
        if stop.strip():
            side["stop"] = int(stop)
    except ValueError:
        raise UsageError(f"{option}: rows must read dataset:<id>[a:b] with integers, got {value!r}") from None
    return side


def _watch(ctx: typer.Context, job_id: str, json_output: bool) -> JobInfo:
    # The bar is drawn on stderr: with --json it stays off stdout, so it is drawn whenever stderr is a terminal.
    progress = not wants_json(ctx, json_output) or sys.stderr.isatty()
    return state_of(ctx).client().wait(job_id, progress=progress)


def _seconds(text: str | None) -> float | None:
    return None if text is None else datetime.fromisoformat(text).timestamp()


def _span(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    seconds = max(0, round(seconds))
    return (
        f"{seconds}s"
        if seconds < 60
        else f"{seconds // 60}m{seconds % 60:02d}s"
        if seconds < 3600
        else (f"{seconds // 3600}h{seconds % 3600 // 60:02d}m")
    )


def _list_row(job: Mapping[str, Any], now: float) -> dict[str, Any]:
    """A job as a row of ``jobs list``: tiles done/total, run time so far, ETA, size on disk (or "deleted")."""
    from ntk_service.errors import format_bytes

    started, finished = _seconds(job.get("started_at")), _seconds(job.get("finished_at"))
    ran = None if started is None else (finished if finished is not None else now) - started
    size = "deleted" if job.get("result_deleted_at") else format_bytes(int(job.get("estimate_bytes", 0)))
    return {
        **job,
        "tiles": f"{job.get('tiles_done')}/{job.get('tiles_total')}",
        "duration": _span(ran),
        "eta": None if job.get("status") != "running" else _span(job.get("eta_s")),
        "size": size,
    }


@jobs_app.command("submit")
def submit(
    ctx: typer.Context,
    model: ModelArg,
    x1: Annotated[str, typer.Option("--x1", help="x1: " + _SIDE_HELP.format(rows="N"), show_default=False)],
    x2: Annotated[
        str | None, typer.Option("--x2", help="x2: " + _SIDE_HELP.format(rows="M") + ". Default: x1 (symmetric).")
    ] = None,
    mode: Annotated[
        ContractedModeName, typer.Option(help="Kernel mode (the contracted ones): " + mode_help(_JOB_MODES) + ".")
    ] = "full",
    implementation: Annotated[Implementation, typer.Option(help="Algorithm; auto picks by cost.")] = "auto",
    dtype: Annotated[Dtype, typer.Option(help="Compute and storage dtype.")] = Dtype.FLOAT32,
    params: Annotated[
        list[str] | None, typer.Option("--params", help="Parameter name globs, repeatable or comma-separated.")
    ] = None,
    version: Annotated[int | None, typer.Option(min=1, help="Model version. Default: the latest.")] = None,
    tile_size: Annotated[
        int | None, typer.Option(min=1, help="Examples per tile side. Default: the server's (NTK_JOB_TILE_SIZE).")
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(help='Where the model returns a mapping: the output to use, e.g. "logits" or "logits[:, 0]".'),
    ] = None,
    panel_tiles: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tiles per panel side, the unit of work (docs/jobs.md); 1: a panel per tile. Default: the "
            "server's cost model (NTK_JOB_PANEL_SECONDS of work per panel).",
        ),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Then show a live progress bar until the job ends.")] = False,
    json_output: JsonFlag = False,
) -> None:
    """Submit a job computing the kernel of MODEL over whole data sets (needs a write key); prints its id."""
    globs = [g.strip() for item in params or [] for g in item.split(",") if g.strip()] or None
    job = (
        state_of(ctx)
        .client()
        .submit_job(
            model,
            _dataset_id(ctx, x1, option="--x1"),
            None if x2 is None else _dataset_id(ctx, x2, option="--x2"),
            mode=mode,
            implementation=implementation,
            dtype=dtype.value,
            params=globs,
            version=version,
            tile_size=tile_size,
            output=output,
            panel_tiles=panel_tiles,
        )
    )
    if not wants_json(ctx, json_output):
        typer.echo(
            f"submitted job {job['id']}: {job['tiles_total']} tiles, result {tuple(job['result_shape'])} "
            f"{job['dtype']} ({job['estimate_bytes']} bytes on disk)"
        )
    if watch:
        job = _watch(ctx, job["id"], json_output)
    if wants_json(ctx, json_output):
        print_json(job)


@jobs_app.command("list")
def list_jobs(ctx: typer.Context, json_output: JsonFlag = False) -> None:
    """List every job, newest first: status, tiles done, duration, ETA, result size on disk."""
    jobs = state_of(ctx).client().list_jobs()
    if wants_json(ctx, json_output):
        print_json(jobs)
    else:
        now = datetime.now().timestamp()
        print_table([_list_row(job, now) for job in jobs], _LIST_COLUMNS, empty="no jobs")


@jobs_app.command("status")
def status(
    ctx: typer.Context,
    job_id: Annotated[str | None, typer.Argument(help="A job id. Default: list every job (as `jobs list`).")] = None,
    json_output: JsonFlag = False,
) -> None:
    """Show one job (status, progress, ETA, error, where its result lies), or list all jobs."""
    if job_id is None:
        list_jobs(ctx, json_output)
        return
    print_answer(ctx, json_output, state_of(ctx).client().get_job(job_id))


@jobs_app.command("watch")
def watch_job(ctx: typer.Context, job_id: JobIdArg, json_output: JsonFlag = False) -> None:
    """Follow a job with a live progress bar and ETA until it ends; exit code 1 if it failed."""
    job = _watch(ctx, job_id, json_output)
    print_answer(ctx, json_output, job, f"job {job_id} {job['status']}")


@jobs_app.command("result")
def result(
    ctx: typer.Context,
    job_id: JobIdArg,
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="Write theta to this .npy file; a name ending in .zip gets the result's Zarr group instead, zipped "
            "(dimension names and attributes; xarray.open_zarr(zarr.storage.ZipStore(path)) opens it).",
            dir_okay=False,
        ),
    ],
    rows: Annotated[str | None, typer.Option(help="Row range a:b (.npy only). Default: all rows.")] = None,
    cols: Annotated[str | None, typer.Option(help="Column range c:d (.npy only). Default: all columns.")] = None,
    json_output: JsonFlag = False,
) -> None:
    """Download a succeeded job's kernel (or the block rows × cols) to a .npy file, or its Zarr group to a .zip,
    streamed to disk."""
    client = state_of(ctx).client()
    zipped = output.name.endswith(".zip")
    if zipped and (rows is not None or cols is not None):
        raise UsageError("--rows/--cols: a .zip download is the whole Zarr group; slice it after opening it")
    try:
        if zipped:
            client.download_zarr(job_id, output)
            job = client.get_job(job_id)
            shape, dtype = list(job["result_shape"]), str(job["dtype"])
        else:
            theta = client.download_result(job_id, output, rows=rows, cols=cols)
            shape, dtype = list(theta.shape), str(theta.dtype)
    except OSError as exc:
        raise UsageError(f"-o: cannot write {str(output)!r} ({exc.strerror or exc})") from exc
    summary = {"job": job_id, "shape": list(shape), "dtype": dtype, "output": str(output)}
    if wants_json(ctx, json_output):
        print_json(summary)
    else:
        what = "the Zarr group of " if zipped else ""
        typer.echo(f"wrote {output}: {what}{tuple(shape)} {dtype}")


@jobs_app.command("cancel")
def cancel(ctx: typer.Context, job_id: JobIdArg, json_output: JsonFlag = False) -> None:
    """Cancel a job (needs a write key): running tiles finish, no new tile starts."""
    job = state_of(ctx).client().cancel_job(job_id)
    print_answer(
        ctx, json_output, job, f"job {job_id} {job['status']} at {job['tiles_done']}/{job['tiles_total']} tiles"
    )


@jobs_app.command("delete")
def delete(
    ctx: typer.Context,
    job_id: JobIdArg,
    keep_record: Annotated[
        bool, typer.Option("--keep-record", help="Keep the job's record; only its result leaves the disk.")
    ] = False,
    json_output: JsonFlag = False,
) -> None:
    """Delete a finished job's result from the server's disk (needs a write key); a running job is cancelled."""
    answer = state_of(ctx).client().delete_job(job_id, keep_record=keep_record)
    if wants_json(ctx, json_output):
        print_json(answer)
    elif "freed_bytes" in answer:
        typer.echo(f"deleted the {answer['deleted']} {job_id}: {answer['freed_bytes']} bytes freed")
    else:
        typer.echo(f"job {job_id} {answer['status']} at {answer['tiles_done']}/{answer['tiles_total']} tiles")
