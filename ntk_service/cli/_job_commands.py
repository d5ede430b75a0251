"""What the command groups of the job kinds share (``solve``, ``features``, ``attribution``; ``jobs`` shows records
the same way): a job's record on stdout, submit-then-watch, and ``status | watch | cancel | delete`` built from a
``JobCommands`` value by ``add_job_commands``.

    $ ntk-service solve submit mlp ... --watch      # "submitted solve job <id>", progress on stderr, the record
    $ ntk-service solve status | watch | cancel | delete ID

Progress goes to stderr, so ``--json ... --watch`` still shows it on a terminal while stdout keeps the JSON.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TextIO

import typer

from ntk_service.cli._app import JsonFlag, print_json, state_of, wants_json
from ntk_service.cli._output import print_record
from ntk_service.errors import JobNotFound

if TYPE_CHECKING:  # the client (httpx, numpy) is imported when a command runs, not for --help
    from ntk_service.client import Client

__all__ = ["JobCommands", "add_job_commands", "first_found", "progress_stream", "show_job"]

P = ParamSpec("P")

JobCall = Callable[["Client", str], Any]
"""A client method of one job, e.g. ``lambda client, job_id: client.solve_job(job_id)``."""

JobWait = Callable[["Client", str, "TextIO | None"], Any]
"""Follow a job until it ends, its progress lines to the stream (None: quiet); returns the finished job."""


def show_job(ctx: typer.Context, job: Mapping[str, Any], json_output: bool) -> None:
    """A job's record: JSON with ``--json``, else ``key: value`` lines."""
    if wants_json(ctx, json_output):
        print_json(job)
    else:
        print_record(job)


def progress_stream(ctx: typer.Context, json_output: bool) -> TextIO | None:
    """Where watched progress goes: stderr, except under ``--json`` when stderr is not a terminal (quiet)."""
    return None if wants_json(ctx, json_output) and not sys.stderr.isatty() else typer.get_text_stream("stderr")


def first_found(*calls: Callable[P, Any]) -> Callable[P, Any]:
    """One call over several job kinds that share an id space: the first kind that has the job answers (its
    ``JobNotFound`` sends the call to the next kind; the last kind's goes to the user)."""

    def call(*args: P.args, **kwargs: P.kwargs) -> Any:
        for fn in calls[:-1]:
            try:
                return fn(*args, **kwargs)
            except JobNotFound:
                continue
        return calls[-1](*args, **kwargs)

    return call


@dataclass(frozen=True, slots=True)
class JobCommands:
    """What a job kind's commands call on the client and say.

    Attributes:
        noun: the job in messages ("solve job"). get, cancel, delete: the client's calls for one job.
        wait: follow a job until it ends. help: each shared command's help, by name ("status", "watch", "cancel",
            "delete"); ``add_job_commands`` adds those named. id_arg: the ``job_id`` argument's annotation.
    """

    noun: str
    get: JobCall
    wait: JobWait
    cancel: JobCall
    delete: JobCall
    help: Mapping[str, str]
    id_arg: Any

    def submitted(self, ctx: typer.Context, job: Mapping[str, Any], *, watch: bool, json_output: bool) -> None:
        """After a submit: its id (plain output), then with ``watch`` its progress until it ends, and the record
        (``--json`` prints the record either way)."""
        if not wants_json(ctx, json_output):
            typer.echo(f"submitted {self.noun} {job['id']}")
        if watch:
            job = self.wait(state_of(ctx).client(), job["id"], progress_stream(ctx, json_output))
        if watch or wants_json(ctx, json_output):
            show_job(ctx, job, json_output)


def add_job_commands(app: typer.Typer, commands: JobCommands) -> None:
    """Add ``status``, ``watch``, ``cancel`` and ``delete`` (those ``commands.help`` names) to ``app``; each prints
    the job's record (or the deletion's answer) as ``show_job`` does."""
    calls: dict[str, Callable[[typer.Context, Client, str, bool], Any]] = {
        "status": lambda ctx, client, job_id, _: commands.get(client, job_id),
        "watch": lambda ctx, client, job_id, json_output: commands.wait(
            client, job_id, progress_stream(ctx, json_output)
        ),
        "cancel": lambda ctx, client, job_id, _: commands.cancel(client, job_id),
        "delete": lambda ctx, client, job_id, _: commands.delete(client, job_id),
    }
    for name, text in commands.help.items():
        app.command(name, help=text)(_command(name, calls[name], commands.id_arg))


def _command(name: str, call: Callable[[typer.Context, Client, str, bool], Any], id_arg: Any) -> Callable[..., None]:
    def command(ctx: typer.Context, job_id: str, json_output: JsonFlag = False) -> None:
        show_job(ctx, call(ctx, state_of(ctx).client(), job_id, json_output), json_output)

    # The id's help differs per group; typer reads annotations, so this one is set on the function itself.
    command.__annotations__ = {**command.__annotations__, "job_id": id_arg}
    command.__name__ = f"{name}_job"
    return command
