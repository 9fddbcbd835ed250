"""KVTransferContext: what connectors are built from: the engine's KV cache, its compatibility, one NIXL agent."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from services.common.kv.kv_events import KVEvent
from services.common.kv.kv_transfer import KVCompat
from services.engine.core.config import EngineConfig
from services.engine.core.kv_connector import KVConnector, TransferStats

if TYPE_CHECKING:
    from services.engine.kv_transfer.nixl_transfer import BlockTransfer, NixlTransfer
    from services.engine.kv_transfer.rank_transfer import RankTransferClient

log = logging.getLogger(__name__)


class KVTransferContext:
    """Handed to a role's connector factory while the engine is built; creates at most one NIXL agent."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: torch.Tensor,
        compat: KVCompat,
        ranks: Sequence[RankTransferClient] = (),
        kv_heads: Sequence[tuple[int, int]] = (),
        emit: Callable[[KVEvent], None] | None = None,
        task: str = "generate",
    ) -> None:
        """``ranks``: the other ranks' agents (their KV shards and stages), when there are any;
        ``kv_heads``: each rank's (first KV head, count) under tensor parallelism, rank order;
        ``emit``: where a tier's KV events go (published with the primary pool's); ``task``: the engine's
        resolved task (an embedding engine's cache holds no stream to move)."""
        self.task = task
        self.config, self.kv_cache, self.compat = config, kv_cache, compat
        self.kv_heads, self.emit = list(kv_heads), emit
        self.ranks = list(ranks)
        self.block_size = compat.block_size
        self._transfer: BlockTransfer | None = None
        self._local: NixlTransfer | None = None  # this process's agent (workers close theirs with their pipe)
        self._transfer_tried = False

    def transfer(self, purpose: str | None = None) -> BlockTransfer | None:
        """The engine's NIXL agent over its KV cache (created on first use); None without NIXL.

        ``purpose`` names a user that needs NIXL (e.g. "prefill"): its absence is then logged as a warning.
        """
        if not self._transfer_tried:
            self._transfer_tried = True
            from services.engine.kv_transfer.nixl_transfer import NixlTransfer, nixl_available
            from services.engine.kv_transfer.tp_transfer import TPNixlTransfer

            if self.config.use_nixl and nixl_available():
                self._local = local = NixlTransfer(self.kv_cache, self.compat)
                self._transfer = TPNixlTransfer(local, self.ranks) if self.ranks else local
        if self._transfer is None and purpose is not None:
            path = "the kvstore" if self.config.kvstore_url else "nothing: decode will recompute prompts"
            log.warning(
                "NIXL is %s: role %s moves KV through %s",
                "disabled" if not self.config.use_nixl else "not available",
                purpose,
                path,
            )
        return self._transfer

    def close(self) -> None:
        """Release this process's NIXL agent (its peers, descriptors and registration), if one was made."""
        if self._local is not None:
            self._local.close()

    def tiers(self, offload: bool = True) -> list[KVConnector]:
        """This engine's KV tiers, nearest first: its host-memory tier (``kv_offload_cpu_bytes``), then the
        shared kvstore (``kvstore_url``); ``offload`` puts finished prompts into the kvstore."""
        return [*self.host_tier(), *self.kvstore(offload)]

    def host_tier(self) -> list[KVConnector]:
        """The host-memory tier when ``kv_offload_cpu_bytes`` is set (none otherwise)."""
        budget = self.config.kv_offload_cpu_bytes
        if not budget:
            return []
        from services.engine.kv_transfer.disk_tier import DiskKVTier
        from services.engine.kv_transfer.host_tier import HostKVTier
        from services.engine.kv_transfer.offload_connector import OffloadConnector

        per_block = self.kv_cache[0].numel() * self.kv_cache.element_size()
        if budget < per_block:
            raise ValueError(f"kv_offload_cpu_bytes={budget}: below one KV block ({per_block} bytes)")
        log.info("host KV tier: %d blocks (%d MiB)", budget // per_block, budget // 2**20)
        disk = None
        if self.config.kv_offload_disk_path is not None:
            layout = self.compat.model_dump_json()  # blocks of another model, dtype or layout never load
            disk = DiskKVTier(
                self.config.kv_offload_disk_path, self.config.kv_offload_disk_bytes, layout, per_block
            )
        tier = HostKVTier(self.kv_cache, budget // per_block, disk=disk, policy=self.config.kv_offload_policy)
        return [OffloadConnector(tier, self.block_size, self.emit)]

    def kvstore(self, offload: bool = True) -> list[KVConnector]:
        """The kvstore connector when ``kvstore_url`` is set (none otherwise); ``offload`` puts finished prompts."""
        if not self.config.kvstore_url:
            return []
        from services.engine.kv_transfer.block_bytes import ShardedBlocks
        from services.engine.kv_transfer.kvstore_connector import KVStoreConnector
        from services.engine.kv_transfer.kvstore_tier import KVStoreTier
        from services.engine.kv_transfer.nixl_transfer import NixlTransfer

        transfer = self.transfer()
        stats = TransferStats()

        def on_failure(reason: str, what: str, detail: str | None) -> None:
            log.warning("kvstore %s failed (%s): %s", what, reason, detail)
            stats.add_failure(reason)

        blocks = ShardedBlocks(self.kv_cache, self.ranks, self.kv_heads) if self.ranks else None
        tier = KVStoreTier(
            self.config.kvstore_url,
            self.kv_cache,
            on_failure,
            transfer=transfer if isinstance(transfer, NixlTransfer) else None,  # tensor parallelism: gRPC
            pool_secret=self.config.pool_secret,
            blocks=blocks,
        )
        return [KVStoreConnector(tier, self.block_size, stats, offload=offload)]


ConnectorFactory = Callable[[KVTransferContext], Sequence[KVConnector]]


def aggregated_connectors(ctx: KVTransferContext) -> Sequence[KVConnector]:
    """Role ``both``: the KV tiers configured (host memory, kvstore), else nothing."""
    return ctx.tiers(offload=True)
