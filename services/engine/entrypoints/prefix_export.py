"""POST /kv/export: lease the leading blocks of a prompt this engine holds, for a peer's NIXL READ (P2P pull)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.common.kv.kv_transfer import EXPORT_PATH, KVExportRequest, KVTransferParams
from services.common.openai.errors import OpenAIError, not_ready
from services.engine.kv_transfer.lease_connector import LeaseConnector

if TYPE_CHECKING:
    from services.engine.llm_engine import LLMEngine


def _not_cached(n: int) -> OpenAIError:
    return OpenAIError(
        404,
        f"none of the prompt's {n} leading blocks is in this engine's KV cache",
        "invalid_request_error",
        "block_hashes",
        "kv_not_cached",
    )


def export_router(lease: LeaseConnector) -> APIRouter:
    """The route a router calls on an engine holding a prefix another engine is about to compute.

    The blocks found (leading ones only, primary pool) are pinned and leased like a prefill's prompt: they are
    freed when the reader's READ completes, when it says it will not read, or when the lease expires. The answer
    is the ``do_remote_prefill`` kv_transfer_params the reader is sent with, handshake inline.
    """
    router = APIRouter()

    @router.post(EXPORT_PATH)
    async def kv_export(body: KVExportRequest, request: Request) -> JSONResponse:
        ctx = request.app.state.ctx
        if ctx.state.draining:  # its leases must end before it stops: take no new one
            err = not_ready("The server is draining.")
            return JSONResponse(err.body(), err.status)
        hashes, lease_id = body.hashes(), f"export-{uuid.uuid4().hex}"

        def pin(engine: LLMEngine) -> KVTransferParams | None:
            ids = engine.core.scheduler.pin_export(lease_id, hashes)
            return lease.lease_export(lease_id, ids, hashes[: len(ids)], body.lora_name) if ids else None

        params = await ctx.llm.call(pin)
        if params is None:
            err = _not_cached(len(hashes))
            return JSONResponse(err.body(), err.status)
        out: dict[str, Any] = params.model_dump(mode="json")
        return JSONResponse(out)

    return router
