"""KVStoreTier: the engine's link to the shared kvstore (gRPC): fetch a missing prefix, offload blocks.

Network calls run on one worker thread; the engine thread only enqueues, copies block bytes out of or
into its KV cache (memcpy), and polls for finished fetches. A failing store is skipped for a while
(circuit breaker): engines keep serving without it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.common.kvstore_client import KVStoreClient, KVStoreUnavailable

log = logging.getLogger(__name__)

BlockKey = tuple[bytes, Sequence[int]]
_BREAK_S = 5.0


@dataclass
class Fetch:
    """A finished fetch: the verified payloads of the leading blocks asked for (maybe fewer, maybe none)."""

    request_id: str
    first_block: int
    payloads: list[bytes]


class KVStoreTier:
    """Moves whole blocks (all layers, one contiguous region each) between the KV cache and the store."""

    def __init__(self, url: str, kv_cache: torch.Tensor, on_failure: Callable[[str, str, str | None], None],
                 timeout_s: float = 2.0) -> None:
        self.url = url
        self._client = KVStoreClient(url, timeout_s=timeout_s)
        self._cache_bytes = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
        self._on_failure = on_failure
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: set[str] = set()
        self._down_until = 0.0
        self.blocks_received = 0
        self.blocks_sent = 0
        self._thread = threading.Thread(target=self._work, name="kvferry-kvstore", daemon=True)
        self._thread.start()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    # ------------------------------------------------------------------ engine thread
    def fetch(self, request_id: str, first_block: int, keys: list[BlockKey]) -> None:
        """Ask for ``keys`` (the blocks from ``first_block`` on); poll ``finished_fetches``."""
        self._pending.add(request_id)
        self._jobs.put(("get", request_id, first_block, keys))

    def finished_fetches(self) -> list[Fetch]:
        out = []
        while True:
            try:
                fetch = self._done.get_nowait()
            except queue.Empty:
                return out
            self._pending.discard(fetch.request_id)
            out.append(fetch)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def install(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Copy fetched payloads into our blocks (engine thread; the blocks belong to one waiting request)."""
        for block_id, data in zip(block_ids, payloads, strict=True):
            self._cache_bytes[block_id].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.blocks_received += len(block_ids)

    def offload(self, items: list[tuple[bytes, Sequence[int], int]]) -> None:
        """Copy (hash, tokens, block id) blocks out now; the worker puts them to the store later."""
        if not items or not self.available:
            return
        blocks = [(h, list(toks), self._cache_bytes[bid].numpy().tobytes()) for h, toks, bid in items]
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
                self._done.put(Fetch(rid, first, self._get(rid, keys)))
            else:
                self._put(job[1])

    def _get(self, request_id: str, keys: list[BlockKey]) -> list[bytes]:
        if not self.available:
            return []
        try:
            return self._client.get(keys)
        except KVStoreUnavailable as exc:
            self._trip(request_id, exc)
            return []

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
