"""KVStoreTier: the engine's link to the shared kvstore: fetch a missing prefix, offload blocks.

Fetches are NIXL READs from the store's arena when both sides have NIXL (the store pins the verified
prefix over gRPC and names its slots), else gRPC streams; offloads go over gRPC. Network calls run on
one worker thread; the engine thread only enqueues, copies block bytes out of its KV cache, installs
fetched blocks (a READ into fresh blocks, or a memcpy) and polls for finished fetches. A failing store
is skipped for a while (circuit breaker): engines keep serving without it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from services.common.kv.kv_transfer import KVTransferError
from services.common.kv.kvstore_client import KVStoreClient, KVStoreUnavailable
from services.engine.kv_transfer.block_bytes import BlockBytes, LocalBlocks

if TYPE_CHECKING:
    from pydantic import SecretStr

    from services.engine.kv_transfer.nixl_transfer import NixlTransfer

log = logging.getLogger(__name__)

BlockKey = tuple[bytes, Sequence[int]]
_BREAK_S = 5.0
_PIN_TTL_S = 10.0  # the store keeps pinned slots this long: the engine installs them within a step or two
_HANDSHAKE_RETRY_S = 30.0


@dataclass
class Fetch:
    """A finished fetch of the leading blocks asked for (maybe fewer, maybe none): their bytes (gRPC),
    or the store's arena slots holding them, pinned for a NIXL READ."""

    request_id: str
    first_block: int
    payloads: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    peer: str = ""  # the store's NIXL engine id the slots belong to

    @property
    def num_blocks(self) -> int:
        return len(self.slots) or len(self.payloads)

    def skip(self, n: int) -> Fetch:
        """The same fetch without its first ``n`` blocks."""
        return Fetch(self.request_id, self.first_block + n, self.payloads[n:], self.slots[n:], self.peer)

    def take(self, n: int) -> Fetch:
        """The same fetch with only its first ``n`` blocks."""
        return Fetch(self.request_id, self.first_block, self.payloads[:n], self.slots[:n], self.peer)


class KVStoreTier:
    """Moves whole blocks (all layers, one contiguous region each) between the KV cache and the store."""

    def __init__(
        self,
        url: str,
        kv_cache: torch.Tensor,
        on_failure: Callable[[str, str, str | None], None],
        timeout_s: float = 2.0,
        transfer: NixlTransfer | None = None,
        pool_secret: SecretStr | None = None,
        blocks: BlockBytes | None = None,
    ) -> None:
        """``blocks``: the KV cache's whole blocks as bytes (default: ``kv_cache``'s own; under tensor
        parallelism every rank's shards, joined)."""
        self.url = url
        self._transfer = transfer
        self._store_peer: str | None = None  # the store's NIXL engine id once handshaken
        self._next_handshake = 0.0
        self._client = KVStoreClient(url, timeout_s=timeout_s, pool_secret=pool_secret)
        self._blocks = blocks if blocks is not None else LocalBlocks(kv_cache)
        self._on_failure = on_failure
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: set[str] = set()
        self._reads: dict[
            str, tuple[Any, int]
        ] = {}  # request id -> (NIXL handle, blocks): engine thread only
        self._down_until = 0.0
        self.blocks_received = 0
        self.blocks_sent = 0
        self._thread = threading.Thread(target=self._work, name="kvferry-kvstore", daemon=True)
        self._thread.start()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    # ------------------------------------------------------------------ engine thread
    def fetch(self, request_id: str, first_block: int, keys: Sequence[BlockKey]) -> None:
        """Ask for ``keys`` (the blocks from ``first_block`` on); poll ``finished_fetches``."""
        self._pending.add(request_id)
        self._jobs.put(("get", request_id, first_block, keys))

    def finished_fetches(self) -> list[Fetch]:
        out: list[Fetch] = []
        while True:
            try:
                fetch = self._done.get_nowait()
            except queue.Empty:
                return out
            self._pending.discard(fetch.request_id)
            out.append(fetch)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def copy_in(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Copy fetched payloads into our blocks (engine thread; the blocks belong to one waiting request)."""
        self._blocks.write(block_ids, payloads)
        self.blocks_received += len(block_ids)

    def read_in(self, block_ids: list[int], fetch: Fetch) -> bool:
        """Start a NIXL READ of the fetch's pinned slots into our blocks; poll ``finished_reads``.

        False (counted, logged) when it cannot start: the request then computes those blocks itself.
        """
        try:
            handle = self._nixl().read_blocks(fetch.peer, fetch.slots, block_ids)
        except KVTransferError as exc:
            self._read_failed(fetch.request_id, str(exc))
            return False
        self._reads[fetch.request_id] = (handle, len(block_ids))
        return True

    def _nixl(self) -> NixlTransfer:
        if self._transfer is None:
            raise KVTransferError(f"no NIXL agent: blocks from {self.url} arrive over gRPC")
        return self._transfer

    def has_pending_reads(self) -> bool:
        return bool(self._reads)

    def is_reading(self, request_id: str) -> bool:
        """True while a NIXL read for this request may still write into its blocks."""
        return request_id in self._reads

    def finished_reads(self) -> list[tuple[str, int]]:
        """(request id, blocks read; 0 when the read failed) of the reads that ended since the last call."""
        out = []
        for request_id, (handle, num_blocks) in list(self._reads.items()):
            state = self._nixl().poll(handle).name  # TransferState: DONE | PENDING | ERROR
            if state == "PENDING":
                continue
            del self._reads[request_id]
            if state == "DONE":
                self.blocks_received += num_blocks
            else:
                self._read_failed(request_id, handle.error)
                num_blocks = 0
            out.append((request_id, num_blocks))
        return out

    def _read_failed(self, request_id: str, detail: str | None) -> None:
        """Count it, and fetch over gRPC for a while (handshake again in 30 s)."""
        self._store_peer, self._next_handshake = None, time.monotonic() + _HANDSHAKE_RETRY_S
        self._on_failure("transfer_error", request_id, f"NIXL read from {self.url} failed: {detail}")

    def offload(self, items: list[tuple[bytes, Sequence[int], int]]) -> None:
        """Copy (hash, tokens, block id) blocks out now; the worker puts them to the store later."""
        if not items or not self.available:
            return
        data = self._blocks.read([bid for _, _, bid in items])
        blocks = [(h, list(toks), d) for (h, toks, _), d in zip(items, data, strict=True)]
        self._jobs.put(("put", blocks))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._client.close()

    # ------------------------------------------------------------------ worker thread
    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job[0] == "get":
                _, rid, first, keys = job
                self._done.put(self._get(rid, first, keys))
            else:
                self._put(job[1])

    def _get(self, request_id: str, first: int, keys: Sequence[BlockKey]) -> Fetch:
        if not self.available:
            return Fetch(request_id, first)
        try:
            peer = self._nixl_peer()
            if peer is not None:
                store_id, slots = self._pin(keys)
                if store_id != peer:  # another replica answered: its slots index another arena
                    self._forget_peer()
                    self._on_failure(
                        "peer_restarted",
                        request_id,
                        f"{self.url}: pinned by store {store_id or '?'}, not {peer} (handshaken): not read",
                    )
                    return Fetch(request_id, first)
                return Fetch(request_id, first, slots=slots, peer=peer)
            return Fetch(request_id, first, payloads=self._client.get(keys))
        except KVStoreUnavailable as exc:
            self._trip(request_id, exc)
            return Fetch(request_id, first)

    def _pin(self, keys: Sequence[BlockKey]) -> tuple[str, list[int]]:
        """(store id, slots) of the verified prefix; a failure forgets the handshake (a restarted store has
        a new arena)."""
        try:
            return self._client.pin(keys, ttl_s=_PIN_TTL_S)
        except KVStoreUnavailable:
            self._forget_peer()
            raise

    def _forget_peer(self) -> None:
        """Handshake again before the next fetch (the store may have restarted with a new arena)."""
        self._store_peer, self._next_handshake = None, 0.0

    def _nixl_peer(self) -> str | None:
        """The store's NIXL engine id, handshaking first (retried every 30 s); None: fetch over gRPC."""
        if self._store_peer is not None or self._transfer is None or time.monotonic() < self._next_handshake:
            return self._store_peer
        try:
            handshake = self._client.nixl_handshake(self._transfer.compat.model_dump_json())
            self._store_peer = self._transfer.add_peer(handshake, address=self.url)
            log.info("kvstore %s: fetching blocks with NIXL READs from its arena", self.url)
        except (KVStoreUnavailable, KVTransferError, ValueError) as exc:
            self._next_handshake = time.monotonic() + _HANDSHAKE_RETRY_S
            log.warning("kvstore %s: no NIXL path (%s); fetching over gRPC", self.url, exc)
        return self._store_peer

    def _put(self, blocks: list[tuple[bytes, list[int], bytes]]) -> None:
        if not self.available:
            return
        try:
            self._client.put(blocks)
            self.blocks_sent += len(blocks)
        except KVStoreUnavailable as exc:
            self._trip("offload", exc)

    def _trip(self, what: str, exc: Exception) -> None:
        self._down_until = time.monotonic() + _BREAK_S
        self._on_failure("kvstore_unavailable", what, f"{self.url}: {exc}; skipping it for {_BREAK_S:.0f}s")
