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
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, TextIO

import typer

from ntk_service.cli._app import JsonFlag, state_of, wants_json
from ntk_service.cli._output import print_answer
from ntk_service.errors import JobNotFound

if TYPE_CHECKING:  # the client (httpx, numpy) is imported when a command runs, not for --help
    from ntk_service.client import Client

__all__ = ["JobCommands", "JobIdArg", "JobMethods", "add_job_commands", "progress_stream"]

JobIdArg = Annotated[str, typer.Argument(help="The job id (from `submit`).", show_default=False)]
"""A job group's id argument (a group whose ids come from other commands names its own)."""


class JobMethods(NamedTuple):
    """The client's methods of one job kind, by name (``Client`` has each; a test holds it): the job, follow it
    until it ends (``progress=`` its lines' stream), cancel it, delete it."""

    get: str
    wait: str
    cancel: str
    delete: str


def progress_stream(ctx: typer.Context, json_output: bool) -> TextIO | None:
    """Where watched progress goes: stderr, except under ``--json`` when stderr is not a terminal (quiet)."""
    return None if wants_json(ctx, json_output) and not sys.stderr.isatty() else typer.get_text_stream("stderr")


@dataclass(frozen=True, slots=True)
class JobCommands:
    """A job group's shared commands: what they call on the client and what their help says.

    Attributes:
        noun: the job in messages and help ("solve job"). kinds: the kinds the group's ids may name, tried in
            order (the first that has the job answers). id_arg: the ``job_id`` argument's annotation.
        files: what deleting a finished job removes. progress: what ``watch`` prints.
    """

    noun: str
    kinds: tuple[JobMethods, ...]
    id_arg: Any = JobIdArg
    files: str = "its files"
    progress: str = "progress"

    def call(self, client: Client, method: str, job_id: str, **options: Any) -> Any:
        """``method`` ("get", "wait", "cancel", "delete") of the first kind that has the job (a ``JobNotFound``
        sends the call to the next kind; the last kind's goes to the user)."""
        for kind in self.kinds[:-1]:
            try:
                return getattr(client, getattr(kind, method))(job_id, **options)
            except JobNotFound:
                continue
        return getattr(client, getattr(self.kinds[-1], method))(job_id, **options)

    def submitted(self, ctx: typer.Context, job: Mapping[str, Any], *, watch: bool, json_output: bool) -> None:
        """After a submit: its id (plain output), then with ``watch`` its progress until it ends, and the record
        (``--json`` prints the record either way)."""
        if not wants_json(ctx, json_output):
            typer.echo(f"submitted {self.noun} {job['id']}")
        if watch:
            client = state_of(ctx).client()
            job = self.call(client, "wait", job["id"], progress=progress_stream(ctx, json_output))
        if watch or wants_json(ctx, json_output):
            print_answer(ctx, json_output, job)

    def help(self) -> dict[str, str]:
        """Each shared command's help."""
        return {
            "status": f"Show one {self.noun}.",
            "watch": f"Print {self.progress} until the {self.noun} ends.",
            "cancel": f"Cancel a queued or running {self.noun}.",
            "delete": f"Delete a finished {self.noun} and {self.files} (a queued or running one is cancelled instead).",
        }


def add_job_commands(app: typer.Typer, commands: JobCommands) -> None:
    """Add ``status``, ``watch``, ``cancel`` and ``delete`` to ``app``; each prints the job's record (or the
    deletion's answer) as ``print_answer`` does."""
    for name, text in commands.help().items():
        app.command(name, help=text)(_command(name, commands))


def _command(name: str, commands: JobCommands) -> Callable[..., None]:
    method = "get" if name == "status" else name

    def command(ctx: typer.Context, job_id: str, json_output: JsonFlag = False) -> None:
        options = {"progress": progress_stream(ctx, json_output)} if method == "wait" else {}
        print_answer(ctx, json_output, commands.call(state_of(ctx).client(), method, job_id, **options))

    # The id's help differs per group; typer reads annotations, so this one is set on the function itself.
    command.__annotations__ = {**command.__annotations__, "job_id": commands.id_arg}
    command.__name__ = f"{name}_job"
    return command
