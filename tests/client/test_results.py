"""Streamed job results on the client's side of the contract (``httpx.MockTransport`` plays the server): a 503
before any data is retried like every other call, and the array arrives whole. End to end: tests/jobs/test_routes.py."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from ntk_service import errors, wire
from ntk_service.client import Client
from ntk_service.client import _base as client_base


def _npy(theta: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, theta)
    return buffer.getvalue()


def _starting() -> httpx.Response:
    body = {"error": {"type": "service_unavailable", "message": "the job manager is not running; retry shortly"}}
    return httpx.Response(
        503, content=orjson.dumps(body), headers={"content-type": wire.MEDIA_JSON, "Retry-After": "1"}
    )


@pytest.mark.parametrize("how", ["download_result", "job_result (npy)", "result_array"])
def test_a_503_before_the_data_is_retried_then_the_result_streams(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theta = np.arange(12, dtype=np.float32).reshape(3, 4)
    waited: list[float] = []
    monkeypatch.setattr(client_base, "_sleep", waited.append)
    answers = [_starting()]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/jobs/j1":
            job = {"id": "j1", "status": "succeeded", "result_shape": [3, 4], "dtype": "float32", "mode": "trace"}
            return httpx.Response(200, content=orjson.dumps(job), headers={"content-type": wire.MEDIA_JSON})
        assert request.headers["accept"] == wire.MEDIA_NPY
        if answers:
            return answers.pop()
        return httpx.Response(200, content=_npy(theta), headers={"content-type": wire.MEDIA_NPY})

    with Client("http://ntk.test", transport=httpx.MockTransport(handler), transport_format="npy") as client:
        if how == "download_result":
            got = np.asarray(client.download_result("j1", tmp_path / "theta.npy"))
        elif how == "job_result (npy)":
            got = client.job_result("j1")
        else:
            got = client.result_array("j1")[:, :]
    np.testing.assert_array_equal(got, theta)
    assert waited == [1.0]


def test_a_503_that_lasts_gives_up_after_max_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[float] = []
    monkeypatch.setattr(client_base, "_sleep", waited.append)
    transport = httpx.MockTransport(lambda request: _starting())
    with Client("http://ntk.test", transport=transport, transport_format="npy", max_retries=2) as client:
        with pytest.raises(errors.ServiceUnavailable, match="not running"):
            client.job_result("j1")
    assert waited == [1.0, 1.0]
