"""KVStoreConnector: the shared kvstore as a KV connector: fetch a missing prefix, offload finished prompts.

A request whose prefix is not all in the local cache is looked up in the store once (asynchronously:
the scheduler is told "not known yet" until the answer arrives). Pinned arena slots are READ with NIXL
into freshly allocated blocks (an asynchronous load); gRPC payloads are copied in at once. A finished
request's prompt blocks that it computed itself are offloaded (copied now, sent by the tier's worker).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from services.common.kv.kv_transfer import KVTransferParams
from services.engine.core.kv_connector import FinishedTransfers, Match, TransferStats
from services.engine.core.request import Request
from services.engine.kv_transfer.kvstore_tier import Fetch, KVStoreTier

log = logging.getLogger(__name__)

_IN_FLIGHT = None  # a lookup whose answer has not arrived


class KVStoreConnector:
    """One engine's use of the kvstore tier; ``offload=False`` on decode (prefill offloaded the prompt)."""

    def __init__(
        self, tier: KVStoreTier, block_size: int, stats: TransferStats, offload: bool = True
    ) -> None:
        self.tier, self.block_size, self.offload = tier, block_size, offload
        self._stats = stats  # failures are counted here by the tier's on_failure callback
        self._lookups: dict[str, Fetch | None] = {}  # request id -> its answer (None while in flight)
        self._checked: set[str] = set()  # asked once per request: never again (preemption, a failed read)
        self._matched: dict[str, Fetch] = {}  # the part of an answer offered this step, until allocated
        self._failed: set[str] = set()  # reads that could not start, reported at the next get_finished
        self._asked: dict[str, float] = {}  # request id -> when its lookup started (load latency)

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> Match | None:
        rid, bs = request.request_id, self.block_size
        if rid in self._checked:
            return 0, False
        if rid not in self._lookups:
            first, last = num_local_computed // bs, (request.num_tokens - 1) // bs
            if first >= last or not self.tier.available:
                return 0, False
            toks = request.all_token_ids
            keys = [(request.block_hashes[i], toks[i * bs : (i + 1) * bs]) for i in range(first, last)]
            self._lookups[rid] = _IN_FLIGHT
            self._asked[rid] = time.monotonic()
            self.tier.fetch(rid, first, keys)
            return None
        fetch = self._lookups[rid]
        if fetch is None:
            return None
        skip = num_local_computed // bs - fetch.first_block
        if skip < 0 or skip >= fetch.num_blocks:  # nothing found, or the local hit grew past it meanwhile
            del self._lookups[rid]
            self._asked.pop(rid, None)
            self._checked.add(rid)
            return 0, False
        part = self._matched[rid] = fetch.skip(skip)  # the answer stays until blocks are allocated
        return min(part.num_blocks * bs, request.num_tokens - 1 - num_local_computed), bool(part.slots)

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        rid = request.request_id
        part = self._matched.pop(rid)
        del self._lookups[rid]
        self._checked.add(rid)
        n = -(-num_external // self.block_size)
        ids = list(block_ids[part.first_block : part.first_block + n])
        if part.slots:
            if not self.tier.read_in(ids, part.take(n)):
                self._failed.add(rid)  # counted by the tier; the request computes those blocks itself
                self._asked.pop(rid, None)
        else:
            self.tier.copy_in(ids, part.payloads[:n])
            self._loaded(rid)

    def request_finished(
        self, request: Request, block_ids: Sequence[int]
    ) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        self._checked.discard(rid)
        self._asked.pop(rid, None)
        self._matched.pop(rid, None)
        self._lookups.pop(rid, None)  # an answer still on its way is dropped when it arrives
        if self.offload and request.status.completed:
            self._offload(request, block_ids)
        return self.tier.is_reading(rid), None  # a NIXL read still writes into its blocks

    def _offload(self, request: Request, block_ids: Sequence[int]) -> None:
        """The prompt's full blocks this request computed itself (not those it found cached, nor those
        a sliding window already freed: id -1)."""
        bs = self.block_size
        first = max(request.num_cached_tokens, 0) // bs
        last = min(request.num_prompt_tokens // bs, len(request.block_hashes), len(block_ids))
        toks = request.all_token_ids
        self.tier.offload(
            [
                (request.block_hashes[i], toks[i * bs : (i + 1) * bs], block_ids[i])
                for i in range(first, last)
                if block_ids[i] >= 0
            ]
        )

    def get_finished(self) -> FinishedTransfers:
        for fetch in self.tier.finished_fetches():
            if fetch.request_id in self._lookups:
                self._lookups[fetch.request_id] = fetch
        received: set[str] = set()
        failed, self._failed = self._failed, set()
        for rid, num_blocks in self.tier.finished_reads():
            (received if num_blocks else failed).add(rid)
            if num_blocks:
                self._loaded(rid)
            else:
                self._asked.pop(rid, None)
        if not received and not failed:
            return FinishedTransfers()
        return FinishedTransfers(received=frozenset(received), failed=frozenset(failed))

    def _loaded(self, rid: str) -> None:
        """The request's blocks from the store are usable: its lookup to now is one kvstore load."""
        asked = self._asked.pop(rid, None)
        if asked is not None:
            self._stats.observe_load("kvstore", time.monotonic() - asked)

    def stats(self) -> TransferStats:
        out = TransferStats()
        out.merge(self._stats)
        out.add_blocks("received", "kvstore", self.tier.blocks_received)
        out.add_blocks("sent", "kvstore", self.tier.blocks_sent)
        return out

    def close(self) -> None:
        self.tier.close()
