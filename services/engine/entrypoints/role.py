"""EngineRole: what a serving role adds to the engine: KV connectors, HTTP routes, kv_transfer_params admission.

The engine knows only this seam; the prefill and decode packages implement it (``kvferry serve --role``
composes them), and ``AggregatedRole`` is role ``both``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import APIRouter
from pydantic import ValidationError

from services.common.kv.kv_transfer import KVIncompatibleError, KVTransferParams
from services.common.openai.errors import OpenAIError, bad_request
from services.common.pool.roles import RoleName
from services.engine.core.kv_connector import KVConnector
from services.engine.kv_transfer.context import KVTransferContext, aggregated_connectors


class EngineRole(Protocol):
    """One engine role. ``connectors`` runs while the engine is built, before ``routes`` and ``admit``."""

    name: RoleName
    moves_kv_on_drain: bool  # on SIGTERM, requests that opted in move with their KV to another engine

    def connectors(self, ctx: KVTransferContext) -> Sequence[KVConnector]: ...

    def routes(self) -> Sequence[APIRouter]: ...

    async def admit(
        self, raw: dict[str, Any] | None, n: int, lora_name: str | None = None
    ) -> KVTransferParams | None:
        """The request's kv_transfer_params as the engine will use them (None: none); 4xx OpenAIError if unusable.

        ``lora_name``: the adapter the request runs under (KV computed under another one is refused)."""
        ...


class AggregatedRole:
    """Role ``both``: prompts are computed and decoded here; the P/D hand-off is ignored."""

    name: RoleName = "both"
    moves_kv_on_drain = False  # no NIXL agent: a drained stream is replayed by the router (recompute)

    def connectors(self, ctx: KVTransferContext) -> Sequence[KVConnector]:
        return aggregated_connectors(ctx)

    def routes(self) -> Sequence[APIRouter]:
        return ()

    async def admit(
        self, raw: dict[str, Any] | None, n: int, lora_name: str | None = None
    ) -> KVTransferParams | None:
        return None


def parse_kv_transfer_params(raw: dict[str, Any], n: int, role: str, unsupported: str) -> KVTransferParams:
    """Validated params (400 naming the field otherwise); ``unsupported`` is the flag this role refuses."""
    try:
        params = KVTransferParams.model_validate(raw)
    except ValidationError as exc:
        raise bad_request(
            f"invalid kv_transfer_params: {exc.errors()[0]['msg']}", "kv_transfer_params"
        ) from exc
    if n != 1:
        raise bad_request("kv_transfer_params needs n=1", "n")
    if getattr(params, unsupported):
        raise bad_request(
            f"this is a {role} engine: kv_transfer_params.{unsupported} is not served here",
            "kv_transfer_params",
        )
    return params


def kv_incompatible(exc: KVIncompatibleError) -> OpenAIError:
    """Engines that disagree on model / block size / hash version refuse KV: loudly, never silently."""
    return OpenAIError(409, str(exc), "invalid_request_error", "kv_transfer_params", "kv_incompatible")
