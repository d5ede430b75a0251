"""``ntk-service attribution ...``: which training examples drove each prediction (TRAK-style data attribution).

$ ntk-service attribution run mlp --train dataset:ds_x --labels dataset:ds_y --test dataset:ds_t \\
      --test-labels dataset:ds_ty --versions 2,3,4 --top-k 5      # both steps, stored features reused
$ ntk-service attribution features mlp --train dataset:ds_x --labels dataset:ds_y --version 2 --seed 0 --watch
$ ntk-service attribution score 3f2a... 9c1e... --test dataset:ds_t --test-labels dataset:ds_ty --watch
$ ntk-service attribution show 7d0b... 12                # test example 12: its proponents and opponents
$ ntk-service attribution result 7d0b... -o top.npz      # proponents, opponents, their scores, total influence
$ ntk-service attribution scores 7d0b... -o scores.npy --rows 0:100   # the dense scores, when kept
$ ntk-service attribution list | status | watch | cancel | delete ID
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, cast

import typer

from ntk_service.cli._app import JsonFlag, ModelArg, UsageError, print_json, state_of, wants_json
from ntk_service.cli._inputs import read_span
from ntk_service.cli._job_commands import JobCommands, JobMethods, add_job_commands, progress_stream
from ntk_service.cli._output import format_value, print_table
from ntk_service.cli.jobs import _dataset_id

__all__ = ["attribution_app"]

attribution_app = typer.Typer(
    help="Data attribution: the training examples that drove each prediction, over checkpoints (model versions).",
    no_args_is_help=True,
    rich_markup_mode=None,
)

_SIDE = "a data set id (dataset:<id>, dataset:<id>[a:b]) or a .npy file to upload first"
JobIdArg = Annotated[str, typer.Argument(help="The job id (from `features`, `score` or `run`).", show_default=False)]
OutOption = Annotated[Path, typer.Option("-o", "--output", help="Where to write it.", show_default=False)]
Loss = Annotated[str, typer.Option(help="cross_entropy (class indices) or mse (float targets).")]
Features = Annotated[str, typer.Option(help="structured, gaussian or exact.")]
Dim = Annotated[int | None, typer.Option(help="D, the sketch's size. Default: the server's (2048).")]
TopK = Annotated[int | None, typer.Option("--top-k", help="Proponents and opponents per test example (0: none).")]
Ridge = Annotated[float | None, typer.Option(help="λ relative to the mean diagonal. Default: the server's (0.3).")]
Watch = Annotated[bool, typer.Option("--watch", help="Then print progress until the job ends.")]


_FEATURES = JobMethods(
    "attribution_features_job",
    "wait_attribution_features",
    "cancel_attribution_features",
    "delete_attribution_features",
)
_ATTRIBUTION = JobMethods("attribution_job", "wait_attribution_job", "cancel_attribution_job", "delete_attribution_job")
FEATURES_JOBS = JobCommands("attribution features job", (_FEATURES,), JobIdArg)
ATTRIBUTION_JOBS = JobCommands("attribution job", (_ATTRIBUTION,), JobIdArg)
EITHER_JOBS = JobCommands("job (either kind)", (_ATTRIBUTION, _FEATURES), JobIdArg)
"""An id of either kind: ``status``, ``watch``, ``cancel`` and ``delete`` try an attribution job first."""


@attribution_app.command("features")
def features_submit(
    ctx: typer.Context,
    model: ModelArg,
    train: Annotated[str, typer.Option(help="Training inputs: " + _SIDE, show_default=False)],
    labels: Annotated[str, typer.Option(help="Their labels, aligned rows: " + _SIDE, show_default=False)],
    version: Annotated[int | None, typer.Option(min=1, help="The checkpoint. Default: the latest.")] = None,
    loss: Loss = "cross_entropy",
    features: Features = "structured",
    dim: Dim = None,
    seed: Annotated[int, typer.Option(help="The sketch's seed; one per checkpoint of an ensemble.")] = 0,
    watch: Watch = False,
    json_output: JsonFlag = False,
) -> None:
    """Compute and store one checkpoint's training side (needs a write key); prints the job's id."""
    client = state_of(ctx).client()
    job = client.submit_attribution_features(
        model,
        train=_dataset_id(ctx, train, option="--train"),
        labels=_dataset_id(ctx, labels, option="--labels"),
        version=version,
        loss=cast(Literal["cross_entropy", "mse"], loss),
        features=cast(Literal["structured", "gaussian", "exact"], features),
        dim=dim,
        seed=seed,
    )  # fmt: skip  (the server refuses other values of loss and features: 422)
    FEATURES_JOBS.submitted(ctx, job, watch=watch, json_output=json_output)


@attribution_app.command("score")
def score_submit(
    ctx: typer.Context,
    features: Annotated[list[str], typer.Argument(help="Features job ids, one per checkpoint.", show_default=False)],
    test: Annotated[str | None, typer.Option(help="Test inputs: " + _SIDE + ". Default: none (self only).")] = None,
    test_labels: Annotated[str | None, typer.Option(help="Their labels. Default: the predicted class.")] = None,
    ridge: Ridge = None,
    top_k: TopK = None,
    store_scores: Annotated[bool, typer.Option("--store-scores", help="Keep the dense (M, N) scores.")] = False,
    self_influence: Annotated[bool, typer.Option("--self-influence", help="Each training example's.")] = False,
    watch: Watch = False,
    json_output: JsonFlag = False,
) -> None:
    """Score a test set against stored training sides (needs a write key); prints the job's id."""
    client = state_of(ctx).client()
    job = client.submit_attribution(
        features,
        test=None if test is None else _dataset_id(ctx, test, option="--test"),
        test_labels=None if test_labels is None else _dataset_id(ctx, test_labels, option="--test-labels"),
        ridge=ridge, top_k=top_k, store_scores=store_scores, self_influence=self_influence,
    )  # fmt: skip
    ATTRIBUTION_JOBS.submitted(ctx, job, watch=watch, json_output=json_output)


@attribution_app.command("run")
def run(
    ctx: typer.Context,
    model: ModelArg,
    train: Annotated[str, typer.Option(help="Training inputs: " + _SIDE, show_default=False)],
    labels: Annotated[str, typer.Option(help="Their labels: " + _SIDE, show_default=False)],
    test: Annotated[str | None, typer.Option(help="Test inputs: " + _SIDE + ". Default: none (self only).")] = None,
    test_labels: Annotated[str | None, typer.Option(help="Their labels. Default: the predicted class.")] = None,
    versions: Annotated[
        str | None, typer.Option(help="Checkpoints, e.g. 2,3,4 (one seed each). Default: the latest version.")
    ] = None,
    loss: Loss = "cross_entropy",
    features: Features = "structured",
    dim: Dim = None,
    ridge: Ridge = None,
    top_k: TopK = None,
    self_influence: Annotated[bool, typer.Option("--self-influence", help="Each training example's.")] = False,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the answers to an .npz file.")] = None,
    json_output: JsonFlag = False,
) -> None:
    """Both steps, waiting for each: the features of every checkpoint (reusing stored ones), then the scores."""
    try:
        chosen = [None] if versions is None else [int(v) for v in versions.split(",")]
    except ValueError:
        raise UsageError(f"--versions: expected integers separated by commas, e.g. 2,3,4; got {versions!r}") from None
    client = state_of(ctx).client()
    result = client.attribute(
        model, train=_dataset_id(ctx, train, option="--train"), labels=_dataset_id(ctx, labels, option="--labels"),
        test=None if test is None else _dataset_id(ctx, test, option="--test"),
        test_labels=None if test_labels is None else _dataset_id(ctx, test_labels, option="--test-labels"),
        versions=chosen, loss=cast(Literal["cross_entropy", "mse"], loss),
        features=cast(Literal["structured", "gaussian", "exact"], features), dim=dim, ridge=ridge, top_k=top_k,
        self_influence=self_influence, progress=progress_stream(ctx, json_output),
    )  # fmt: skip
    if output is not None:
        _save(output, result)
    job = client.attribution_job(result.job)
    if wants_json(ctx, json_output):
        print_json(job)
    else:
        typer.echo(f"attribution job {result.job}: {', '.join(job['result']['answers'] if job['result'] else [])}")
        if output is not None:
            typer.echo(f"wrote {output}")


def _save(path: Path, result: Any) -> None:
    import numpy as np

    names = ("proponents", "proponent_scores", "opponents", "opponent_scores", "total_influence", "self_influence")
    arrays = {name: getattr(result, name) for name in names if getattr(result, name) is not None}
    np.savez(path, **arrays)


@attribution_app.command("list")
def list_jobs(ctx: typer.Context, json_output: JsonFlag = False) -> None:
    """Every attribution features job and attribution job, newest first."""
    client = state_of(ctx).client()
    from ntk_service.client._attribution import format_attribution_progress

    jobs: list[dict[str, Any]] = [
        dict(j) for j in (*client.list_attribution_jobs(), *client.list_attribution_features())
    ]
    jobs.sort(key=lambda job: float(job["created_at"]), reverse=True)
    if wants_json(ctx, json_output):
        print_json(jobs)
        return
    rows = [
        {
            "id": job["id"],
            "job": job["job"],
            "model": job["spec"]["model"],
            "progress": format_attribution_progress(job),
        }
        for job in jobs
    ]
    print_table(rows, ["id", "job", "model", "progress"], empty="no attribution jobs")


add_job_commands(attribution_app, EITHER_JOBS)


@attribution_app.command("result")
def result(
    ctx: typer.Context,
    job_id: JobIdArg,
    output: OutOption,
    rows: Annotated[str | None, typer.Option(help="Test rows a:b of the top-k arrays. Default: all.")] = None,
) -> None:
    """Write the answers (top-k arrays, total and self influence) to an .npz file."""
    answers = state_of(ctx).client().attribution_result(job_id, rows=read_span(rows, option="--rows"))
    _save(output, answers)
    shape = None if answers.proponents is None else answers.proponents.shape
    typer.echo(f"wrote {output}: top-k {format_value(shape)}, rows {answers.rows[0]}:{answers.rows[1]}")


@attribution_app.command("scores")
def scores(
    ctx: typer.Context,
    job_id: JobIdArg,
    output: OutOption,
    rows: Annotated[str | None, typer.Option(help="Test rows a:b. Default: all.")] = None,
    cols: Annotated[str | None, typer.Option(help="Training columns c:d. Default: all.")] = None,
) -> None:
    """Write a block of the dense scores (a job run with --store-scores) to an .npy file."""
    import numpy as np

    span, block_cols = read_span(rows, option="--rows"), read_span(cols, option="--cols")
    block = state_of(ctx).client().attribution_scores(job_id, rows=span, cols=block_cols)
    np.save(output, block)
    typer.echo(f"wrote {output}: {block.shape} {block.dtype}")


@attribution_app.command("show")
def show(
    ctx: typer.Context,
    job_id: JobIdArg,
    index: Annotated[int, typer.Argument(min=0, help="The test example (a row of the job's test rows).")],
    k: Annotated[int | None, typer.Option(min=1, help="Training examples per side. Default: the job's top_k.")] = None,
    json_output: JsonFlag = False,
) -> None:
    """A test example's top training examples: their rows, scores and labels."""
    example = state_of(ctx).client().attribution_example(job_id, index, k=k)
    sides = {"proponents": example.proponents, "opponents": example.opponents}
    if wants_json(ctx, json_output):
        print_json({"index": example.index, "label": example.test.label} | {
            side: [{"index": e.index, "score": e.score, "label": e.label} for e in shown]
            for side, shown in sides.items()
        })  # fmt: skip
        return
    typer.echo(f"test example {example.index} (label {format_value(example.test.label)})")
    for side, shown in sides.items():
        typer.echo(f"{side}:")
        print_table(
            [{"rank": r, "train row": e.index, "score": f"{e.score:.4g}", "label": e.label} for r, e in
             enumerate(shown, start=1)],
            ["rank", "train row", "score", "label"], empty="  (none)",
        )  # fmt: skip
