"""``ntk-service attribution`` used as a user would (CliRunner against the session's real server): the features of
two checkpoints with --watch, a score job over them, the answers written to files equal the client's, one test
example's proponents shown, the dense scores, status, list, delete; a bad option exits 2, a refused request 1."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ntk_service.cli import app
from ntk_service.client import Client
from tests.conftest import LiveServer
from tests.server.digits import digits, register_digits


@pytest.fixture
def cli(live_server: LiveServer) -> Any:
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        env = {"NTK_URL": live_server.url, "NTK_API_KEY": live_server.write_key}
        return runner.invoke(app, list(args), env=env)

    return invoke


def _ok(result: Any) -> Any:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result


def _submitted(result: Any) -> str:
    """The id in ``submitted ... job <id>``, the first line a submission prints."""
    first = str(result.stdout.splitlines()[0])
    assert first.startswith("submitted attribution"), result.stdout
    return first.split()[-1]


def test_attribution_commands(cli: Any, live_server: LiveServer, tmp_path: Path) -> None:
    name = f"cli-attr-{uuid.uuid4().hex[:8]}"
    problem = digits()
    with Client(live_server.url, api_key=live_server.write_key) as client:
        ids = register_digits(client, name, problem)
    common = ["--train", f"dataset:{ids.x_train}", "--labels", f"dataset:{ids.y_train}", "--dim", "256"]

    features = []
    for seed, version in enumerate(ids.versions[:2]):
        done = _ok(cli("attribution", "features", name, *common, "--version", str(version), "--seed", str(seed),
                       "--watch"))  # fmt: skip
        features.append(_submitted(done))
        assert "rows 200/200" in done.stderr  # the progress line while it ran
    scored = _ok(cli("attribution", "score", *features, "--test", f"dataset:{ids.x_test}[0:10]", "--test-labels",
                     f"dataset:{ids.y_test}[0:10]", "--top-k", "4", "--store-scores", "--watch"))  # fmt: skip
    job_id = _submitted(scored)
    assert "succeeded  done  units 4/4  test rows 20/20  train rows 200/200" in scored.stderr  # progress lines
    assert "status" in scored.stdout  # then the job

    out = tmp_path / "top.npz"
    _ok(cli("attribution", "result", job_id, "-o", str(out)))
    with Client(live_server.url, api_key=live_server.write_key) as client:
        expected = client.attribution_result(job_id)
        dense = client.attribution_scores(job_id)
    with np.load(out) as written:
        assert set(written.files) == {"proponents", "proponent_scores", "opponents", "opponent_scores",
                                      "total_influence"}  # fmt: skip
        np.testing.assert_array_equal(written["proponents"], expected.proponents)  # type: ignore[arg-type]
        np.testing.assert_array_equal(written["total_influence"], expected.total_influence)  # type: ignore[arg-type]

    shown = _ok(cli("attribution", "show", job_id, "3", "--k", "2"))
    assert f"test example 3 (label {problem.y_test[3]})" in shown.stdout
    assert expected.proponents is not None
    first = int(expected.proponents[3, 0])
    assert any(line.split()[:2] == ["1", str(first)] for line in shown.stdout.splitlines()), shown.stdout
    as_json = json.loads(_ok(cli("--json", "attribution", "show", job_id, "3")).stdout)
    assert [p["index"] for p in as_json["proponents"]] == expected.proponents[3].tolist()
    assert [p["label"] for p in as_json["proponents"]] == problem.y_train[expected.proponents[3]].tolist()

    scores = tmp_path / "scores.npy"
    _ok(cli("attribution", "scores", job_id, "-o", str(scores), "--rows", "2:5", "--cols", "0:50"))
    np.testing.assert_array_equal(np.load(scores), dense[2:5, :50])

    status = json.loads(_ok(cli("--json", "attribution", "status", features[0])).stdout)
    assert status["job"] == "attribution-features" and status["spec"]["version"] == ids.versions[0]
    listed = _ok(cli("attribution", "list")).stdout
    assert job_id in listed and features[1] in listed
    lines = {line.split()[0]: line.split()[1:] for line in listed.splitlines()}
    assert lines["ID"] == ["JOB", "MODEL", "PROGRESS"]
    assert lines[job_id][:4] == ["attribution", name, "succeeded", "done"], listed
    assert lines[features[1]] == ["attribution-features", name, "succeeded", "rows", "200/200"], listed

    bad = cli("attribution", "run", name, *common, "--versions", "two")
    assert bad.exit_code == 2 and "--versions: expected integers" in bad.stderr
    refused = cli("attribution", "score", features[0], "--test", f"dataset:{ids.x_test}", "--top-k", "999")
    assert refused.exit_code == 1 and "top_k must be in [0, N=200]" in refused.stderr
    deleted = json.loads(_ok(cli("--json", "attribution", "delete", job_id)).stdout)
    assert deleted["deleted"] == "job"
