"""``cli/_job_commands.py``: the job groups' tables name methods the client has, and the shared commands exist."""

from __future__ import annotations

import inspect

import pytest
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.cli._attribution import ATTRIBUTION_JOBS, EITHER_JOBS, FEATURES_JOBS
from ntk_service.cli._job_commands import JobCommands
from ntk_service.cli._solve import FEATURES_JOBS as SKETCH_JOBS
from ntk_service.cli._solve import SOLVE_JOBS
from ntk_service.client import Client


@pytest.mark.parametrize("commands", [SOLVE_JOBS, SKETCH_JOBS, FEATURES_JOBS, ATTRIBUTION_JOBS, EITHER_JOBS])
def test_every_named_method_is_a_client_method_of_one_job(commands: JobCommands) -> None:
    for kind in commands.kinds:
        for method, name in kind._asdict().items():
            fn = getattr(Client, name, None)
            assert callable(fn), f"{commands.noun}: Client has no {name} ({method})"
            assert "job_id" in inspect.signature(fn).parameters, name
            if method == "wait":
                assert "progress" in inspect.signature(fn).parameters, name


@pytest.mark.parametrize("group", ["solve", "features", "attribution"])
def test_each_job_group_has_the_shared_commands(group: str) -> None:
    listed = CliRunner().invoke(app, [group, "--help"]).output
    for command in ("status", "watch", "cancel", "delete"):
        assert f"  {command} " in listed, listed
