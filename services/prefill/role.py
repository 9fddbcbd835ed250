"""PrefillRole: lease connector + kvstore offload, the handshake route, and do_remote_decode admission."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter

from services.common.kv.kv_transfer import KVTransferParams
from services.common.pool.roles import RoleName
from services.engine.core.kv_connector import KVConnector
from services.engine.entrypoints.handshake import handshake_router
from services.engine.entrypoints.kv_params import parse_kv_transfer_params
from services.engine.entrypoints.role import side_channel_routes
from services.engine.kv_transfer.context import KVTransferContext
from services.engine.kv_transfer.lease_connector import LeaseConnector, LeaseSettings
from services.engine.kv_transfer.nixl_transfer import BlockTransfer


class PrefillSettings(LeaseSettings):
    """Where decode engines reach this engine, and how long a prompt's blocks wait for them."""


class PrefillRole:
    """``kvferry serve --role prefill``."""

    name: RoleName = "prefill"
    moves_kv_on_drain = False  # it holds no stream: its leases are what decode reads

    def __init__(self, settings: PrefillSettings) -> None:
        self.settings = settings
        self.transfer: BlockTransfer | None = None
        self._lease: LeaseConnector | None = None

    def connectors(self, ctx: KVTransferContext) -> Sequence[KVConnector]:
        s = self.settings
        self.transfer = ctx.transfer(purpose=self.name)
        self._lease = lease = LeaseConnector(self.transfer, s.host, s.port, ctx.block_size, s.lease_s)
        return [lease, *ctx.tiers(offload=True)]

    def routes(self) -> Sequence[APIRouter]:
        if self.transfer is None:  # its 404 says why decode gets nothing over NIXL
            return (handshake_router(None),)
        return side_channel_routes(self.transfer, self._lease)

    async def admit(
        self, raw: dict[str, Any] | None, n: int, lora_name: str | None = None
    ) -> KVTransferParams | None:
        if raw is None:
            return None
        return parse_kv_transfer_params(raw, n, self.name, unsupported="do_remote_prefill")
