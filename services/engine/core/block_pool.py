"""BlockPool: a fixed set of KV blocks with ref counts, an O(1) LRU free queue and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVCacheBlock:
    """One KV block. Free blocks sit in an intrusive doubly-linked list (prev/next)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "external", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.external = False  # its KV was written by a connector, not by this engine's models
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """LRU queue of free blocks: pop from the front (evict), append at the back, remove from anywhere."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-2)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next
        if block is self.tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev
        assert last is not None
        last.next, block.prev = block, last
        block.next, self.tail.prev = self.tail, block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self.head.next
        assert first is not None
        self.head.next, block.prev = block, self.head
        block.next, first.prev = first, block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        out, node = [], self.head.next
        while node is not None and node is not self.tail:
            out.append(node.block_id)
            node = node.next
        return out


class BlockPool:
    """All KV blocks of one engine. Cached blocks stay reusable after free until they are evicted."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.record_events = record_events  # on when a publisher drains take_events() every step
        self._events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks off the LRU front, evicting their cached content."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            block.external = False
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self._emit(BlockRemoved((block.block_hash,)))
        block.block_hash = None

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        start: int,
        end: int,
        block_size: int,
    ) -> None:
        """Register blocks[start:end] (now full) under their hashes; first holder of a hash wins."""
        if not self.enable_caching or end <= start:
            return
        stored: list[bytes] = []
        for i in range(start, end):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None or block.block_id < 0:  # cached, or the null block
                continue
            if block_hash not in self.cached:
                self.cached[block_hash] = block
                block.block_hash = block_hash
                stored.append(block_hash)
        if stored:
            parent = block_hashes[start - 1] if start > 0 else None
            toks = tuple(token_ids[start * block_size : end * block_size])
            self._emit(BlockStored(tuple(stored), parent, toks, block_size))

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], front: bool = False) -> None:
        """Drop one reference each; blocks reaching zero join the queue in the given order.

        ``front``: they hold nothing worth keeping (rejected draft tokens): they are reused first,
        before any cached block is evicted.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if front and block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self._emit(AllBlocksCleared())
        return True

    def _emit(self, event: KVEvent) -> None:
        if self.record_events:
            self._events.append(event)

    def emit(self, event: KVEvent) -> None:
        """An event about another tier of this engine's KV (its host tier), published with the pool's."""
        self._emit(event)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
