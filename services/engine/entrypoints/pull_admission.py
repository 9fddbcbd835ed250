"""PullAdmission: validate a request's do_remote_prefill params and know the source's NIXL agent before queueing
(a decode engine reading prefill's blocks, any engine reading a moved stream's)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from pydantic import SecretStr

from services.common.kv.kv_transfer import (
    HANDSHAKE_PATH,
    KVIncompatibleError,
    KVTransferError,
    KVTransferParams,
)
from services.common.openai.errors import OpenAIError
from services.common.pool.pool_secret import auth_headers
from services.engine.entrypoints.kv_params import kv_incompatible, parse_kv_transfer_params
from services.engine.kv_transfer.nixl_transfer import BlockTransfer
from services.engine.kv_transfer.pull_connector import PullConnector

log = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 5.0


class PullAdmission:
    """Runs on the HTTP side: handshakes are HTTP calls, so they happen before the engine sees the request.

    ``pool_secret``: sent on every handshake (prefill engines started with --pool-secret-file require it)."""

    def __init__(
        self,
        transfer: BlockTransfer | None,
        connector: PullConnector,
        pool_secret: SecretStr | None = None,
        role: str = "decode",
    ) -> None:
        self.transfer, self.connector, self.role = transfer, connector, role
        self._headers = auth_headers(pool_secret)

    async def admit(
        self, raw: dict[str, Any] | None, n: int, lora_name: str | None = None
    ) -> KVTransferParams | None:
        """Parsed params; when prefill cannot be reached the request is served as a local one (counted)."""
        if raw is None:
            return None
        params = parse_kv_transfer_params(raw, n, self.role, unsupported="do_remote_decode")
        if params.do_remote_prefill and params.remote_block_ids and params.lora_name != lora_name:
            rid = params.remote_request_id or "?"
            detail = f"the KV was computed under {_adapter(params.lora_name)}, this request runs {_adapter(lora_name)}"
            self.connector.record_refusal("adapter_mismatch", rid, detail)
            raise OpenAIError(
                409,
                f"Refusing remote KV: {detail}.",
                "invalid_request_error",
                "kv_transfer_params",
                "kv_incompatible",
            )
        if params.do_remote_prefill and params.remote_block_ids and not await self._ensure_peer(params):
            return params.model_copy(update={"do_remote_prefill": False, "remote_block_ids": []})
        return params

    async def _ensure_peer(self, params: KVTransferParams) -> bool:
        """Load prefill's handshake (cached per engine id); False (failure recorded) when it cannot be used."""
        transfer = self.transfer
        if transfer is None or transfer.has_peer(params.remote_engine_id or ""):
            return True  # no NIXL: the connector records no_transfer_path and the prompt is recomputed
        url = f"http://{params.address}{HANDSHAKE_PATH}"
        rid = params.remote_request_id or "?"
        try:
            peer = transfer.add_peer(await self._handshake(params, url), address=params.address)
        except KVIncompatibleError as exc:
            log.error("refusing KV from %s: %s", params.address, exc)
            raise kv_incompatible(exc) from exc
        except (httpx.HTTPError, KVTransferError, ValueError) as exc:
            self.connector.record_failure("handshake_failed", rid, f"{url}: {exc}")
            return False
        if peer != params.remote_engine_id:  # prefill restarted since it answered: its blocks are gone
            self.connector.record_failure(
                "peer_restarted", rid, f"{params.address} is now engine {peer}, not {params.remote_engine_id}"
            )
            return False
        return True

    async def _handshake(self, params: KVTransferParams, url: str) -> str | bytes:
        """The peer's handshake: inline (a draining decode, whose side channel may be closed) or over HTTP."""
        if params.remote_handshake is not None:
            return params.remote_handshake
        async with httpx.AsyncClient(timeout=_HANDSHAKE_TIMEOUT_S) as client:
            reply = await client.get(url, headers=self._headers)
            reply.raise_for_status()
        return reply.content


def _adapter(name: str | None) -> str:
    return f"LoRA adapter {name!r}" if name else "the base model"
