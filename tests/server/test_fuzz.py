"""Fuzzing the whole API with schemathesis against a real uvicorn process with keys.

Every operation of the server's own OpenAPI document is exercised in all four schemathesis phases (the schema's
examples, boundary coverage, random fuzzing, stateful sequences through inferred links) with a fixed seed and in
deterministic mode, so a run is reproducible; it fails on any 5xx and on any response that the document does not
describe (status code, content type, headers, body schema). The budget is fixed by ``MAX_EXAMPLES`` (about a
minute on an idle 2-core machine); a failure prints schemathesis' report with a ``curl`` line to reproduce it.

Each case a run has found is kept in ``FUZZER_FINDINGS`` and replayed on every run (against the session's server,
in well under a second), since a seeded fuzzer need not reach the same case again once the schema changes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import WRITE_KEY, LiveServer
from tests.server.support import TINY_ARCHITECTURES

SEED = 20261201
"""Fixed (and no example database): the same requests in the same order every run."""

MAX_EXAMPLES = 20
"""Test cases per operation in the fuzzing phase (the coverage phase adds its boundary cases on top, and the
examples and stateful phases run whatever this is): 20 keeps every operation in every phase at half the time of 40."""

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "unsupported_method",
    "use_after_free",
    "ensure_resource_availability",
)
"""Everything that must hold for any input. Left out: positive_data_acceptance (a schema-valid name of a model that
does not exist rightly gets 404), the auth-bypass probes ignored_auth/object_level_authorization (keys are checked
by tests/server/test_auth.py; a read key legitimately reads every object), missing_required_header (no route
requires a header beyond Authorization) and allow_header_conformance (405 answers name every method of the path,
which schemathesis counts differently for paths shared by two routers)."""

TIME_BUDGET_S = 420
"""Hard stop for the schemathesis process: with the kernel family and analysis routes (33 operations) the run took
about 130 s on an idle 2-core machine at 40 examples and over 180 s under contention; a run cut short prints what it
had found."""


FUZZER_FINDINGS = [
    pytest.param(
        "/v1/models/{model}/predict",
        {
            "x_train": {"shape": [1, 4], "dtype": "float32", "data": [0.0, 1.0, 2.0, 3.0]},
            "y_train": {"data": [], "shape": [59, 0, 5401, 10325661109373530, 3], "dtype": "int64"},
            "times": [1.0],
            "learning_rate": 0.1,
        },
        422,
        "y_train.shape: [59,0,5401,10325661109373530,3] of int64 is beyond the largest array numpy can describe",
        id="empty-y_train-with-a-shape-numpy-cannot-describe",
    ),
]
"""(path, JSON body, expected status, expected message fragment): cases the fuzzer found answering 5xx."""


@pytest.mark.parametrize(("path", "body", "status", "message"), FUZZER_FINDINGS)
def test_fuzzer_findings_stay_fixed(live_server: LiveServer, path: str, body: dict, status: int, message: str) -> None:
    with live_server.client("write") as client:
        model = "fuzz-findings-mlp"
        if client.get(f"/v1/models/{model}").status_code == 404:
            architecture = {"family": "mlp", "input_dim": 4, "hidden": [8], "output_dim": 3}
            response = client.post("/v1/models", json={"name": model, "architecture": architecture})
            assert response.status_code == 201, response.text
        response = client.post(path.format(model=model), json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"], response.text


def _schemathesis() -> str:
    beside = Path(sys.executable).parent / "schemathesis"
    assert beside.exists(), "schemathesis not found: install the dev extra (pip install -e '.[server,dev]')"
    return str(beside)


@pytest.mark.slow
def test_fuzz_every_operation(start_server: Callable[..., LiveServer], tmp_path: Path) -> None:
    server = start_server(max_body_bytes=str(2**20), max_json_response_bytes=str(64 * 2**10))
    with server.client("write") as client:
        # A model under the schema's example name, so the examples phase reaches real objects.
        response = client.post("/v1/models", json={"name": "mnist-mlp", "architecture": TINY_ARCHITECTURES["mlp"]})
        assert response.status_code == 201, response.text
    report = tmp_path / "schemathesis"
    command = [
        _schemathesis(),
        "run",
        f"{server.url}/openapi.json",
        "--seed",
        str(SEED),
        "--generation-database",
        "none",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--workers",
        "1",
        "--checks",
        ",".join(CHECKS),
        "--header",
        f"Authorization: Bearer {WRITE_KEY}",
        "--suppress-health-check",
        "all",
        "--request-timeout",
        "30",
        "--no-color",
        "--report-dir",
        str(report),
    ]
    # The hooks by file, and tmp_path as the working directory: schemathesis keeps a cache in its working directory.
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(Path(__file__).with_name("fuzz_hooks.py"))}
    log = tmp_path / "schemathesis.log"
    start = time.monotonic()
    with log.open("w") as sink:  # a file, not a pipe: a run cut short by the timeout still shows its findings
        try:
            result = subprocess.run(
                command, cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=TIME_BUDGET_S
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"schemathesis ran over {TIME_BUDGET_S} s; its output so far:\n{log.read_text()[-8000:]}")
    elapsed = time.monotonic() - start
    output = log.read_text()
    print(f"schemathesis: {elapsed:.1f} s\n{output[-4000:]}")
    assert result.returncode == 0, (
        f"schemathesis found problems ({elapsed:.0f} s):\n{output}\nserver log:\n{server.log()[-5000:]}"
    )
    # Every operation of the document tested, in every phase (the smaller budget must not drop any of them).
    counts = re.search(r"Selected: (\d+)/(\d+)\s+Tested: (\d+)", output)
    assert counts and counts[1] == counts[2] == counts[3] and int(counts[1]) > 0, output[-4000:]
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert f"✅ {phase}" in output, f"phase {phase} did not run and pass:\n{output[-4000:]}"
    assert server.process.poll() is None, "the server died during fuzzing:\n" + server.log()[-5000:]
