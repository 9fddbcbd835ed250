"""DecodeRole: pull connector + kvstore fetch (no offload), and admission that handshakes with prefill."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter

from services.common.kv.kv_transfer import KVTransferParams
from services.common.pool.roles import RoleName
from services.decode.admission import DecodeAdmission
from services.decode.pull_connector import PullConnector
from services.engine.core.kv_connector import KVConnector
from services.engine.kv_transfer.context import KVTransferContext


class DecodeRole:
    """``kvferry serve --role decode``."""

    name: RoleName = "decode"

    def __init__(self) -> None:
        self._admission: DecodeAdmission | None = None

    def connectors(self, ctx: KVTransferContext) -> Sequence[KVConnector]:
        transfer = ctx.transfer(purpose=self.name)
        pull = PullConnector(transfer, ctx.block_size)
        self._admission = DecodeAdmission(transfer, pull, ctx.config.pool_secret)
        return [pull, *ctx.tiers(offload=False)]  # prefill already offloaded the prompt

    def routes(self) -> Sequence[APIRouter]:
        return ()

    async def admit(
        self, raw: dict[str, Any] | None, n: int, lora_name: str | None = None
    ) -> KVTransferParams | None:
        if self._admission is None:
            raise RuntimeError("DecodeRole.admit before the engine built its connectors")
        return await self._admission.admit(raw, n, lora_name)
