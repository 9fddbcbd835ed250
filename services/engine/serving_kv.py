"""P/D on the HTTP side: validate a request's kv_transfer_params, handshake with prefill, serve ours."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from services.common.errors import OpenAIError, bad_request
from services.common.kv_transfer import KVIncompatibleError, KVTransferError, KVTransferParams
from services.engine.serving import ServingContext

log = logging.getLogger(__name__)

HANDSHAKE_PATH = "/kv/handshake"
_HANDSHAKE_TIMEOUT_S = 5.0


def kv_incompatible(exc: KVIncompatibleError) -> OpenAIError:
    """Engines that disagree on model / block size / hash version refuse KV: loudly, never silently."""
    return OpenAIError(409, str(exc), "invalid_request_error", "kv_transfer_params", "kv_incompatible")


async def prepare_kv_transfer(ctx: ServingContext, raw: dict[str, Any] | None, n: int) -> KVTransferParams | None:
    """Parsed params for this engine's role; decode fetches prefill's handshake first (cached per engine)."""
    connector = ctx.llm.engine.core.connector
    if raw is None or connector is None or connector.role == "both":
        return None  # aggregated engines ignore the P/D hand-off
    try:
        params = KVTransferParams.model_validate(raw)
    except ValidationError as exc:
        raise bad_request(f"invalid kv_transfer_params: {exc.errors()[0]['msg']}", "kv_transfer_params") from exc
    if n != 1:
        raise bad_request("kv_transfer_params needs n=1", "n")
    if params.do_remote_prefill and params.remote_block_ids and not await _ensure_peer(ctx, params):
        # counted and logged once here; the request is served as a local one (kvstore, else recompute)
        return params.model_copy(update={"do_remote_prefill": False, "remote_block_ids": []})
    return params


async def _ensure_peer(ctx: ServingContext, params: KVTransferParams) -> bool:
    """Know prefill's NIXL agent before the request is queued; False (failure recorded) when it cannot be used."""
    connector = ctx.llm.engine.core.connector
    transfer = connector.transfer
    if transfer is None or transfer.has_peer(params.remote_engine_id or ""):
        return True  # no NIXL: the scheduler records the failure (no_transfer_path) and recomputes
    url = f"http://{params.address}{HANDSHAKE_PATH}"
    try:
        async with httpx.AsyncClient(timeout=_HANDSHAKE_TIMEOUT_S) as client:
            reply = await client.get(url)
            reply.raise_for_status()
        peer = transfer.add_peer(reply.content, address=params.address)
    except KVIncompatibleError as exc:
        log.error("refusing KV from %s: %s", params.address, exc)
        raise kv_incompatible(exc) from exc
    except (httpx.HTTPError, KVTransferError, ValueError) as exc:
        connector.record_failure("handshake_failed", params.remote_request_id or "?", f"{url}: {exc}")
        return False
    if peer != params.remote_engine_id:  # prefill restarted since it answered: its blocks are gone
        connector.record_failure("peer_restarted", params.remote_request_id or "?",
                                 f"{params.address} is now engine {peer}, not {params.remote_engine_id}")
        return False
    return True


def handshake_response(ctx: ServingContext) -> Response:
    """GET /kv/handshake: this engine's NIXL agent metadata, block layout and KV compatibility."""
    connector = ctx.llm.engine.core.connector
    if connector is None or connector.transfer is None:
        err = OpenAIError(404, "this engine does not serve KV transfers (role both, or NIXL unavailable)",
                          "invalid_request_error", None, "kv_transfer_unavailable")
        return JSONResponse(err.body(), err.status)
    return Response(connector.transfer.handshake_json(), media_type="application/json")
