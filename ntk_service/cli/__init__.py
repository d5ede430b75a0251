"""The ``ntk-service`` command line: ``serve``, ``health``, ``models``, ``datasets``, ``kernel``, ``jobs``, ``solve``,
``features``, ``attribution``, ``analyze``, ``plot``.

    $ ntk-service serve --port 8000
    $ export NTK_URL=http://127.0.0.1:8000 NTK_API_KEY=...
    $ ntk-service models register mlp -a '{"family": "mlp", "input_dim": 4, "hidden": [16], "output_dim": 3}'
    $ ntk-service kernel mlp --x1 x.npy -o theta.npy        # (N, N, 3, 3)
    $ ntk-service --json models list

Exit codes: 0 ok, 1 the service refused or failed (``error: <type>: <message>`` on stderr), 2 usage.
"""

from __future__ import annotations

from ntk_service.cli import _health, _kernel, _kernel_family, _serve  # noqa: F401  (commands register on ``app``)
from ntk_service.cli._analyze import analyze_app as _analyze_app
from ntk_service.cli._app import app, main
from ntk_service.cli._attribution import attribution_app as _attribution_app
from ntk_service.cli._datasets import datasets_app as _datasets_app
from ntk_service.cli._models import models_app as _models_app
from ntk_service.cli._plot import plot_app as _plot_app
from ntk_service.cli._solve import features_app as _features_app
from ntk_service.cli._solve import solve_app as _solve_app
from ntk_service.cli.jobs import jobs_app as _jobs_app

app.add_typer(_models_app, name="models")
app.add_typer(_datasets_app, name="datasets")
app.add_typer(_jobs_app, name="jobs")
app.add_typer(_analyze_app, name="analyze")
app.add_typer(_plot_app, name="plot")
app.add_typer(_solve_app, name="solve")
app.add_typer(_features_app, name="features")
app.add_typer(_attribution_app, name="attribution")

__all__ = ["app", "main"]
