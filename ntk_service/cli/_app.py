"""The ``ntk-service`` typer app: global options, the one place errors become exit codes, and ``main()``.

Exit codes: 0 success; 1 the service refused or failed (the server's error type and message, one line on
stderr); 2 usage (bad options, unreadable files, invalid configuration).

``--help`` stays fast: this module imports typer and the exception tree only; the client (httpx, numpy) and the
server (torch, fastapi) are imported inside the commands that use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from ntk_service import __version__
from ntk_service.errors import NtkServiceError

if TYPE_CHECKING:
    from ntk_service.client import Client

__all__ = [
    "DEFAULT_URL",
    "CliState",
    "JsonFlag",
    "ModelArg",
    "UsageError",
    "app",
    "fail",
    "main",
    "print_json",
    "state_of",
    "wants_json",
]

DEFAULT_URL = "http://127.0.0.1:8000"
"""Where ``ntk-service serve`` listens by default (NTK_HOST / NTK_PORT defaults)."""

EXAMPLES = """\b
Examples:
  ntk-service serve                                            # the server: http://127.0.0.1:8000, console at /
  export NTK_URL=http://127.0.0.1:8000 NTK_API_KEY=...         # where and who, for the commands below
  ntk-service models register mlp -a '{"family": "mlp", "input_dim": 4, "hidden": [64], "output_dim": 3}'
  ntk-service models list
  ntk-service kernel mlp --x1 x.npy --mode trace -o theta.npy  # x.npy: (N, 4) float32
  ntk-service jobs submit mlp --x1 x.npy --mode trace --watch  # a whole data set's kernel
  ntk-service jobs list
  ntk-service jobs result JOB_ID -o theta.npy                  # or -o kernel.zarr.zip: the Zarr group
  ntk-service --json jobs status JOB_ID                        # any command: JSON on stdout

\b
Server: NTK_URL, else http://$NTK_HOST:$NTK_PORT (as `serve` binds), else http://127.0.0.1:8000.
Each command has its own --help; docs/client.md has the whole tour."""
"""The top-level ``--help`` epilog (``\\b`` keeps click from rewrapping the lines)."""

EXIT_SERVICE_ERROR = 1
"""The server (or the connection to it) failed the request."""

EXIT_USAGE = 2
"""The command line itself is wrong: click's own code for usage errors."""


class UsageError(Exception):
    """A command-line problem found inside a command (an unreadable file, a malformed option value)."""


@dataclass
class CliState:
    """Global options, shared by every command through ``ctx.obj``."""

    url: str | None = None
    api_key: str | None = None
    json_output: bool = False
    _client: Client | None = field(default=None, repr=False)

    def client(self) -> Client:
        """The client for ``--url`` / ``--api-key``, built on first use (imports httpx and numpy only then); without
        ``--url`` or ``NTK_URL`` it connects where ``NTK_HOST`` / ``NTK_PORT`` say (``Client``'s own default)."""
        if self._client is None:
            from ntk_service.client import Client

            self._client = Client(self.url, api_key=self.api_key)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class _ErrorReportingGroup(TyperGroup):
    """Turns domain errors into one stderr line and an exit code, for every (sub)command at once."""

    def invoke(self, ctx: Any) -> Any:  # typer._click.Context (typer vendors click)
        try:
            return super().invoke(ctx)
        except NtkServiceError as exc:
            fail(f"{exc.error_type}: {exc.message}", code=EXIT_SERVICE_ERROR)
        except UsageError as exc:
            fail(str(exc), code=EXIT_USAGE)


def fail(message: str, *, code: int) -> NoReturn:
    """Print ``error: <message>`` on stderr (one line) and exit with ``code``."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(code)


def state_of(ctx: typer.Context) -> CliState:
    """The global options of this invocation."""
    obj = ctx.find_root().obj
    if not isinstance(obj, CliState):  # a command invoked without the root callback (never from the CLI)
        obj = ctx.find_root().obj = CliState()
    return obj


JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
"""``--json`` on a command (the same flag is accepted before the command too)."""

ModelArg = Annotated[str, typer.Argument(help="The model's registered name.", show_default=False)]
"""A command's MODEL argument."""


def wants_json(ctx: typer.Context, flag: bool) -> bool:
    """True when ``--json`` was given before or after the command."""
    return flag or state_of(ctx).json_output


def print_json(value: Any) -> None:
    """Machine output: indented JSON on stdout (numpy values included)."""
    import orjson

    from ntk_service.wire import json_dumps

    typer.echo(orjson.dumps(orjson.loads(json_dumps(value)), option=orjson.OPT_INDENT_2).decode())


app = typer.Typer(
    name="ntk-service",
    cls=_ErrorReportingGroup,
    help="Empirical neural tangent kernels of PyTorch models: run the server, or talk to one.",
    epilog=EXAMPLES,
    no_args_is_help=True,
    rich_markup_mode=None,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ntk-service {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option(
            envvar="NTK_URL",
            help="Server base URL. Default: $NTK_URL, else http://$NTK_HOST:$NTK_PORT when either is set (where "
            "`serve` listens), else http://127.0.0.1:8000.",
            show_default=False,
        ),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="NTK_API_KEY", help="API key (sent as a Bearer token).", show_default=False)
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    state = CliState(url=url or None, api_key=api_key or None, json_output=json_output)
    ctx.obj = state
    ctx.call_on_close(state.close)


def main() -> None:
    """Entry point of the ``ntk-service`` console script."""
    app(prog_name="ntk-service")
