"""``GET /v1/architectures``: the model families, their config fields, the layer types of ``sequential`` and the
operator factories this server allows (so a 403 is never the first place a client learns them)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from ntk_service.registry import list_architectures
from ntk_service.server.deps import ReadAccess, RegistryDep
from ntk_service.server.media import collection_response
from ntk_service.server.schemas import ArchitecturesPublic

__all__ = ["router"]

router = APIRouter(prefix="/v1/architectures", tags=["models"])


@router.get(
    "",
    response_model=ArchitecturesPublic,
    summary="Model families, their config fields, sequential's layer types and the allowed operator factories",
)
async def get_architectures(_: ReadAccess, registry: RegistryDep) -> Response:
    infos = [info.model_dump(mode="json") for info in list_architectures(registry.allowed_factories)]
    return collection_response(infos)
