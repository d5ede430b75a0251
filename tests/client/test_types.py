"""The client's typed results (``client/_types.py``) against a real server: every record type has exactly the keys
the server sends and its OpenAPI document declares, every ``Literal`` exactly the server's wire values.

A field added to a server response, or a mode added to the server, fails here until the client's types follow.
"""

from __future__ import annotations

import dataclasses
import typing
import uuid
from collections.abc import Iterator
from typing import Any, get_args, get_type_hints

import numpy as np
import pytest

from ntk_service import client as client_module
from ntk_service.client import (
    AlignmentVariantName,
    AnalysisModeName,
    Client,
    DatasetArrayInfo,
    DatasetInfo,
    DtypeName,
    FamilyKernelName,
    FlowName,
    HealthStatus,
    ImplementationName,
    JobDeletion,
    JobInfo,
    JobModeName,
    JobSide,
    JobSpectrumMethodName,
    JobStatusName,
    KernelModeName,
    KernelResult,
    LossName,
    ModelInfo,
    OperatorModeName,
    ParameterShape,
    RidgeScaleName,
    SpectrumMethodName,
)
from tests.conftest import LiveServer
from tests.server.support import TINY_ARCHITECTURES


@pytest.fixture(scope="module")
def openapi(live_server: LiveServer) -> dict[str, Any]:
    with live_server.client() as http:
        response = http.get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


@pytest.fixture
def client(live_server: LiveServer) -> Iterator[Client]:
    with Client(live_server.url, api_key=live_server.write_key, timeout=60) as client:
        yield client


def _keys(typed: Any) -> set[str]:
    return set(typed.__required_keys__) | set(typed.__optional_keys__)


def _resolve(schema: dict[str, Any], document: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    return _resolve(document["components"]["schemas"][ref.rsplit("/", 1)[-1]], document)


def _enum(schema: dict[str, Any], document: dict[str, Any]) -> set[str]:
    """The string values a property schema allows (through $ref and nullable anyOf)."""
    schema = _resolve(schema, document)
    if "enum" in schema:
        return set(schema["enum"])
    values: set[str] = set()
    for option in schema.get("anyOf", []):
        if _resolve(option, document).get("type") != "null":
            values |= _enum(option, document)
    return values


def _component(document: dict[str, Any], name: str) -> dict[str, Any]:
    properties: dict[str, Any] = document["components"]["schemas"][name]["properties"]
    return properties


def _request(document: dict[str, Any], path: str) -> dict[str, Any]:
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    properties: dict[str, Any] = _resolve(schema, document)["properties"]
    return properties


def _literal(alias: Any) -> set[str]:
    return set(get_args(alias))


def test_record_types_declare_exactly_the_fields_of_the_openapi_document(openapi: dict[str, Any]) -> None:
    for typed, component in [
        (ModelInfo, "ModelPublic"),
        (ParameterShape, "ParameterPublic"),
        (DatasetInfo, "DatasetPublic"),
        (JobInfo, "JobPublic"),
        (JobSide, "JobDataset"),
        (JobDeletion, "JobDeleted"),
    ]:
        assert _keys(typed) == set(_component(openapi, component)), (typed.__name__, component)
    jobs = _component(openapi, "JobPublic")
    assert _literal(get_type_hints(JobInfo)["status"]) == _enum(jobs["status"], openapi)
    assert _literal(JobStatusName) == _enum(jobs["status"], openapi)
    assert _literal(JobModeName) == _enum(jobs["mode"], openapi)
    assert _literal(ImplementationName) == _enum(jobs["implementation"], openapi)
    assert _literal(get_type_hints(JobDeletion)["deleted"]) == _enum(
        _component(openapi, "JobDeleted")["deleted"], openapi
    )


def test_option_literals_are_the_servers_wire_values(openapi: dict[str, Any]) -> None:
    ntk = _request(openapi, "/v1/models/{name}/ntk")
    assert _literal(KernelModeName) == _enum(ntk["mode"], openapi)
    assert _literal(ImplementationName) == _enum(ntk["implementation"], openapi)
    assert _literal(DtypeName) == _enum(ntk["dtype"], openapi)
    predict = _request(openapi, "/v1/models/{name}/predict")
    assert _literal(AnalysisModeName) == _enum(predict["mode"], openapi)
    assert _literal(LossName) == _enum(predict["loss"], openapi)
    assert _literal(FlowName) == _enum(predict["flow"], openapi)
    assert _literal(RidgeScaleName) == _enum(predict["ridge_scale"], openapi)
    assert _literal(SpectrumMethodName) == _enum(_request(openapi, "/v1/models/{name}/spectrum")["method"], openapi)
    assert _literal(JobSpectrumMethodName) == _enum(_request(openapi, "/v1/jobs/{job_id}/spectrum")["method"], openapi)
    compare = _request(openapi, "/v1/models/{name}/compare")
    assert _literal(AlignmentVariantName) == _enum(compare["variant"], openapi)
    assert _literal(AlignmentVariantName) == _enum(_request(openapi, "/v1/jobs/{job_id}/alignment")["variant"], openapi)
    assert _literal(FamilyKernelName) == _enum(_request(openapi, "/v1/models/{name}/monte_carlo")["kernel"], openapi)
    assert _literal(OperatorModeName) == _enum(_request(openapi, "/v1/models/{name}/operator/matvec")["mode"], openapi)


def test_records_from_a_real_server_have_exactly_the_typed_keys(client: Client) -> None:
    """The records as the client returns them: plain dicts (indexable, JSON-serializable) with the typed keys."""
    name = f"types-{uuid.uuid4().hex[:8]}"
    model = client.register_model(name, TINY_ARCHITECTURES["mlp"], seed=1, label="init")
    assert type(model) is dict and set(model) == _keys(ModelInfo)
    assert set(model["parameters"][0]) == _keys(ParameterShape)
    assert set(client.get_model(name, 1)) == _keys(ModelInfo)
    assert all(set(record) == _keys(ModelInfo) for record in client.list_versions(name))
    assert set(client.health()) == _keys(HealthStatus)

    dataset = client.upload_dataset(np.zeros((3, 4), np.float32), name="probe")
    assert type(dataset) is dict and set(dataset) == set(DatasetInfo.__required_keys__)  # one array: no "arrays"
    assert set(client.get_dataset(dataset["id"])) == set(DatasetInfo.__required_keys__)
    named = client.upload_dataset({"input_ids": np.zeros((3, 4), np.int64)})
    assert set(named) == _keys(DatasetInfo) and set(named["arrays"][0]) == _keys(DatasetArrayInfo)

    job = client.submit_job(name, dataset["id"], mode="trace")
    assert set(job) == _keys(JobInfo) and set(job["x1"]) == _keys(JobSide)
    assert job["status"] in _literal(JobStatusName)
    done = client.wait(job, progress=False, timeout=120)
    assert set(done) == _keys(JobInfo) and done["status"] == "succeeded"
    deleted = client.delete_job(done)
    assert set(deleted) == _keys(JobDeletion) and deleted["deleted"] == "job"

    result = client.ntk_result(name, np.ones((2, 4), np.float32), mode="trace")
    assert result.mode in _literal(KernelModeName) and result.implementation in _literal(ImplementationName)
    client.delete_model(name)
    client.delete_dataset(dataset["id"])


def test_methods_carry_the_types_an_editor_completes() -> None:
    hints = get_type_hints(Client.ntk_result)
    assert hints["mode"] == KernelModeName and hints["implementation"] == ImplementationName
    assert hints["dtype"] == DtypeName | None
    assert get_type_hints(Client.get_model)["return"] is ModelInfo
    assert get_type_hints(Client.wait)["return"] is JobInfo
    assert get_type_hints(Client.submit_job)["mode"] == JobModeName
    fields = {field.name: field.type for field in dataclasses.fields(KernelResult)}
    assert get_type_hints(KernelResult)["mode"] == KernelModeName and "mode" in fields
    for name in ("ModelInfo", "JobInfo", "KernelModeName"):  # exported, so ``from ntk_service.client import ...``
        assert name in client_module.__all__
    assert typing.get_origin(KernelModeName) is typing.Literal
