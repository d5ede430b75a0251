"""The OpenAPI document matches the server: one error schema everywhere, bounded inputs, readable operation ids,
and real responses (success and error) from a live server that validate against it."""

from __future__ import annotations

import re
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest

from ntk_service import wire
from ntk_service.config import Settings
from ntk_service.registry.architectures import ARCHITECTURE_CONFIGS
from ntk_service.registry.layer_specs import LAYER_SPECS
from ntk_service.server import create_app
from tests.conftest import LiveServer
from tests.server.openapi_walk import input_schemas, unbounded, undocumented_fields
from tests.server.support import TINY_ARCHITECTURES, tensor_json


@pytest.fixture(scope="module")
def document(live_server: LiveServer) -> dict[str, Any]:
    response = httpx.get(f"{live_server.url}/openapi.json", timeout=30)
    assert response.status_code == 200
    return dict(response.json())


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, op) for path, ops in document["paths"].items() for method, op in ops.items()]


def test_every_error_response_is_the_error_body(document: dict[str, Any]) -> None:
    assert set(document["components"]["schemas"]["ErrorBody"]["required"]) == {"error"}
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for method, path, op in _operations(document):
        errors = {code: r for code, r in op["responses"].items() if int(code) >= 400}
        assert "500" in errors, (method, path)
        for code, response in errors.items():
            assert set(response["content"]) == {"application/json"}, (method, path, code)
            assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
            assert response["description"], (method, path, code)


def test_statuses_follow_what_each_route_declares(document: dict[str, Any]) -> None:
    ops = {(m, p): set(op["responses"]) for m, p, op in _operations(document)}
    assert ops[("get", "/healthz")] == {"200", "500"}
    assert ops[("get", "/readyz")] == {"200", "500", "503"}
    assert {"401", "503"} <= ops[("get", "/v1/models")] and "403" not in ops[("get", "/v1/models")]
    assert {"401", "403", "409", "400", "413", "415", "422"} <= ops[("post", "/v1/models")]
    assert {"404", "406", "413", "429"} <= ops[("post", "/v1/models/{name}/ntk")]
    assert {"404", "409"} <= ops[("get", "/v1/jobs/{job_id}/result")]
    headers = document["paths"]["/v1/models/{name}/ntk"]["post"]["responses"]["429"]["headers"]
    assert "Retry-After" in headers


def test_operation_ids_are_readable_and_unique(document: dict[str, Any]) -> None:
    ids = [op["operationId"] for _, _, op in _operations(document)]
    assert len(ids) == len(set(ids)), ids
    for op_id in ids:
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", op_id) and "v1" not in op_id, op_id
    assert document["paths"]["/v1/models/{name}/ntk"]["post"]["operationId"] == "compute_kernel"


def test_media_types(document: dict[str, Any]) -> None:
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    weights = document["paths"]["/v1/models/{name}/versions/{version}/weights"]["get"]["responses"]["200"]
    assert weights["content"] == {wire.MEDIA_SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}}
    kernel = document["paths"]["/v1/models/{name}/ntk"]["post"]["responses"]["200"]["content"]
    assert set(kernel) == {wire.MEDIA_JSON, wire.MEDIA_NPY, wire.MEDIA_SAFETENSORS}


def test_every_integer_and_string_input_is_bounded(document: dict[str, Any]) -> None:
    problems = [f"{where}: {why}" for where, schema in input_schemas(document) if (why := unbounded(schema))]
    assert not problems, "\n".join(problems)
    found = dict(input_schemas(document))
    version = found["GET /v1/models/{name}/versions/{version} path version"]
    assert (version["minimum"], version["maximum"]) == (1, 2**63 - 1)


def test_unbounded_inputs_are_detected() -> None:
    # Guards the check above: it flags what it must.
    assert unbounded({"type": "integer", "minimum": 0}) is not None
    assert unbounded({"type": "string"}) is not None
    assert unbounded({"type": "string", "pattern": "^[a-z]+$"}) is not None
    assert unbounded({"type": "array", "items": {}}) is not None
    assert unbounded({"type": "string", "pattern": "^[a-z]{1,8}$"}) is None
    assert unbounded({"type": "integer", "minimum": 0, "maximum": 3}) is None


def test_every_field_has_a_description(document: dict[str, Any]) -> None:
    missing = undocumented_fields(document)
    assert not missing, "\n".join(missing)
    described = {"ModelPublic", "JobPublic", "DatasetPublic", "KernelPublic", "TensorJson"}
    for name in described:
        for field, schema in document["components"]["schemas"][name]["properties"].items():
            assert schema.get("description"), (name, field)


def test_every_architecture_and_layer_field_has_a_description() -> None:
    # The families' and layers' fields, from their models: what GET /v1/architectures shows beside the OpenAPI.
    models = [*ARCHITECTURE_CONFIGS.values(), *LAYER_SPECS.values()]
    missing = [f"{cls.__name__}.{name}" for cls in models for name, f in cls.model_fields.items() if not f.description]
    assert not missing, missing
    assert len(ARCHITECTURE_CONFIGS) == 5 and len(LAYER_SPECS) >= 27  # not vacuous


def test_undocumented_fields_are_detected() -> None:
    # Guards the check above: a field without a description, in a body and below a $ref of a response.
    document = {
        "paths": {
            "/x": {
                "post": {
                    "parameters": [{"in": "query", "name": "q", "schema": {"type": "integer"}}],
                    "requestBody": {"content": {"application/json": {"schema": {"properties": {"a": {}}}}}},
                    "responses": {
                        "200": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/R"}}}}
                    },
                }
            }
        },
        "components": {"schemas": {"R": {"properties": {"b": {"description": "ok", "properties": {"c": {}}}}}}},
    }
    assert undocumented_fields(document) == ["POST /x body.a", "POST /x query q", "POST /x response 200.b.c"]
    assert undocumented_fields(document, skip=("POST /x body",)) == ["POST /x query q", "POST /x response 200.b.c"]


def test_two_routes_with_one_operation_id_are_refused(tmp_path: Any) -> None:
    from fastapi import APIRouter

    app = create_app(Settings(data_dir=tmp_path))
    extra = APIRouter()

    @extra.get("/v1/other")
    async def healthz() -> dict[str, str]:  # same function name as GET /healthz
        return {}

    app.include_router(extra)
    with pytest.raises(ValueError, match="operation id 'healthz'"):
        app.openapi()


# ---- real responses against the document ----


def _template_of(document: dict[str, Any], method: str, path: str) -> str:
    for template in document["paths"]:
        pattern = "^" + re.sub(r"\{[^}]+\}", "[^/]+", template) + "$"
        if re.match(pattern, path) and method.lower() in document["paths"][template]:
            return template
    raise AssertionError(f"{method} {path}: no operation in the document")


def _check(document: dict[str, Any], response: httpx.Response) -> None:
    """``response`` is one the document describes: its status, its media type and (JSON) its body's schema."""
    request = response.request
    template = _template_of(document, request.method, request.url.path)
    operation = document["paths"][template][request.method.lower()]
    where = f"{request.method} {template} -> {response.status_code}"
    documented = operation["responses"].get(str(response.status_code))
    assert documented is not None, f"{where}: undocumented status ({sorted(operation['responses'])})"
    content = documented.get("content")
    if not content:
        assert not response.content, where
        return
    media = response.headers["content-type"].split(";")[0].strip()
    assert media in content, f"{where}: {media} not in {sorted(content)}"
    schema = content[media].get("schema", {})
    if media == wire.MEDIA_JSON:
        root = {**schema, "components": document["components"]}
        jsonschema.Draft202012Validator(root).validate(response.json())


def test_real_responses_validate_against_the_document(live_server: LiveServer, document: dict[str, Any]) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    arch = TINY_ARCHITECTURES["mlp"]
    with live_server.client("write") as writer, live_server.client("read") as reader:
        anonymous = httpx.Client(base_url=live_server.url, timeout=30)
        responses = [
            writer.post("/v1/models", json={"name": "openapi-mlp", "architecture": arch, "seed": 3}),
            writer.post("/v1/models", json={"name": "openapi-mlp", "architecture": arch}),  # 409
            writer.post("/v1/models", json={"name": "openapi-mlp2", "architecture": arch, "seed": 2**63}),  # 422
            writer.post("/v1/models", content=b"{", headers={"Content-Type": "application/json"}),  # 400
            writer.post("/v1/models", content=b"x", headers={"Content-Type": "text/plain"}),  # 415
            reader.post("/v1/models", json={"name": "openapi-mlp3", "architecture": arch}),  # 403
            anonymous.get("/v1/models"),  # 401
            reader.get("/v1/models"),
            reader.get("/v1/models/openapi-mlp"),
            reader.get("/v1/models/no-such-model"),  # 404
            reader.get("/v1/models/openapi-mlp/versions"),
            reader.get("/v1/models/openapi-mlp/versions/1"),
            reader.get(f"/v1/models/openapi-mlp/versions/{2**64}"),  # 422
            reader.get("/v1/models/openapi-mlp/versions/1/weights"),
            reader.get("/v1/architectures"),
            reader.post("/v1/models/openapi-mlp/ntk", json={"x1": tensor_json(x), "mode": "trace"}),
            reader.post(
                "/v1/models/openapi-mlp/ntk",
                content=wire.encode_npy(x),
                headers={"Content-Type": wire.MEDIA_NPY, "Accept": wire.MEDIA_NPY},
            ),
            reader.post("/v1/models/openapi-mlp/ntk", json={"x1": tensor_json(x)}, headers={"Accept": "text/csv"}),
            reader.post("/v1/models/openapi-mlp/ntk", json={"x1": tensor_json(x[:, :3])}),  # 422 shape
            writer.post("/v1/datasets", content=wire.encode_npy(x), headers={"Content-Type": wire.MEDIA_NPY}),
            reader.get("/v1/datasets"),
            reader.get("/v1/datasets/no-such-dataset"),
            reader.get("/v1/jobs"),
            reader.get("/v1/jobs/no-such-job"),
            anonymous.get("/healthz"),
            anonymous.get("/readyz"),
            anonymous.get("/metrics"),
        ]
        dataset_id = responses[19].json()["id"]
        job = writer.post("/v1/jobs", json={"model": "openapi-mlp", "x1": {"dataset": dataset_id}, "mode": "trace"})
        responses += [
            job,
            reader.get(f"/v1/datasets/{dataset_id}"),
            reader.get(f"/v1/jobs/{job.json()['id']}"),
            writer.delete("/v1/models/openapi-mlp"),
        ]
        anonymous.close()
    statuses = sorted({r.status_code for r in responses})
    assert statuses == [200, 201, 202, 204, 400, 401, 403, 404, 406, 409, 415, 422], statuses
    for response in responses:
        _check(document, response)


def test_the_check_rejects_a_wrong_body(document: dict[str, Any]) -> None:
    # Guards the conformance check: a body missing a required field, or an undocumented status, fails it.
    request = httpx.Request("GET", "http://x/v1/models/m")
    bad = httpx.Response(200, json={"name": "m"}, request=request)
    with pytest.raises(jsonschema.ValidationError):
        _check(document, bad)
    with pytest.raises(AssertionError, match="undocumented status"):
        _check(document, httpx.Response(418, json={}, request=request))


def _error_types() -> set[str]:
    from ntk_service import errors

    found, todo = set(), [errors.NtkServiceError]
    while todo:
        cls = todo.pop()
        found.add(cls.error_type)
        todo.extend(cls.__subclasses__())
    return found | {"internal_error"}  # the 500 of an unexpected exception (server/error_responses.py)


def test_each_error_status_has_its_own_sample(document: dict[str, Any]) -> None:
    """ReDoc shows a response's media example: each status has one of its own, with a real error type, instead
    of the schema's one example (model_not_found) under every status."""
    known = _error_types()
    for method, path, operation in _operations(document):
        for status, response in operation["responses"].items():
            if not status.startswith(("4", "5")):
                continue
            example = response["content"]["application/json"].get("example")
            assert example is not None, f"{method} {path} {status} has no example"
            jsonschema.validate(
                example, {**document["components"]["schemas"]["ErrorBody"], "components": document["components"]}
            )
            assert example["error"]["type"] in known, (method, path, status, example)
    samples = {
        status: response["content"]["application/json"]["example"]["error"]["type"]
        for _, _, op in _operations(document)
        for status, response in op["responses"].items()
        if status in ("404", "500")
    }
    assert samples == {"404": "model_not_found", "500": "internal_error"}


@pytest.mark.parametrize(("path", "fields"), [("/healthz", {"status"}), ("/readyz", {"status", "device"})])
def test_health_answers_are_documented_with_samples(
    document: dict[str, Any], live_server: LiveServer, path: str, fields: set[str]
) -> None:
    schema = document["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    ref = schema["$ref"].rsplit("/", 1)[-1]
    component = document["components"]["schemas"][ref]
    assert set(component["properties"]) == fields
    assert all(component["properties"][name].get("examples") for name in fields)
    answer = httpx.get(f"{live_server.url}{path}", timeout=10).json()
    jsonschema.validate(answer, {**component, "components": document["components"]})
