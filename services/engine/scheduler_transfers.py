"""TransferScheduling: the scheduler's admission steps for remote KV (P/D over NIXL) and the kvstore tier.

A decode request with prefill's kv_transfer_params waits in WAITING_FOR_REMOTE_KV while NIXL reads the
blocks; a request that misses locally waits while the kvstore worker fetches its prefix; a finished
prefill leases its blocks. Mixed into Scheduler, whose queues and KV manager it uses.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request, RequestStatus

LEASABLE = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH})


class TransferScheduling:
    """Remote-KV and kvstore bookkeeping; expects Scheduler's attributes below."""

    kv: KVCacheManager
    connector: Any
    store: Any
    waiting: deque[Request]
    loading: dict[str, Request]
    leased: dict[str, Request]
    _aborted_loads: set[str]

    def _lease(self, request: Request) -> None:
        """Prefill finished: keep the prompt's full blocks for decode and say where they are."""
        n_full = min(request.num_prompt_tokens // self.kv.block_size, len(request.block_hashes))
        blocks = self.kv.blocks_of(request.request_id)[:n_full]
        request.remote_kv_out = self.connector.hold(
            request.request_id, [b.block_id for b in blocks], request.block_hashes[:n_full]
        )
        if blocks and self.connector.transfer is not None:
            self.leased[request.request_id] = request
        else:  # nothing to read over NIXL (short prompt, or KV goes through the kvstore)
            self.kv.free(request)

    def _poll_transfers(self) -> None:
        """Apply what finished since the last step: released leases, NIXL reads, kvstore fetches."""
        if self.connector is not None:
            for rid in self.connector.released_leases():
                request = self.leased.pop(rid, None)
                if request is not None:
                    self.kv.free(request)
            if self.connector.has_pending_loads():
                for rid, ok in self.connector.finished_loads():
                    self._finish_load(rid, ok)
        if self.store is not None and self.store.has_pending():
            for fetch in self.store.finished_fetches():
                self._finish_fetch(fetch)
        if self.store is not None and self.store.has_pending_reads():
            for rid, num_blocks in self.store.finished_reads():
                self._finish_store_read(rid, num_blocks)

    def _read_ended(self, rid: str) -> Request | None:
        """The request whose KV read ended; None if unknown or aborted meanwhile (its blocks are freed now)."""
        request = self.loading.pop(rid, None)
        if request is not None and rid in self._aborted_loads:
            self._aborted_loads.discard(rid)
            self.kv.free(request)
            return None
        return request

    def _requeue(self, request: Request) -> None:
        """Back to the head of the queue once its KV arrived (or did not)."""
        request.transition(RequestStatus.WAITING)
        self.waiting.appendleft(request)

    def _finish_load(self, rid: str, ok: bool) -> None:
        request = self._read_ended(rid)
        if request is None:
            return
        params = request.kv_transfer_params
        request.kv_transfer_params = None  # consumed: a preempted request recomputes
        if not ok and self.store is not None and self.store.available:
            self.kv.free(request)  # the read is over; try the kvstore (prefill offloaded its blocks there)
            request.num_computed_tokens = 0
        elif ok:
            loaded = min(len(params.remote_block_ids) * self.kv.block_size, request.num_prompt_tokens - 1)
            request.num_computed_tokens = loaded
            self.kv.cache_full_blocks(request, loaded)
        request.num_cached_tokens = request.num_computed_tokens
        self._requeue(request)

    def _start_remote_load(self, request: Request) -> bool:
        """Decode: local prefix hit, blocks for the rest of prefill's blocks, and a NIXL read into them.

        Returns False only when blocks are short (the request stays at the head of the queue).
        """
        params, bs = request.kv_transfer_params, self.kv.block_size
        computed, n_local = self.kv.get_computed_blocks(request)
        n_remote = len(params.remote_block_ids)
        if params.hashes() != request.block_hashes[:n_remote]:
            self.connector.record_failure("hash_mismatch", request.request_id,
                                          "prefill's block hashes differ from this prompt's")
            return self._drop_remote(request)
        if n_remote * bs <= n_local or n_remote == 0:
            return self._drop_remote(request)
        new_blocks = self.kv.allocate_slots(request, n_remote * bs - n_local, computed, n_local, cache=False)
        if new_blocks is None:
            return False
        self.waiting.popleft()
        request.num_computed_tokens = n_local
        first = n_local // bs
        started = self.connector.start_load(request.request_id, params, params.remote_block_ids[first:],
                                            [b.block_id for b in new_blocks])
        request.transition(RequestStatus.WAITING_FOR_REMOTE_KV)
        self.loading[request.request_id] = request
        if not started:
            self._finish_load(request.request_id, False)
        return True

    # ------------------------------------------------------------------ kvstore tier
    def _should_fetch(self, request: Request) -> bool:
        """Ask the store once, for a request starting from scratch whose prefix we lack locally."""
        if self.store is None or request.store_checked or not self.store.available:
            return False
        if request.needs_prompt_logprobs:
            return False
        if request.num_computed_tokens or request.request_id in self.kv.req_to_blocks:
            return False
        return self.kv.num_cached_prefix_blocks(request) < (request.num_tokens - 1) // self.kv.block_size

    def _start_fetch(self, request: Request) -> None:
        """Park the request (holding no blocks) while the worker fetches the prefix we lack."""
        bs = self.kv.block_size
        request.store_checked = True
        first, last = self.kv.num_cached_prefix_blocks(request), (request.num_tokens - 1) // bs
        toks = request.all_token_ids
        keys = [(request.block_hashes[i], toks[i * bs : (i + 1) * bs]) for i in range(first, last)]
        self.waiting.popleft()
        request.transition(RequestStatus.WAITING_FOR_REMOTE_KV)
        self.loading[request.request_id] = request
        self.store.fetch(request.request_id, first, keys)

    def _finish_fetch(self, fetch: Any) -> None:
        request = self._read_ended(fetch.request_id)  # an aborted one holds no blocks yet
        if request is not None:
            request.fetched = fetch if fetch.num_blocks else None
            self._requeue(request)

    def _install_fetched(self, request: Request) -> bool:
        """Local hit + fetched blocks become computed; False when blocks are short (retry next step).

        Pinned slots are READ with NIXL while the request waits again (WAITING_FOR_REMOTE_KV); a read that
        cannot start (counted) leaves only the local hit, and the request computes the rest itself.
        """
        fetch, bs = request.fetched, self.kv.block_size
        computed, n_local = self.kv.get_computed_blocks(request)
        skip = n_local // bs - fetch.first_block
        if skip < 0 or skip >= fetch.num_blocks:  # the local hit changed: fetched blocks do not line up
            request.fetched = None
            return True
        part = fetch.skip(skip)
        new_blocks = self.kv.allocate_slots(request, part.num_blocks * bs, computed, n_local, cache=False)
        if new_blocks is None:
            return False
        request.fetched = None
        request.num_computed_tokens = n_local
        block_ids = [b.block_id for b in new_blocks]
        if part.slots:
            if self.store.read_in(block_ids, part):
                self.waiting.popleft()
                request.transition(RequestStatus.WAITING_FOR_REMOTE_KV)
                self.loading[request.request_id] = request
            return True
        self.store.copy_in(block_ids, part.payloads)
        self._computed_from_store(request, part.num_blocks)
        return True

    def _finish_store_read(self, rid: str, num_blocks: int) -> None:
        """A NIXL read from the store ended (``num_blocks`` 0: it failed): the request queues again."""
        request = self._read_ended(rid)
        if request is not None:
            self._computed_from_store(request, num_blocks)
            self._requeue(request)

    def _computed_from_store(self, request: Request, num_blocks: int) -> None:
        """``num_blocks`` blocks after the local hit now hold the store's KV: cache them, count them computed."""
        valid = request.num_computed_tokens + num_blocks * self.kv.block_size
        if num_blocks:
            self.kv.cache_full_blocks(request, valid)
        request.num_computed_tokens = min(valid, request.num_tokens - 1)

    def _offload(self, request: Request) -> None:
        """Put the prompt's full blocks this request computed itself into the store (copied now, sent later)."""
        bs = self.kv.block_size
        blocks = self.kv.blocks_of(request.request_id)
        first = max(request.num_cached_tokens, 0) // bs
        last = min(request.num_prompt_tokens // bs, len(request.block_hashes), len(blocks))
        toks = request.all_token_ids
        self.store.offload([(request.block_hashes[i], toks[i * bs : (i + 1) * bs], blocks[i].block_id)
                            for i in range(first, last)])

    def _drop_remote(self, request: Request) -> bool:
        """Serve without prefill's blocks (a local hit covers them, or they cannot be used)."""
        self.connector.release_remote(request.kv_transfer_params)
        request.kv_transfer_params = None
        return True
