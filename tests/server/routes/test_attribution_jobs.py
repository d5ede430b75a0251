"""Data attribution as a user meets it: a real uvicorn server, the Python client, an MLP on a slice of digits with
three checkpoints uploaded as model versions.

- The service's scores (dense, top-k, total and self influence) equal ``fit_attributor``'s on the same checkpoints;
  the library itself is tested against TRAK's formula in parameter space (tests/attribution), and here the exact
  features are checked against that formula too, on a tiny problem, for both losses.
- A checkpoint's training side is computed once and reused by attribution jobs over other test sets.
- Jobs cancel; bad input is a 4xx saying what to fix; a server killed with SIGKILL mid-job resumes both kinds of job
  to the bits of uninterrupted runs, without computing a recorded unit again.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from ntk_service.attribution import AttributionOptions, fit_attributor
from ntk_service.client import Client
from ntk_service.errors import (
    Conflict,
    DatasetNotFound,
    IncompatibleCheckpoint,
    InvalidInput,
    JobNotFinished,
    JobNotFound,
    MemoryEstimateExceeded,
    ModelNotFound,
    ResultNotFound,
    ShapeMismatch,
)
from tests.attribution.conftest import reference_scores
from tests.conftest import LiveServer, start_live_server
from tests.jobs.conftest import SLOW_MODEL, TINY_MLP, tiny_model_from_weights
from tests.server.digits import Digits, RegisteredDigits, digits, register_digits

D = 512
"""The sketch's D in these tests (the library's default is 2048; the comparison does not depend on it)."""

_SETTINGS = {"memory_budget_bytes": str(256 * 2**20), "max_body_bytes": str(8 * 2**20)}


class _Server:
    """The module's server; the SIGKILL test replaces it with a restarted one on the same data and port."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.live: LiveServer = start_live_server(data_dir, **_SETTINGS)

    def client(self) -> Client:
        return Client(self.live.url, api_key=self.live.write_key, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    held = _Server(tmp_path_factory.mktemp("attribution") / "data")
    yield held
    held.live.stop()


@pytest.fixture(scope="module")
def problem() -> Digits:
    return digits()


@pytest.fixture(scope="module")
def registered(server: _Server, problem: Digits) -> RegisteredDigits:
    with server.client() as client:
        return register_digits(client, "digits", problem)


def _finished(get: Callable[[str], Any], job_id: str, timeout: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (job := get(job_id))["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']} after {timeout} s"
        time.sleep(0.05)
    return dict(job)


def test_the_services_scores_are_the_librarys_on_the_same_checkpoints(
    server: _Server, problem: Digits, registered: RegisteredDigits
) -> None:
    with server.client() as client:
        result = client.attribute(
            "digits", train=registered.x_train, labels=registered.y_train, test=registered.x_test,
            test_labels=registered.y_test, versions=registered.versions, dim=D, top_k=5, store_scores=True,
            self_influence=True, progress=None, timeout_s=180,
        )  # fmt: skip
        dense = client.attribution_scores(result.job)
        block = client.attribution_scores(result.job, rows=(3, 7), cols=(10, 50))
        job = client.attribution_job(result.job)
    attributor = fit_attributor(
        problem.model(), torch.from_numpy(problem.x_train), torch.from_numpy(problem.y_train),
        checkpoints=list(problem.checkpoints), options=AttributionOptions(dim=D),
    )  # fmt: skip
    x_test, y_test = torch.from_numpy(problem.x_test), torch.from_numpy(problem.y_test)
    expected = attributor.scores(x_test, y_test)
    scale = float(np.abs(expected).max())
    assert dense.shape == (40, 200) and dense.dtype == np.float32
    np.testing.assert_allclose(dense, expected, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_array_equal(block, dense[3:7, 10:50])
    # the top 5 of each test example are the 5 largest (and smallest) of the library's scores, in order
    assert result.proponents is not None and result.opponents is not None
    assert result.proponents.shape == result.opponents.shape == (40, 5)
    largest, smallest = -np.sort(-expected, axis=1)[:, :5], np.sort(expected, axis=1)[:, :5]
    np.testing.assert_allclose(np.take_along_axis(expected, result.proponents, 1), largest, atol=1e-5 * scale)
    np.testing.assert_allclose(np.take_along_axis(expected, result.opponents, 1), smallest, atol=1e-5 * scale)
    np.testing.assert_allclose(result.proponent_scores, largest, rtol=1e-4, atol=1e-5 * scale)  # type: ignore[arg-type]
    total = attributor.total_influence(x_test, y_test)
    np.testing.assert_allclose(result.total_influence, total, rtol=1e-5, atol=1e-6 * float(np.abs(total).max()))  # type: ignore[arg-type]
    own = attributor.self_influence()
    np.testing.assert_allclose(result.self_influence, own, rtol=1e-5, atol=1e-6 * float(np.abs(own).max()))  # type: ignore[arg-type]
    assert result.lam == pytest.approx([f.lam for f in attributor.fitted], rel=1e-6)
    assert job["spec"]["versions"] == list(registered.versions) and job["result"]["checkpoints"] == 3
    assert job["progress"]["stage"] == "done" and job["progress"]["units_done"] == job["progress"]["units_total"]
    # the proponents of a digit are mostly images of that digit (chance: 0.1), its opponents rarely
    same = (problem.y_train[result.proponents] == problem.y_test[:, None]).mean()
    assert same > 0.5 > (problem.y_train[result.opponents] == problem.y_test[:, None]).mean()


def test_a_checkpoints_features_are_computed_once_and_score_any_test_set(
    server: _Server, registered: RegisteredDigits
) -> None:
    with server.client() as client:
        options: dict[str, Any] = {"train": registered.x_train, "labels": registered.y_train, "dim": D}
        first = client.attribute("digits", test=registered.x_test, versions=[2], progress=None, **options)
        stored = client.list_attribution_features()
        half = {"dataset": registered.x_test, "start": 0, "stop": 20}
        second = client.attribute("digits", test=half, versions=[2], progress=None, **options)
        assert len(client.list_attribution_features()) == len(stored)  # no new features job: the stored one
        jobs = [client.attribution_job(r.job) for r in (first, second)]
    assert jobs[0]["spec"]["features"] == jobs[1]["spec"]["features"]
    assert jobs[0]["spec"]["test_labels_dataset"] is None  # no labels: the predicted class is measured
    np.testing.assert_array_equal(second.proponents, first.proponents[:20])  # type: ignore[index]
    # total influence is linear in the test set: the half's is not the whole's
    assert second.total_influence is not None and not np.allclose(second.total_influence, first.total_influence)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_exact_features_give_the_exact_formula_on_a_tiny_problem(server: _Server, loss: str) -> None:
    rng = np.random.default_rng(4)
    x, xq = rng.standard_normal((12, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)
    y, yq = (rng.integers(0, 3, 12), rng.integers(0, 3, 5)) if loss == "cross_entropy" else (
        rng.standard_normal((12, 3)), rng.standard_normal((5, 3)))  # fmt: skip
    name = f"tiny-{loss}"
    with server.client() as client:
        client.register_model(name, TINY_MLP, seed=0)
        ids = [client.upload_dataset(a)["id"] for a in (x, y, xq, yq)]
        result = client.attribute(
            name, train=ids[0], labels=ids[1], test=ids[2], test_labels=ids[3], loss=loss,  # type: ignore[arg-type]
            features="exact", dtype="float64", ridge=0.1, store_scores=True, top_k=3, progress=None,
        )  # fmt: skip
        scores = client.attribution_scores(result.job)
        model = tiny_model_from_weights(client.download_weights(name))
    expected = reference_scores(
        model, torch.from_numpy(x), torch.as_tensor(y), torch.from_numpy(xq), torch.as_tensor(yq), loss=loss, ridge=0.1
    )
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())  # stored as float32


def test_jobs_cancel_between_units(server: _Server, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gated = {**SLOW_MODEL, "kwargs": {"in_dim": 4, "out_dim": 3, "delay_s": 0.0, "gate": str(gate)}}
    rng = np.random.default_rng(1)
    gate.touch()  # open while the model registers and the submissions probe it
    with server.client() as client:
        client.register_model("gated", gated, seed=0)
        x, y = client.upload_dataset(rng.standard_normal((6, 4)).astype(np.float32)), client.upload_dataset(
            rng.integers(0, 3, 6))  # fmt: skip
        done = client.submit_attribution_features("gated", train=x["id"], labels=y["id"], dim=8)
        assert client.wait_attribution_features(done["id"], progress=None, timeout_s=120)["status"] == "succeeded"
        held = client.submit_attribution_features("gated", train=x["id"], labels=y["id"], dim=8, rows_per_chunk=1)
        scoring = client.submit_attribution(done["id"], test=x["id"], test_rows_per_chunk=1)
        gate.unlink()  # from here their units wait inside the model
        try:
            for get, job_id in ((client.attribution_features_job, held["id"]), (client.attribution_job, scoring["id"])):
                deadline = time.monotonic() + 60
                while get(job_id)["status"] != "running":
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            with pytest.raises(Conflict, match="retry when") as busy:  # the running scoring job reads it
                client.delete_attribution_features(done["id"])
            assert busy.value.http_status == 409  # type: ignore[attr-defined]
            assert client.cancel_attribution_features(held["id"])["status"] == "cancelled"
            assert client.cancel_attribution_job(scoring["id"])["status"] == "cancelled"
        finally:
            gate.touch()
        for get, job_id in ((client.attribution_features_job, held["id"]), (client.attribution_job, scoring["id"])):
            time.sleep(0.5)  # the unit that was running ends; no other starts
            assert get(job_id)["status"] == "cancelled"
        with pytest.raises(JobNotFinished, match="is cancelled") as caught:
            client.submit_attribution(held["id"], test=x["id"])  # scoring needs features that succeeded
        assert caught.value.http_status == 409  # type: ignore[attr-defined]
        deleted = client.delete_attribution_features(held["id"])
        assert deleted["deleted"] == "job"
        with pytest.raises(JobNotFound):
            client.attribution_features_job(held["id"])


def _status(error: pytest.ExceptionInfo[Exception]) -> int:
    return int(error.value.http_status)  # type: ignore[attr-defined]


def test_bad_input_is_a_4xx_saying_what_to_fix(server: _Server, registered: RegisteredDigits, problem: Digits) -> None:
    rng = np.random.default_rng(2)
    with server.client() as client:
        train = {"train": registered.x_train, "labels": registered.y_train}
        # the features job: D beyond the limits, unknown names, labels of the wrong shape, kind or range
        with pytest.raises(InvalidInput, match="dim") as error:
            client.submit_attribution_features("digits", dim=10**6, **train)
        assert _status(error) == 422
        with pytest.raises(ModelNotFound):
            client.submit_attribution_features("no-such-model", **train)
        with pytest.raises(DatasetNotFound):
            client.submit_attribution_features("digits", train="ds_" + "0" * 24, labels=registered.y_train)
        short = client.upload_dataset(problem.y_train[:150])["id"]
        with pytest.raises(ShapeMismatch, match="labels rows .* are 150 rows, the train rows .* are 200"):
            client.submit_attribution_features("digits", train=registered.x_train, labels=short)
        floats = client.upload_dataset(problem.y_train.astype(np.float32))["id"]
        with pytest.raises(InvalidInput, match="integer class indices"):
            client.submit_attribution_features("digits", train=registered.x_train, labels=floats)
        outside = client.upload_dataset(np.where(np.arange(200) == 7, 10, problem.y_train))["id"]
        with pytest.raises(InvalidInput, match=r"labels\[7\] = 10 is not a class index in \[0, 10\)"):
            client.submit_attribution_features("digits", train=registered.x_train, labels=outside)
        targets = client.upload_dataset(rng.standard_normal((200, 3)))["id"]
        with pytest.raises(ShapeMismatch, match=r"expected \(200, 10\)") as error:
            client.submit_attribution_features("digits", train=registered.x_train, labels=targets, loss="mse")
        assert _status(error) == 422
        with pytest.raises(MemoryEstimateExceeded, match="over the memory budget") as error:
            client.submit_attribution_features("digits", dim=65_536, **train)  # F alone is 34 GB
        assert _status(error) == 413

        # the attribution job: unknown features, checkpoints of another architecture, test inputs of another shape
        features = client.submit_attribution_features("digits", version=2, dim=D, **train)
        client.wait_attribution_features(features["id"], progress=None, timeout_s=120)
        fid = features["id"]
        with pytest.raises(JobNotFound, match="no attribution features job") as error:
            client.submit_attribution(["0" * 32], test=registered.x_test)
        assert _status(error) == 404
        client.register_model("digits-wide", {**DIGITS_WIDE}, seed=0)
        wide = client.submit_attribution_features("digits-wide", dim=D, **train)
        client.wait_attribution_features(wide["id"], progress=None, timeout_s=120)
        with pytest.raises(IncompatibleCheckpoint, match="checkpoint 1 does not fit the model") as error:
            client.submit_attribution([fid, wide["id"]], test=registered.x_test)
        assert _status(error) == 422
        assert "'layers.0.weight' has shape (48, 64), the model's (32, 64)" in str(error.value)
        narrow = client.upload_dataset(problem.x_test[:, :32].copy())["id"]
        with pytest.raises(ShapeMismatch, match=r"per-example shape\(s\) \[\('x', \[32\]\)\], the training inputs"):
            client.submit_attribution(fid, test=narrow)
        with pytest.raises(InvalidInput, match="test_labels"):
            client.submit_attribution(fid, test=registered.x_test, test_labels=outside)  # 200 labels for 40 rows
        with pytest.raises(InvalidInput, match=r"top_k must be in \[0, N=200\]"):
            client.submit_attribution(fid, test=registered.x_test, top_k=500)
        with pytest.raises(InvalidInput, match="nothing to compute"):
            client.submit_attribution(fid)
        many = client.upload_dataset(rng.standard_normal((20_000, 64)).astype(np.float32))["id"]
        refused = "needs about .* for one solve of the test features.*over the memory budget of 256.00 MiB"
        with pytest.raises(MemoryEstimateExceeded, match=refused) as error:
            client.submit_attribution(fid, test=many)  # solving 20,000 test features at D = 512: before any work
        assert _status(error) == 413
        answer = client.submit_attribution(fid, test=registered.x_test, top_k=2)
        client.wait_attribution_job(answer["id"], progress=None, timeout_s=120)
        with pytest.raises(ResultNotFound, match="store_scores=false"):
            client.attribution_scores(answer["id"])
        with pytest.raises(InvalidInput, match="outside the job's 40 test examples"):
            client.attribution_example(answer["id"], 40)


DIGITS_WIDE = {"family": "mlp", "input_dim": 64, "hidden": [48], "output_dim": 10, "activation": "relu"}
"""The digits MLP with a wider hidden layer: the same inputs and outputs, another architecture."""


def test_the_example_view_has_the_inputs_labels_and_scores_of_the_top_examples(
    server: _Server, registered: RegisteredDigits, problem: Digits
) -> None:
    with server.client() as client:
        result = client.attribute(
            "digits", train=registered.x_train, labels=registered.y_train, test=registered.x_test,
            test_labels=registered.y_test, versions=[3], dim=D, top_k=4, progress=None,
        )  # fmt: skip
        example = client.attribution_example(result.job, 6, k=3)
    assert example.example_shape == [64] and example.index == 6
    np.testing.assert_array_equal(example.test.input, problem.x_test[6])
    assert example.test.label == problem.y_test[6] and example.test.score is None
    assert [e.index for e in example.proponents] == result.proponents[6, :3].tolist()  # type: ignore[index]
    for shown in example.proponents + example.opponents:
        np.testing.assert_array_equal(shown.input, problem.x_train[shown.index])
        assert shown.label == problem.y_train[shown.index]
    assert [e.score for e in example.opponents] == pytest.approx(result.opponent_scores[6, :3].tolist())  # type: ignore[index]


def test_a_server_killed_mid_job_resumes_both_kinds_to_the_bits_of_uninterrupted_runs(server: _Server) -> None:
    rng = np.random.default_rng(3)
    slow = {**SLOW_MODEL, "kwargs": {"in_dim": 4, "out_dim": 3, "delay_s": 0.02}}
    with server.client() as client:
        client.register_model("slow-attr", slow, seed=0)
        arrays = (rng.standard_normal((24, 4)).astype(np.float32), rng.integers(0, 3, 24),
                  rng.standard_normal((12, 4)).astype(np.float32), rng.integers(0, 3, 12))  # fmt: skip
        x, y, t, ty = (client.upload_dataset(a)["id"] for a in arrays)
        base = client.submit_attribution_features("slow-attr", train=x, labels=y, dim=16)
        client.wait_attribution_features(base["id"], progress=None, timeout_s=120)
        features = {"model": "slow-attr", "train": x, "labels": y, "dim": 16, "seed": 5, "rows_per_chunk": 1}
        scoring = {"features": base["id"], "test": t, "test_labels": ty, "top_k": 3, "store_scores": True,
                   "self_influence": True, "test_rows_per_chunk": 1, "train_rows": 5}  # fmt: skip
        cut_features = client.submit_attribution_features(**features)["id"]
        cut_scoring = client.submit_attribution(**scoring)["id"]

        def mid_run() -> bool:
            f, a = client.attribution_features_job(cut_features), client.attribution_job(cut_scoring)
            return (f["status"] == a["status"] == "running" and (f["progress"] or {}).get("rows_done", 0) >= 2
                    and (a["progress"] or {}).get("units_done", 0) >= 2)  # fmt: skip

        deadline = time.monotonic() + 120
        while not mid_run():
            assert time.monotonic() < deadline, "the jobs did not get past their first units"
            time.sleep(0.02)
    server.live.process.kill()  # SIGKILL: no shutdown code runs
    server.live.process.wait(10)
    database = server.data_dir / "jobs" / "jobs.sqlite3"
    with sqlite3.connect(database) as conn:
        done = {
            job: [t for (t,) in conn.execute("SELECT tile_id FROM tiles WHERE job_id = ? AND state = 'done'", (job,))]
            for job in (cut_features, cut_scoring)
        }
    assert 2 <= len(done[cut_features]) < 24 and 2 <= len(done[cut_scoring])
    port = int(server.live.url.rsplit(":", 1)[1])
    server.live = start_live_server(server.data_dir, port=port, **_SETTINGS)  # the next start, same URL

    with server.client() as client:
        for get, job_id in ((client.attribution_features_job, cut_features), (client.attribution_job, cut_scoring)):
            assert _finished(get, job_id)["status"] == "succeeded"
        fresh_features = client.submit_attribution_features(**features)["id"]
        fresh_scoring = client.submit_attribution(**scoring)["id"]
        assert _finished(client.attribution_features_job, fresh_features)["status"] == "succeeded"
        assert _finished(client.attribution_job, fresh_scoring)["status"] == "succeeded"
        resumed, whole = (client.attribution_result(j) for j in (cut_scoring, fresh_scoring))
        for name in ("proponents", "proponent_scores", "opponents", "opponent_scores", "self_influence"):
            np.testing.assert_array_equal(getattr(resumed, name), getattr(whole, name))
        np.testing.assert_array_equal(client.attribution_scores(cut_scoring), client.attribution_scores(fresh_scoring))
    stored = [server.data_dir / "jobs" / "attribution" / job for job in (cut_features, fresh_features)]
    for name in ("features", "loss_weights"):
        a, b = (np.asarray(zarr.open_group(str(s / "train.zarr"), mode="r")[name][:]) for s in stored)  # type: ignore[index]
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(*(np.load(s / "gram.npy") for s in stored))
    with sqlite3.connect(database) as conn:
        for job, tiles in done.items():
            attempts = dict(conn.execute("SELECT tile_id, attempts FROM tiles WHERE job_id = ?", (job,)))
            assert all(attempts[t] == 1 for t in tiles), attempts  # nothing recorded before the kill ran again


def test_hostile_requests_are_4xx_with_a_message(server: _Server, registered: RegisteredDigits) -> None:
    """Raw requests a client library would not send: each is a 4xx whose body names what to fix, never a 5xx."""
    with server.client() as client:
        features = client.submit_attribution_features("digits", version=2, dim=64, train=registered.x_train,
                                                       labels=registered.y_train)  # fmt: skip
        client.wait_attribution_features(features["id"], progress=None, timeout_s=120)
        job = client.submit_attribution(features["id"], test=registered.x_test, top_k=2, store_scores=True)
        client.wait_attribution_job(job["id"], progress=None, timeout_s=120)
    fid, jid = features["id"], job["id"]
    train = {"train": {"dataset": registered.x_train}, "labels": {"dataset": registered.y_train}}
    test = {"dataset": registered.x_test}
    posts: list[tuple[str, Any]] = [
        ("/v1/attribution-features", {"model": "digits", **train, "dim": 0}),
        ("/v1/attribution-features", {"model": "digits", **train, "dim": 65_537}),
        ("/v1/attribution-features", {"model": "digits", **train, "loss": "hinge"}),
        ("/v1/attribution-features", {"model": "digits", **train, "version": -1}),
        ("/v1/attribution-features", {"model": "digits", **train, "surprise": 1}),
        (
            "/v1/attribution-features",
            {
                "model": "digits",
                "train": {"dataset": registered.x_train, "start": 150, "stop": 10**12},
                "labels": {"dataset": registered.y_train},
            },
        ),
        ("/v1/attribution-features", {"model": "../../etc/passwd", **train}),
        ("/v1/attribution-features", [1, 2, 3]),
        ("/v1/attribution-jobs", {"features": [], "test": test}),
        ("/v1/attribution-jobs", {"features": [fid] * 65, "test": test}),
        ("/v1/attribution-jobs", {"features": [fid], "test": test, "ridge": -1.0}),
        (
            "/v1/attribution-jobs",
            f'{{"features": ["{fid}"], "test": {{"dataset": "{registered.x_test}"}}, "ridge": NaN}}',
        ),
        (
            "/v1/attribution-jobs",
            f'{{"features": ["{fid}"], "test": {{"dataset": "{registered.x_test}"}}, "ridge": 1e309}}',
        ),
        ("/v1/attribution-jobs", {"features": [fid], "test": test, "top_k": -1}),
        ("/v1/attribution-jobs", {"features": [fid], "test": test, "ensemble": "median"}),
        ("/v1/attribution-jobs", {"features": [jid], "test": test}),  # an attribution job, not features
    ]
    gets = [
        f"/v1/attribution-jobs/{jid}/result?rows=x:y",
        f"/v1/attribution-jobs/{jid}/result?rows=30:10",
        f"/v1/attribution-jobs/{jid}/result?rows=0:{10**30}",
        f"/v1/attribution-jobs/{jid}/scores?cols=-5:3",
        f"/v1/attribution-jobs/{jid}/examples/-1",
        f"/v1/attribution-jobs/{jid}/examples/{2**63 - 1}",
        f"/v1/attribution-jobs/{jid}/examples/0?k=0",
        f"/v1/attribution-jobs/{fid}/examples/0",  # a features job's id under the attribution jobs
        "/v1/attribution-jobs/..%2F..%2Fjobs/result",
    ]
    with server.live.client() as http:
        answers = [
            (path, http.post(path, content=body, headers={"Content-Type": "application/json"}))
            if isinstance(body, str) else (path, http.post(path, json=body))
            for path, body in posts
        ]  # fmt: skip
        answers += [(path, http.get(path)) for path in gets]
        answers.append((f"DELETE /v1/attribution-jobs/{fid}", http.delete(f"/v1/attribution-jobs/{fid}")))
        kept = http.get(f"/v1/attribution-features/{fid}").json()
        assert kept["status"] == "succeeded"  # the wrong DELETE lost nothing
        for route in (f"/v1/attribution-jobs/{jid}/events", f"/v1/attribution-features/{fid}/events"):
            stream = http.get(route)  # a finished job's stream: its end event, then it closes
            assert stream.headers["content-type"].startswith("text/event-stream"), stream.headers
            assert "event: end" in stream.text and '"status":"succeeded"' in stream.text.replace(" ", ""), stream.text
    expected = [
        (422, "dim: Input should be greater than or equal to 1"),
        (422, "dim: Input should be less than or equal to 65536"),
        (422, "loss: Input should be 'cross_entropy' or 'mse'"),
        (422, "version: Input should be greater than or equal to 1"),
        (422, "surprise: Extra inputs are not permitted"),
        (422, "train rows [150, 1000000000000) are outside the data set of 200 rows"),
        (404, "no model named '../../etc/passwd'"),
        (400, "expected a JSON object, got list"),
        (422, "features: List should have at least 1 item"),
        (422, "features: List should have at most 64 items"),
        (422, "ridge: Input should be greater than or equal to 0"),
        (400, "could not parse it"),
        (400, "number is infinity"),
        (422, "top_k: Input should be greater than or equal to 0"),
        (422, "ensemble: Input should be 'trak' or 'mean'"),
        (404, "no attribution features job with id"),
        (422, "rows='x:y' is not a range 'a:b' of integers"),
        (422, "rows='30:10' is outside the result; expected 0 ≤ a < b ≤ 40"),
        (422, "is outside the result; expected 0 ≤ a < b ≤ 40"),
        (422, "cols='-5:3' is outside the result; expected 0 ≤ a < b ≤ 200"),
        (422, "index: Input should be greater than or equal to 0"),
        (422, "is outside the job's 40 test examples"),
        (422, "k: Input should be greater than or equal to 1"),
        (404, "no attribution job with id"),
        (404, "no route GET"),
        (404, "no attribution job with id"),
    ]
    assert len(answers) == len(expected)
    for (path, response), (status, message) in zip(answers, expected, strict=True):
        assert response.status_code == status and message in response.json()["error"]["message"], (
            path, response.status_code, response.text)  # fmt: skip
