"""``GET /v1/architectures``: the built-in model families and their config fields."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from ntk_service.registry import list_architectures
from ntk_service.server.deps import ReadAccess
from ntk_service.server.media import collection_response
from ntk_service.server.schemas import ArchitecturesPublic

__all__ = ["router"]

router = APIRouter(prefix="/v1/architectures", tags=["models"])


@router.get("", response_model=ArchitecturesPublic, summary="Model families and their config fields")
async def get_architectures(_: ReadAccess) -> Response:
    infos = [info.model_dump(mode="json") for info in list_architectures()]
    return collection_response(infos)
