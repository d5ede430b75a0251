"""Client unit tests against ``httpx.MockTransport``: request shapes, decoding, retries and error mapping.

End-to-end behaviour against a real server is in ``test_client_e2e.py``; here each handler plays the server's
contract (issue 4) so the client's side of it is pinned down exactly.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from ntk_service import errors, wire
from ntk_service.client import Client, KernelResult
from ntk_service.client import _base as client_base

Handler = Callable[[httpx.Request], httpx.Response]


def _client(handler: Handler, **kwargs: Any) -> Client:
    return Client("http://ntk.test", transport=httpx.MockTransport(handler), **kwargs)


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(
        status, content=orjson.dumps(body), headers={"content-type": wire.MEDIA_JSON, **(headers or {})}
    )


def _error(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return _json(status, {"error": {"type": error_type, "message": message}}, headers)


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waited: list[float] = []
    monkeypatch.setattr(client_base, "_sleep", waited.append)
    return waited


# ---- construction, headers, timeouts ----


def test_sends_bearer_key_and_user_agent_and_uses_explicit_timeouts() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return _json(200, {"status": "ok"})

    with _client(handler, api_key="s3cret", timeout=120.0) as client:
        assert client.health() == {"status": "ok"}
        timeout = client._http.timeout
        assert (timeout.connect, timeout.read) == (client_base.DEFAULT_CONNECT_TIMEOUT_S, 120.0)
    assert seen[0].headers["authorization"] == "Bearer s3cret"
    assert seen[0].headers["user-agent"].startswith("ntk-service-client/")
    assert seen[0].url.path == "/healthz"


def test_no_authorization_header_without_key() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert "authorization" not in request.headers
        return _json(200, {"status": "ok"})

    _client(handler).health()


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"transport_format": "xml"}, "transport_format"), ({"max_retries": -1}, "max_retries")],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Client("http://ntk.test", **kwargs)


# ---- error mapping ----


@pytest.mark.parametrize(
    ("status", "error_type", "expected"),
    [
        (404, "model_not_found", errors.ModelNotFound),
        (401, "unauthenticated", errors.AuthenticationError),
        (403, "permission_denied", errors.PermissionDenied),
        (409, "name_conflict", errors.NameConflict),
        (415, "unsupported_media_type", errors.UnsupportedMediaType),
        (422, "shape_mismatch", errors.ShapeMismatch),
        (422, "some_future_type", errors.InvalidInput),  # unknown type: falls back on the status
        (406, "not_acceptable", errors.NotAcceptable),
    ],
)
def test_error_bodies_map_to_the_exception_tree(status: int, error_type: str, expected: type) -> None:
    message = f"get model: the thing went wrong ({error_type})"
    client = _client(lambda request: _error(status, error_type, message))
    with pytest.raises(expected) as info:
        client.get_model("mlp")
    assert type(info.value) is expected
    assert info.value.message == message and str(info.value) == message
    assert info.value.http_status == status


def test_memory_estimate_error_keeps_its_numbers_when_sent() -> None:
    body = {
        "error": {
            "type": "memory_estimate_exceeded",
            "message": "needs 3 GiB",
            "estimate_bytes": 3,
            "budget_bytes": 2,
        }
    }
    client = _client(lambda request: _json(413, body))
    with pytest.raises(errors.MemoryEstimateExceeded) as info:
        client.ntk("mlp", np.zeros((2, 3), np.float32))
    assert (info.value.estimate_bytes, info.value.budget_bytes) == (3, 2)
    assert "needs 3 GiB" in info.value.message


def test_non_json_error_body_still_gives_a_clear_error() -> None:
    client = _client(lambda request: httpx.Response(502, text="<html>Bad Gateway</html>"))
    with pytest.raises(
        errors.NtkServiceError, match=r"GET /v1/models: HTTP 502 Bad Gateway: <html>Bad Gateway"
    ) as info:
        client.list_models()
    assert info.value.http_status == 502


def test_unreachable_server_is_service_unavailable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(errors.ServiceUnavailable, match=r"cannot reach http://ntk.test .*ntk-service serve"):
        _client(handler).health()


def test_read_timeout_is_service_unavailable_with_a_hint() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(errors.ServiceUnavailable, match=r"no answer .*Client\(timeout=\.\.\.\)"):
        _client(handler).health()


# ---- retries ----


def _flaky(responses: list[httpx.Response]) -> tuple[Handler, list[httpx.Request]]:
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return responses[min(len(calls), len(responses)) - 1]

    return handler, calls


def test_retries_429_honouring_retry_after_then_succeeds(sleeps: list[float]) -> None:
    busy = _error(429, "busy", "busy", {"Retry-After": "2"})
    handler, calls = _flaky([busy, busy, _json(200, {"data": [], "count": 0})])
    assert _client(handler).list_models() == []
    assert sleeps == [2.0, 2.0] and len(calls) == 3


def test_retries_resend_the_same_binary_body(sleeps: list[float]) -> None:
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        if len(bodies) == 1:
            return _error(503, "service_unavailable", "starting", {"Retry-After": "1"})
        theta = wire.encode_safetensors({"theta": np.ones((2, 2, 1, 1), np.float32)})
        return httpx.Response(200, content=theta, headers={"content-type": wire.MEDIA_SAFETENSORS})

    _client(handler).ntk("mlp", np.ones((2, 3), np.float32))
    assert len(bodies) == 2 and bodies[0] == bodies[1] and bodies[0]
    assert sleeps == [1.0]


def test_gives_up_after_max_retries_with_busy(sleeps: list[float]) -> None:
    handler, calls = _flaky([_error(429, "busy", "ntk: 2 computations running, queue full", {"Retry-After": "1"})])
    with pytest.raises(errors.Busy, match="queue full") as info:
        _client(handler, max_retries=2).list_models()
    assert len(calls) == 3 and sleeps == [1.0, 1.0]
    assert info.value.retry_after_s == 1.0 and info.value.http_status == 429


def test_retry_after_beyond_the_cap_is_not_waited(sleeps: list[float]) -> None:
    handler, calls = _flaky([_error(503, "service_unavailable", "down for maintenance", {"Retry-After": "3600"})])
    with pytest.raises(errors.ServiceUnavailable) as info:
        _client(handler, max_retry_wait_s=30).health()
    assert len(calls) == 1 and sleeps == []
    assert info.value.retry_after_s == 3600.0


def test_missing_retry_after_backs_off_exponentially(sleeps: list[float]) -> None:
    handler, _ = _flaky([httpx.Response(503, text="unavailable")])
    with pytest.raises(errors.ServiceUnavailable):
        _client(handler, max_retries=3).health()
    assert sleeps == [0.5, 1.0, 2.0]


def test_http_date_retry_after_is_understood() -> None:
    assert client_base._parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: retry now
    assert client_base._parse_retry_after("1.5") == 1.5
    assert client_base._parse_retry_after("soon") is None


def test_other_errors_are_not_retried(sleeps: list[float]) -> None:
    handler, calls = _flaky([_error(422, "invalid_input", "bad")])
    with pytest.raises(errors.InvalidInput):
        _client(handler).health()
    assert len(calls) == 1 and sleeps == []


# ---- kernels ----


def _theta_for(x1: np.ndarray, x2: np.ndarray | None) -> np.ndarray:
    """A stand-in kernel the handler can compute from what it received: (N, M, 1, 1) of row-sum products."""
    x2 = x1 if x2 is None else x2
    return (x1.sum(1)[:, None] * x2.sum(1)[None, :]).reshape(len(x1), len(x2), 1, 1).astype(np.float32)


_META = {
    "mode": "full",
    "implementation": "jacobian_contraction",
    "model": "mlp",
    "version": "2",
    "elapsed_ms": "3.5",
}


def _kernel_server(received: dict[str, Any]) -> Handler:
    """Plays ``POST /v1/models/{name}/ntk`` by the contract: JSON or binary in, ``Accept`` picks the body."""

    def handler(request: httpx.Request) -> httpx.Response:
        media = request.headers["content-type"]
        received.update(
            path=request.url.raw_path.split(b"?")[0].decode(),
            media=media,
            accept=request.headers["accept"],
            query=request.url.params,
        )
        if media == wire.MEDIA_JSON:
            body = orjson.loads(request.content)
            received["body"] = body
            x1 = wire.tensor_from_json(body["x1"], name="x1") if "shape" in body["x1"] else np.ones((3, 2))
            x2 = wire.tensor_from_json(body["x2"], name="x2") if body.get("x2") else None
        elif media == wire.MEDIA_NPY:
            x1, x2 = wire.decode_npy(request.content), None
        else:
            tensors, _ = wire.decode_safetensors(request.content)
            x1, x2 = tensors["x1"], tensors.get("x2")
        received.update(x1=x1, x2=x2)
        theta = _theta_for(x1, x2)
        accept = request.headers["accept"]
        if accept == wire.MEDIA_SAFETENSORS:
            content = wire.encode_safetensors({"theta": theta}, _META)
            return httpx.Response(200, content=content, headers={"content-type": accept})
        if accept == wire.MEDIA_NPY:
            headers = {
                "content-type": accept,
                **{f"X-NTK-{k.replace('_', '-')}": v for k, v in _META.items()},
            }
            return httpx.Response(200, content=wire.encode_npy(theta), headers=headers)
        meta = {**_META, "version": 2, "elapsed_ms": 3.5}
        return httpx.Response(
            200,
            content=wire.json_dumps({"theta": wire.tensor_to_json(theta), **meta}),
            headers={"content-type": wire.MEDIA_JSON},
        )

    return handler


X1 = np.arange(12, dtype=np.float32).reshape(4, 3)
X2 = np.arange(6, dtype=np.float32).reshape(2, 3) - 2


@pytest.mark.parametrize("transport_format", ["safetensors", "npy", "json"])
@pytest.mark.parametrize("with_x2", [False, True])
def test_ntk_round_trip_in_each_transport_format(transport_format: str, with_x2: bool) -> None:
    received: dict[str, Any] = {}
    client = _client(_kernel_server(received), transport_format=transport_format)
    x2 = X2 if with_x2 else None
    result = client.ntk_result(
        "my model/v", X1, x2, mode="full", params=["head.*", "0.weight"], dtype="float64", version=2
    )
    assert isinstance(result, KernelResult)
    np.testing.assert_array_equal(result.theta, _theta_for(X1, x2))
    assert (result.mode, result.implementation, result.model, result.version, result.elapsed_ms) == (
        "full",
        "jacobian_contraction",
        "mlp",
        2,
        3.5,
    )
    assert received["path"] == "/v1/models/my%20model%2Fv/ntk"
    np.testing.assert_array_equal(received["x1"], X1)
    assert (received["x2"] is None) == (not with_x2)
    expected_media = {"safetensors": wire.MEDIA_SAFETENSORS, "npy": wire.MEDIA_NPY, "json": wire.MEDIA_JSON}
    assert received["accept"] == expected_media[transport_format]
    if transport_format == "json":
        body = received["body"]
        assert {k: body[k] for k in ("mode", "implementation", "params", "dtype", "version")} == {
            "mode": "full",
            "implementation": "auto",
            "params": ["head.*", "0.weight"],
            "dtype": "float64",
            "version": 2,
        }
    else:
        # npy carries one array; with x2 the client switches to a safetensors body
        assert received["media"] == (
            wire.MEDIA_NPY if transport_format == "npy" and not with_x2 else wire.MEDIA_SAFETENSORS
        )
        query = received["query"]
        assert query.get_list("params") == ["head.*", "0.weight"]
        assert (query["mode"], query["implementation"], query["dtype"], query["version"]) == (
            "full",
            "auto",
            "float64",
            "2",
        )


def test_ntk_omits_unset_options_from_the_query() -> None:
    received: dict[str, Any] = {}
    _client(_kernel_server(received)).ntk("mlp", X1)
    assert dict(received["query"]) == {"mode": "full", "implementation": "auto"}


def test_dataset_slices_go_as_json_even_with_binary_transport() -> None:
    received: dict[str, Any] = {}
    client = _client(_kernel_server(received))
    theta = client.ntk("mlp", {"dataset": "ds1", "start": 0, "stop": 3}, X2[:, :2], mode="trace")
    assert received["media"] == wire.MEDIA_JSON and received["accept"] == wire.MEDIA_SAFETENSORS
    assert received["body"]["x1"] == {"dataset": "ds1", "start": 0, "stop": 3}
    assert received["body"]["x2"]["shape"] == [2, 2] and received["body"]["mode"] == "trace"
    assert theta.shape == (3, 2, 1, 1)


@pytest.mark.parametrize("ref", [{"start": 0}, {"dataset": "d", "rows": 3}])
def test_bad_dataset_slice_is_refused_before_sending(ref: dict[str, Any]) -> None:
    client = _client(lambda request: pytest.fail("nothing must be sent"))
    with pytest.raises(ValueError, match=r"x1: a data set slice is"):
        client.ntk("mlp", ref)


def test_torch_inputs_and_as_torch_output() -> None:
    torch = pytest.importorskip("torch")
    received: dict[str, Any] = {}
    client = _client(_kernel_server(received))
    x1 = torch.tensor(X1, requires_grad=True)
    theta = client.ntk("mlp", x1, as_torch=True)
    assert isinstance(theta, torch.Tensor) and theta.shape == (4, 4, 1, 1)
    np.testing.assert_array_equal(received["x1"], X1)


def test_non_wire_dtypes_are_converted_before_sending() -> None:
    received: dict[str, Any] = {}
    _client(_kernel_server(received)).ntk("mlp", X1.astype(np.int32))
    assert received["x1"].dtype == np.int64


def test_kernel_response_without_theta_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        content = wire.encode_safetensors({"other": np.zeros(1)})
        return httpx.Response(200, content=content, headers={"content-type": wire.MEDIA_SAFETENSORS})

    with pytest.raises(errors.NtkServiceError, match="no tensor 'theta'"):
        _client(handler).ntk("mlp", X1)


def test_unexpected_content_type_is_an_error() -> None:
    client = _client(lambda request: httpx.Response(200, text="<html/>", headers={"content-type": "text/html"}))
    with pytest.raises(
        errors.NtkServiceError,
        match=r"expected application/x-safetensors or application/x-npy, got text/html",
    ):
        client.ntk("mlp", X1)


# ---- models, weights, data sets ----


def test_model_and_dataset_routes() -> None:
    calls: list[tuple[str, str, str, bytes]] = []
    record = {"name": "mlp", "version": 3, "num_params": 10}
    weights = {"0.weight": np.ones((4, 3), np.float32), "0.bias": np.zeros(4, np.float32)}

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path, str(request.url.params), request.content))
        route = (request.method, request.url.path)
        if route == ("POST", "/v1/models"):
            return _json(201, {**record, "version": 1})
        if route == ("GET", "/v1/models"):
            return _json(200, {"data": [record], "count": 1})
        if route == ("GET", "/v1/models/mlp"):
            return _json(200, record)
        if route == ("POST", "/v1/models/mlp/versions"):
            return _json(201, {**record, "version": 4})
        if route == ("GET", "/v1/models/mlp/versions/3/weights"):
            return httpx.Response(
                200,
                content=wire.encode_safetensors(weights),
                headers={"content-type": wire.MEDIA_SAFETENSORS},
            )
        if route == ("POST", "/v1/datasets"):
            x = wire.decode_npy(request.content)
            return _json(201, {"id": "ds1", "shape": list(x.shape), "dtype": str(x.dtype)})
        if route == ("GET", "/v1/datasets"):
            return _json(200, {"data": [{"id": "ds1"}], "count": 1})
        if route == ("GET", "/v1/datasets/ds1"):
            return _json(200, {"id": "ds1"})
        if request.method == "DELETE":
            return httpx.Response(204)
        return _error(404, "not_found", f"no route {route}")

    client = _client(handler)
    spec = {"family": "mlp", "input_dim": 3, "hidden": [4], "output_dim": 1}
    assert client.register_model("mlp", spec, seed=7)["version"] == 1
    assert orjson.loads(calls[-1][3]) == {"name": "mlp", "architecture": spec, "seed": 7}
    assert client.list_models() == [record]
    assert client.get_model("mlp") == record
    assert client.upload_weights("mlp", weights)["version"] == 4
    uploaded, _ = wire.decode_safetensors(calls[-1][3])
    assert uploaded.keys() == weights.keys()
    assert client.upload_weights("mlp", wire.encode_safetensors(weights))["version"] == 4
    downloaded = client.download_weights("mlp")  # latest = 3, found via get_model
    assert [c[1] for c in calls[-2:]] == ["/v1/models/mlp", "/v1/models/mlp/versions/3/weights"]
    np.testing.assert_array_equal(downloaded["0.weight"], weights["0.weight"])
    assert client.upload_dataset(np.zeros((5, 3), np.float32), name="train") == {
        "id": "ds1",
        "shape": [5, 3],
        "dtype": "float32",
    }
    assert calls[-1][2] == "name=train"
    assert client.list_datasets() == [{"id": "ds1"}]
    assert client.get_dataset("ds1") == {"id": "ds1"}
    assert client.delete_dataset("ds1") is None and client.delete_model("mlp") is None
    assert [c[:2] for c in calls[-2:]] == [("DELETE", "/v1/datasets/ds1"), ("DELETE", "/v1/models/mlp")]


# ---- import hygiene ----


def test_client_imports_without_torch_or_fastapi() -> None:
    script = textwrap.dedent(
        """
        import sys
        from importlib.abc import MetaPathFinder

        class Block(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"torch", "fastapi", "starlette", "uvicorn"}:
                    raise ImportError(f"blocked: {name}")
                return None

        sys.meta_path.insert(0, Block())
        import numpy as np
        import ntk_service
        from ntk_service import Client, KernelResult
        from ntk_service.client import Client as C2
        from ntk_service import errors, wire
        client = Client("http://127.0.0.1:9", transport_format="npy")
        client.close()
        assert wire.decode_npy(wire.encode_npy(np.ones(3))).sum() == 3
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
