"""DecodeRole: pull connector + kvstore fetch (no offload), admission that handshakes with prefill, and a lease
connector so a drain hands its running streams' KV to another decode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter

from services.common.kv.kv_transfer import KVTransferParams
from services.common.pool.roles import RoleName
from services.engine.core.kv_connector import KVConnector
from services.engine.entrypoints.pull_admission import PullAdmission
from services.engine.entrypoints.role import side_channel_routes
from services.engine.kv_transfer.context import KVTransferContext
from services.engine.kv_transfer.lease_connector import LeaseConnector, LeaseSettings
from services.engine.kv_transfer.nixl_transfer import BlockTransfer
from services.engine.kv_transfer.pull_connector import PullConnector


class DecodeRole:
    """``kvferry serve --role decode``."""

    name: RoleName = "decode"
    moves_kv_on_drain = True  # SIGTERM: streams marked migrate_on_drain end with their KV leased here

    def __init__(self, settings: LeaseSettings | None = None) -> None:
        self.settings = settings or LeaseSettings()
        self._admission: PullAdmission | None = None
        self._transfer: BlockTransfer | None = None
        self._lease: LeaseConnector | None = None

    def connectors(self, ctx: KVTransferContext) -> Sequence[KVConnector]:
        s = self.settings
        self._transfer = transfer = ctx.transfer(purpose=self.name)
        pull = PullConnector(transfer, ctx.block_size)
        self._lease = lease = LeaseConnector(transfer, s.host, s.port, ctx.block_size, s.lease_s)
        self._admission = PullAdmission(transfer, pull, ctx.config.pool_secret)
        return [pull, lease, *ctx.tiers(offload=False)]  # prefill already offloaded the prompt

    def routes(self) -> Sequence[APIRouter]:
        return side_channel_routes(self._transfer, self._lease)

    async def admit(
        self, raw: dict[str, Any] | None, n: int, lora_name: str | None = None
    ) -> KVTransferParams | None:
        if self._admission is None:
            raise RuntimeError("DecodeRole.admit before the engine built its connectors")
        return await self._admission.admit(raw, n, lora_name)
