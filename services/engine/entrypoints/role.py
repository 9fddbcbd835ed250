"""EngineRole: what a serving role adds to the engine: KV connectors, HTTP routes, kv_transfer_params admission.

The engine knows only this seam; the prefill and decode packages implement it (``kvferry serve --role``
composes them), and ``AggregatedRole`` is role ``both``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import APIRouter

from services.common.kv.kv_transfer import KVTransferParams
from services.common.pool.roles import RoleName
from services.engine.core.kv_connector import KVConnector
from services.engine.entrypoints.handshake import handshake_router
from services.engine.entrypoints.kv_params import kv_incompatible, parse_kv_transfer_params
from services.engine.entrypoints.prefix_export import export_router
from services.engine.entrypoints.pull_admission import PullAdmission
from services.engine.kv_transfer.context import KVTransferContext, aggregated_connectors
from services.engine.kv_transfer.lease_connector import LeaseConnector, LeaseSettings
from services.engine.kv_transfer.nixl_transfer import BlockTransfer
from services.engine.kv_transfer.pull_connector import PullConnector

__all__ = ["AggregatedRole", "EngineRole", "kv_incompatible", "parse_kv_transfer_params"]


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
    """Role ``both``: prompts are computed and decoded here; the P/D hand-off is ignored.

    With a NIXL agent (``settings`` given, NIXL available and not ``--no-nixl``) it also moves KV between
    aggregated engines: a drain leases its streams' KV (lease connector), and a request naming another
    engine's blocks (``do_remote_prefill``: a moved stream, a peer's prefix) READs them (pull connector);
    ``POST /kv/export`` leases a cached prefix a peer is about to compute (P2P prefix pull). Without one its
    drained streams are replayed by the router (recompute), and kv_transfer_params are ignored.
    """

    name: RoleName = "both"

    def __init__(self, settings: LeaseSettings | None = None) -> None:
        """``settings``: where peers reach this engine (None: no KV moves, e.g. an embedding engine)."""
        self.settings = settings
        self.transfer: BlockTransfer | None = None
        self.moves_kv_on_drain = False  # set once connectors found a NIXL agent
        self._admission: PullAdmission | None = None
        self._lease: LeaseConnector | None = None

    def connectors(self, ctx: KVTransferContext) -> Sequence[KVConnector]:
        s = self.settings
        self.transfer = ctx.transfer() if s is not None and ctx.task != "embed" else None
        if s is None or self.transfer is None:
            return aggregated_connectors(ctx)
        pull = PullConnector(self.transfer, ctx.block_size)
        self._lease = lease = LeaseConnector(self.transfer, s.host, s.port, ctx.block_size, s.lease_s)
        self._admission = PullAdmission(self.transfer, pull, ctx.config.pool_secret, role=self.name)
        self.moves_kv_on_drain = True
        return [pull, lease, *aggregated_connectors(ctx)]

    def routes(self) -> Sequence[APIRouter]:
        return side_channel_routes(self.transfer, self._lease)

    async def admit(
        self, raw: dict[str, Any] | None, n: int, lora_name: str | None = None
    ) -> KVTransferParams | None:
        if raw is None or self._admission is None or raw.get("do_remote_decode"):
            return None  # no NIXL agent, or a P/D hand-off: served as a local request
        return await self._admission.admit(raw, n, lora_name)


def side_channel_routes(transfer: BlockTransfer | None, lease: LeaseConnector | None) -> Sequence[APIRouter]:
    """``GET /kv/handshake`` and ``POST /kv/export`` of an engine with a NIXL agent (none without one)."""
    if transfer is None or lease is None:
        return ()
    return (handshake_router(transfer), export_router(lease))
