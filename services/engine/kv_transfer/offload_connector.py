"""OffloadConnector: the host KV tier as a KV connector: prefixes found there are loaded back while the request
waits (WAITING_FOR_REMOTE_KV, as P/D does); a finished request's full blocks are stored off the step.
Its KV events say what each tier holds: tier "cpu" for host memory, "disk" for the disk tier behind it
(a block the host tier demotes is removed from "cpu" and stored in "disk"; one the disk tier evicts or
finds damaged is removed from "disk"; blocks a disk tier kept across a restart are announced at start).

A finished request keeps its blocks (a delayed free) until the tier's worker has copied them; a store the
tier drops (queue full, every slot in use) frees them at once, and outputs never change: the tier is only
ever a second chance at a prefix hit. Under tensor parallelism the tier is refused (rank 0 holds one shard).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from services.common.kv.kv_events import KVEvent, Tier
from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.kv_connector import FinishedTransfers, Match, TransferStats
from services.engine.core.request import Request
from services.engine.kv_transfer.host_tier import HostKVTier

MEDIUM: Tier = "cpu"  # the tier's name in metrics and KV events


class OffloadConnector:
    """One engine's host tier: ``get_num_new_matched_tokens`` answers at once (an in-process index)."""

    def __init__(
        self, tier: HostKVTier, block_size: int, emit: Callable[[KVEvent], None] | None = None
    ) -> None:
        """``emit``: the engine's KV events: blocks the host tier and the disk tier behind it hold and drop,
        as tiers "cpu" and "disk", in the order they changed."""
        self.tier, self.block_size, self._emit = tier, block_size, emit
        # request id -> (first block, pinned host slots, the block hashes after them found on disk)
        self._matched: dict[str, tuple[int, list[int], list[bytes]]] = {}
        self._stats = TransferStats()
        self._failed_now: set[str] = set()  # loads that could not start, reported at the next get_finished

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        rid, bs = request.request_id, self.block_size
        self._forget(rid)
        first, last = num_local_computed // bs, (request.num_tokens - 1) // bs
        if first >= last:
            return 0, False
        hashes = request.block_hashes[first:last]
        slots = self.tier.lookup(hashes)
        disk = hashes[len(slots) : len(slots) + self.tier.on_disk(hashes[len(slots) :])]
        if not slots and not disk:
            return 0, False
        self._matched[rid] = (first, slots, disk)
        return min((len(slots) + len(disk)) * bs, request.num_tokens - 1 - num_local_computed), True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        rid = request.request_id
        first, slots, disk = self._matched.pop(rid)
        n = -(-num_external // self.block_size)
        self.tier.unpin(slots[n:])
        ids = list(block_ids[first : first + n])
        if not self.tier.load(rid, ids, slots[:n], disk[: max(0, n - len(slots))]):
            self._stats.add_failure("offload_queue_full")
            self._failed_now.add(rid)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        self._forget(request.request_id)
        if not request.status.completed:
            return False, None
        n = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(block_ids))
        full = [(b, request.block_hashes[i]) for i, b in enumerate(block_ids[:n]) if b >= 0]
        if not full:
            return False, None
        stored = self.tier.store(request.request_id, [b for b, _ in full], [h for _, h in full])
        return stored, None  # the blocks stay until the copy is done

    def get_finished(self) -> FinishedTransfers:
        sent: set[str] = set()
        received: set[str] = set()
        failed, self._failed_now = self._failed_now, set()
        self._report()
        for job, ok in self.tier.finished():
            if job.demote:
                self._stats.add_blocks("sent", "disk", len(job.slots) if ok else 0)
            elif job.store:
                sent.add(job.request_id)
                self._stats.add_blocks("sent", MEDIUM, len(job.blocks) if ok else 0)
            elif ok:
                received.add(job.request_id)
                self._stats.add_blocks("received", MEDIUM, len(job.slots))
                self._stats.add_blocks("received", "disk", len(job.disk_hashes))
                # a load that reads any block from disk is a disk load (it waits for its slowest part)
                self._stats.observe_load("disk" if job.disk_hashes else MEDIUM, time.monotonic() - job.queued)
            else:
                self._stats.add_failure("offload_load_failed")
                failed.add(job.request_id)
        if not (sent or received or failed):
            return FinishedTransfers()
        return FinishedTransfers(frozenset(sent), frozenset(received), frozenset(failed))

    def _report(self) -> None:
        """What the host and disk tiers stored and dropped since the last step, as KV events."""
        logs = [self.tier.log] if self.tier.disk is None else [self.tier.log, self.tier.disk.log]
        for log in logs:
            for event in log.take(self.block_size):
                if self._emit is not None:
                    self._emit(event)

    def stats(self) -> TransferStats:
        out = TransferStats()
        out.merge(self._stats)
        if self.tier.dropped:
            out.failures["offload_dropped"] += self.tier.dropped
        if self.tier.disk is not None and self.tier.disk.corrupt:
            out.failures["offload_disk_corrupt"] += self.tier.disk.corrupt
        out.held[MEDIUM] += self.tier.used
        if self.tier.disk is not None:
            out.held["disk"] += len(self.tier.disk.index)
        return out

    def close(self) -> None:
        self.tier.close()

    def _forget(self, rid: str) -> None:
        """A match offered before and not allocated (the scheduler asks again, or the request ended)."""
        match = self._matched.pop(rid, None)
        if match is not None:
            self.tier.unpin(match[1])
