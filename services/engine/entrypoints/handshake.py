"""GET /kv/handshake: an engine's NIXL agent metadata, block layout and KV compatibility, for its READers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from services.common.kv.kv_transfer import HANDSHAKE_PATH
from services.common.openai.errors import OpenAIError
from services.engine.kv_transfer.nixl_transfer import BlockTransfer


def handshake_router(transfer: BlockTransfer | None) -> APIRouter:
    """The side-channel route peers call before their first NIXL READ from this engine."""
    router = APIRouter()

    @router.get(HANDSHAKE_PATH)
    async def kv_handshake() -> Response:
        if transfer is None:
            err = OpenAIError(
                404,
                "this engine has no NIXL agent (--no-nixl, or NIXL unavailable): its KV reaches "
                "other engines through the kvstore, or they recompute it",
                "invalid_request_error",
                None,
                "kv_transfer_unavailable",
            )
            return JSONResponse(err.body(), err.status)
        return Response(transfer.handshake_json(), media_type="application/json")

    return router
