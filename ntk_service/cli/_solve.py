"""``ntk-service solve ...`` and ``ntk-service features ...``: the matrix-free jobs (kernel never formed).

$ ntk-service solve submit mlp --kind kernel_ridge --train dataset:ds_x --targets dataset:ds_y --test dataset:ds_t \\
      --ridge 1e-3 --heldout dataset:ds_v --heldout-targets dataset:ds_vy --watch
                                     # solver / steps / residual / passes / held-out accuracy while it runs
$ ntk-service solve result 3f2a... -o solve.npz    # alpha (N, k), predictions (M, k); exit 1 if not converged
$ ntk-service solve cancel 3f2a...
$ ntk-service solve delete 3f2a...                  # a finished job and its arrays (frees its disk)
$ ntk-service features submit mlp --dataset dataset:ds_x --dim 512 --seed 0 --watch
$ ntk-service features result 9c1e... -o phi.npy --rows 0:1024
$ ntk-service features kernel 9c1e... 7d0b... --mode trace -o theta.npy
$ ntk-service features delete 9c1e...               # a finished job and its Φ
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, cast

import typer

from ntk_service.cli._app import JsonFlag, ModelArg, UsageError, state_of
from ntk_service.cli._inputs import read_span
from ntk_service.cli._job_commands import JobCommands, JobIdArg, JobMethods, add_job_commands
from ntk_service.cli.jobs import _dataset_id
from ntk_service.vocabulary import SolverName

__all__ = ["features_app", "solve_app"]

solve_app = typer.Typer(
    help="Solve jobs: kernel ridge, GP mean or linearized predictions at t = ∞ by the solver table (auto: dense, "
    "preconditioned CG or the parameter-space block method).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
features_app = typer.Typer(
    help="Features jobs: sketched NTK features Φ (N, k, D) of a data set, and kernels from them.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

OutOption = Annotated[Path, typer.Option("-o", "--output", help="Where to write the result.", show_default=False)]
_SIDE = "a data set id (dataset:<id>, dataset:<id>[a:b]) or a .npy file to upload first"


SOLVE_JOBS = JobCommands(
    "solve job",
    (JobMethods("solve_job", "wait_solve_job", "cancel_solve_job", "delete_solve_job"),),
    files="its arrays",
    progress="the solver, its steps, residual, passes and the held-out metric's last value",
)
FEATURES_JOBS = JobCommands(
    "features job",
    (JobMethods("features_job", "wait_features_job", "cancel_features_job", "delete_features_job"),),
    files="its stored Φ",
    progress="the rows done",
)


@solve_app.command("submit")
def solve_submit(
    ctx: typer.Context,
    model: ModelArg,
    kind: Annotated[str, typer.Option(help="kernel_ridge, gp_mean or linearized.", show_default=False)],
    train: Annotated[str, typer.Option(help="Train rows: " + _SIDE, show_default=False)],
    targets: Annotated[str, typer.Option(help="y (N, k) or (N,): " + _SIDE, show_default=False)],
    ridge: Annotated[float, typer.Option(help="λ > 0 on the diagonal (e.g. 1e-3 × Θ's mean diagonal).")],
    test: Annotated[str | None, typer.Option(help="Test rows: " + _SIDE + ". Default: none.")] = None,
    mode: Annotated[str, typer.Option(help="full or trace.")] = "full",
    solver: Annotated[str, typer.Option(help="auto, dense, pcg or block (docs/analysis.md).")] = "auto",
    heldout: Annotated[str | None, typer.Option(help="Held-out inputs, scored per epoch: " + _SIDE)] = None,
    heldout_targets: Annotated[str | None, typer.Option(help="Their targets: " + _SIDE)] = None,
    metric: Annotated[str, typer.Option(help="The held-out metric: accuracy or mse.")] = "accuracy",
    patience: Annotated[
        int | None, typer.Option(min=1, help="Stop when the held-out metric has not improved this many times.")
    ] = None,
    rtol: Annotated[
        float | None, typer.Option(help="Relative residual to stop at. Default: 1e-8 (float64), 1e-4 (float32).")
    ] = None,
    max_passes: Annotated[float | None, typer.Option(help="Passes over the train rows at most.")] = None,
    max_seconds: Annotated[float | None, typer.Option(help="Wall time at most.")] = None,
    block_size: Annotated[int | None, typer.Option(min=1, help="Examples per block (block).")] = None,
    landmarks: Annotated[int | None, typer.Option(min=1, help="Nyström rank cap (pcg) or per block (block).")] = None,
    max_iterations: Annotated[int | None, typer.Option(help="CG iterations at most (pcg).")] = None,
    preconditioner: Annotated[str | None, typer.Option(help="pcg's: auto, nystrom or none.")] = None,
    version: Annotated[int | None, typer.Option(min=1, help="Model version. Default: the latest.")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Then print progress until the job ends.")] = False,
    json_output: JsonFlag = False,
) -> None:
    """Submit a solve job (needs a write key); prints its id."""
    if (heldout is None) != (heldout_targets is None):
        raise UsageError("--heldout and --heldout-targets go together: the held-out inputs and their targets")
    client = state_of(ctx).client()
    held = None
    if heldout is not None and heldout_targets is not None:
        held = {
            "inputs": _dataset_id(ctx, heldout, option="--heldout"),
            "targets": _dataset_id(ctx, heldout_targets, option="--heldout-targets"),
            "metric": metric,
            "patience": patience,
        }
    job = client.submit_solve_job(
        model,
        kind=cast(Literal["kernel_ridge", "gp_mean", "linearized"], kind),  # the server refuses others (422)
        train=_dataset_id(ctx, train, option="--train"),
        targets=_dataset_id(ctx, targets, option="--targets"),
        test=None if test is None else _dataset_id(ctx, test, option="--test"),
        mode=cast(Literal["full", "trace"], mode),
        ridge=ridge,
        rtol=rtol,
        max_iterations=max_iterations,
        preconditioner=cast(Literal["auto", "nystrom", "none"] | None, preconditioner),
        version=version,
        solver=cast(SolverName, solver),  # the server refuses others (422)
        heldout=held,
        max_passes=max_passes,
        max_seconds=max_seconds,
        block_size=block_size,
        landmarks=landmarks,
    )
    SOLVE_JOBS.submitted(ctx, job, watch=watch, json_output=json_output)


add_job_commands(solve_app, SOLVE_JOBS)


@solve_app.command("result")
def solve_result(ctx: typer.Context, job_id: JobIdArg, output: OutOption) -> None:
    """Write alpha and predictions to an .npz file; exit 1 (after writing) when the solve did not converge."""
    import numpy as np

    result = state_of(ctx).client().solve_job_result(job_id)
    arrays = {"alpha": result.alpha} | ({} if result.predictions is None else {"predictions": result.predictions})
    np.savez(output, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    typer.echo(
        f"wrote {output}: alpha {result.alpha.shape}"
        + ("" if result.predictions is None else f", predictions {result.predictions.shape}")
        + f"; {result.iterations} iterations, residual {max(result.residual):.3g}"
    )
    if not result.converged:
        typer.echo(f"solve job {job_id} did not converge ({result.stop_reason})", err=True)
        raise typer.Exit(1)


@features_app.command("submit")
def features_submit(
    ctx: typer.Context,
    model: ModelArg,
    dataset: Annotated[str, typer.Option(help="Rows: " + _SIDE, show_default=False)],
    dim: Annotated[int, typer.Option(help="D, features per output.", show_default=False)],
    seed: Annotated[int, typer.Option(help="The sketch's seed (same seed, D, params: same Φ).")] = 0,
    dtype: Annotated[str, typer.Option(help="float32 or float64.")] = "float32",
    sketch: Annotated[str | None, typer.Option(help="structured or gaussian. Default: the server's.")] = None,
    version: Annotated[int | None, typer.Option(min=1, help="Model version. Default: the latest.")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Then print progress until the job ends.")] = False,
    json_output: JsonFlag = False,
) -> None:
    """Submit a features job (needs a write key); prints its id."""
    client = state_of(ctx).client()
    job = client.submit_features_job(
        model,
        dataset=_dataset_id(ctx, dataset, option="--dataset"),
        dim=dim,
        seed=seed,
        dtype=cast(Literal["float32", "float64"], dtype),
        version=version,
        sketch=cast(Literal["structured", "gaussian"] | None, sketch),
    )
    FEATURES_JOBS.submitted(ctx, job, watch=watch, json_output=json_output)


add_job_commands(features_app, FEATURES_JOBS)


@features_app.command("result")
def features_result(
    ctx: typer.Context,
    job_id: JobIdArg,
    output: OutOption,
    rows: Annotated[str | None, typer.Option(help="a:b, rows a..b-1. Default: all.")] = None,
) -> None:
    """Write Φ[rows] (rows, k, D) to an .npy file."""
    import numpy as np

    phi = state_of(ctx).client().features_result(job_id, rows=read_span(rows, option="--rows"))
    np.save(output, phi)
    typer.echo(f"wrote {output}: {phi.shape} {phi.dtype}")


@features_app.command("kernel")
def features_kernel(
    ctx: typer.Context,
    x1_job: JobIdArg,
    output: OutOption,
    x2_job: Annotated[str | None, typer.Argument(help="The second features job. Default: x1's.")] = None,
    mode: Annotated[str, typer.Option(help="full or trace.")] = "full",
) -> None:
    """Write Φ1 Φ2ᵀ (an estimate of Θ) of two features jobs to an .npy file."""
    import numpy as np

    theta = state_of(ctx).client().feature_kernel(x1_job, x2_job, mode=cast(Literal["full", "trace"], mode))
    np.save(output, theta)
    typer.echo(f"wrote {output}: {theta.shape}")
