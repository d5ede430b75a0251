"""Model registry routes: register, list, show, delete, upload and download weight versions.

``POST /v1/models`` takes either JSON (an architecture and a seed) or a safetensors file (trained weights, with the
architecture as JSON in the file's ``__metadata__["architecture"]`` and the name as ``?name=``): the latter is
what ``Client.register_module`` sends, so a trained model's own ``state_dict()`` is version 1.
``POST /v1/models/exported`` (multipart: ``name``, ``program``, optional ``label``) registers any other
``nn.Module`` as the archive ``torch.export.save`` wrote, loaded without unpickling (registry/exported.py).
"""

from __future__ import annotations

from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, HTTPException, Query, Request
from starlette.datastructures import UploadFile
from starlette.responses import Response

from ntk_service import wire
from ntk_service.errors import InvalidInput, MalformedRequest, operation_name
from ntk_service.registry.store import MAX_LABEL_LENGTH
from ntk_service.registry.weights import safetensors_architecture
from ntk_service.server.deps import ReadAccess, RegistryDep, WriteAccess
from ntk_service.server.media import (
    collection_response,
    content_type,
    json_response,
    read_json,
    require_content_type,
)
from ntk_service.server.params import ID_MAX_LENGTH, NamePath, VersionPath
from ntk_service.server.schemas import (
    ModelCreate,
    ModelCreateSchema,
    ModelPublic,
    ModelsPublic,
    openapi_body,
    validate_body,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/models", tags=["models"])

NameParam = NamePath
VersionParam = VersionPath
LabelQuery = Annotated[
    str | None,
    Query(max_length=MAX_LABEL_LENGTH, description="A label for the new version, e.g. 'epoch 3'. Default: none."),
]

_WEIGHTS_BODY = (
    "Trained weights: exactly the tensors of the architecture's state_dict() (buffers included), with the "
    "architecture as JSON in __metadata__['architecture'] and the model's name as ?name= (Client.register_module)."
)


@router.post(
    "",
    status_code=201,
    response_model=ModelPublic,
    summary="Register a model: an architecture with a seed (JSON) or with trained weights (safetensors), version 1",
    responses={409: {"description": "A model with this name exists."}},
    openapi_extra=openapi_body(ModelCreateSchema, binary={wire.MEDIA_SAFETENSORS: _WEIGHTS_BODY}),
)
async def register_model(
    request: Request,
    _: WriteAccess,
    registry: RegistryDep,
    name: Annotated[
        str | None, Query(max_length=ID_MAX_LENGTH, description="The model's name (safetensors bodies only).")
    ] = None,
    label: LabelQuery = None,
) -> Response:
    operation = "register model"
    with operation_name(operation):  # NOTE [operation names] in errors.py
        if content_type(request) == wire.MEDIA_SAFETENSORS:
            if name is None:
                raise InvalidInput(detail="a safetensors body needs the model's name as the query parameter ?name=")
            data = await request.body()
            architecture = safetensors_architecture(data, operation=operation)
            weighted_name = name
            record = await anyio.to_thread.run_sync(
                lambda: registry.register_weights(weighted_name, architecture, data, label=label)
            )
        else:
            body = validate_body(ModelCreate, await read_json(request))
            record = await anyio.to_thread.run_sync(
                lambda: registry.register(body.name, body.architecture, seed=body.seed, label=body.label)
            )
        return json_response(record.to_public(), status_code=201, headers={"Location": f"/v1/models/{record.name}"})


MEDIA_MULTIPART = "multipart/form-data"
_EXPORTED_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            MEDIA_MULTIPART: {
                "schema": {
                    "type": "object",
                    "required": ["name", "program"],
                    "properties": {
                        "name": {
                            "type": "string",
                            "maxLength": ID_MAX_LENGTH,
                            "description": "The model's unique name.",
                        },
                        "label": {
                            "type": "string",
                            "maxLength": MAX_LABEL_LENGTH,
                            "description": "A label for version 1, e.g. 'epoch 0'.",
                        },
                        "program": {
                            "type": "string",
                            "format": "binary",
                            "description": "The file torch.export.save wrote for torch.export.export(module.eval(), "
                            "(x,), dynamic_shapes=({0: torch.export.Dim('batch')},)).",
                        },
                    },
                }
            }
        },
    }
}


@router.post(
    "/exported",
    status_code=201,
    response_model=ModelPublic,
    summary="Register any nn.Module as a torch.export archive (multipart), with its weights as version 1",
    description="curl -F name=mymodel -F label='epoch 0' -F program=@model.pt2 -H 'Authorization: Bearer KEY' "
    "URL/v1/models/exported. Nothing in the archive is unpickled or executed: weights are read as raw tensors, "
    "every operator is checked against an allow-list (422 naming the op), pickled entries are refused (422).",
    responses={409: {"description": "A model with this name exists."}},
    openapi_extra=_EXPORTED_BODY,
)
async def register_exported(request: Request, _: WriteAccess, registry: RegistryDep) -> Response:
    with operation_name("register exported model"):  # NOTE [operation names] in errors.py
        require_content_type(request, (MEDIA_MULTIPART,))
        try:
            async with request.form(max_files=1, max_fields=2) as form:
                name, label, program = form.get("name"), form.get("label"), form.get("program")
                if not isinstance(name, str) or not isinstance(program, UploadFile):
                    raise InvalidInput(
                        detail=f"the form needs a text field 'name' and a file field 'program' (got fields "
                        f"{sorted(form.keys())}); e.g. curl -F name=m -F program=@model.pt2 ..."
                    )
                if label is not None and not isinstance(label, str):
                    raise InvalidInput(detail="'label' must be a text field, not a file")
                data = await program.read()
        except HTTPException as exc:  # starlette's multipart parser: a malformed body or too many parts
            raise MalformedRequest(detail=f"the multipart body cannot be parsed ({exc.detail})") from exc
        record = await anyio.to_thread.run_sync(lambda: registry.register_program(name, data, label=label))
        return json_response(record.to_public(), status_code=201, headers={"Location": f"/v1/models/{record.name}"})


@router.get("", response_model=ModelsPublic, summary="List models (latest version of each)")
async def list_models(_: ReadAccess, registry: RegistryDep) -> Response:
    records = await anyio.to_thread.run_sync(registry.list)
    return collection_response([r.to_public() for r in records])


@router.get("/{name}", response_model=ModelPublic, summary="Show a model's latest version")
async def get_model(name: NameParam, _: ReadAccess, registry: RegistryDep) -> Response:
    record = await anyio.to_thread.run_sync(lambda: registry.get(name))
    return json_response(record.to_public())


@router.delete("/{name}", status_code=204, summary="Delete a model and all its versions")
async def delete_model(name: NameParam, _: WriteAccess, registry: RegistryDep) -> Response:
    await anyio.to_thread.run_sync(lambda: registry.delete(name))
    return Response(status_code=204)


@router.get("/{name}/versions", response_model=ModelsPublic, summary="List a model's versions, oldest first")
async def list_versions(name: NameParam, _: ReadAccess, registry: RegistryDep) -> Response:
    records = await anyio.to_thread.run_sync(lambda: registry.versions(name))
    return collection_response([r.to_public() for r in records])


@router.post(
    "/{name}/versions",
    status_code=201,
    response_model=ModelPublic,
    summary="Upload weights (safetensors) as a new immutable version",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                wire.MEDIA_SAFETENSORS: {
                    "schema": {"type": "string", "format": "binary"},
                    "description": "Every tensor of the model's state_dict() (parameters and buffers) by name, "
                    "shapes and dtypes as registered.",
                }
            },
        }
    },
)
async def upload_version(
    name: NameParam, request: Request, _: WriteAccess, registry: RegistryDep, label: LabelQuery = None
) -> Response:
    with operation_name(f"upload weights of model {name!r}"):  # NOTE [operation names] in errors.py
        require_content_type(request, (wire.MEDIA_SAFETENSORS,))
        body = await request.body()
        record = await anyio.to_thread.run_sync(lambda: registry.add_version(name, body, label=label))
        location = f"/v1/models/{name}/versions/{record.version}"
        return json_response(record.to_public(), status_code=201, headers={"Location": location})


@router.get("/{name}/versions/{version}", response_model=ModelPublic, summary="Show one version")
async def get_version(name: NameParam, version: VersionParam, _: ReadAccess, registry: RegistryDep) -> Response:
    record = await anyio.to_thread.run_sync(lambda: registry.get(name, version))
    return json_response(record.to_public())


@router.get(
    "/{name}/versions/{version}/weights",
    summary="Download a version's weights (safetensors)",
    response_class=Response,  # never JSON: the document lists only safetensors
    responses={200: {"content": {wire.MEDIA_SAFETENSORS: {}}}},
)
async def get_weights(name: NameParam, version: VersionParam, _: ReadAccess, registry: RegistryDep) -> Response:
    data = await anyio.to_thread.run_sync(lambda: registry.weights_bytes(name, version))
    return Response(data, media_type=wire.MEDIA_SAFETENSORS)
