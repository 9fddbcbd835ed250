"""KVCacheManager: maps requests to KV blocks, finds prefix-cache hits and allocates slots."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.core.block_pool import BlockPool, KVCacheBlock
from services.engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block lists on top of one BlockPool (vLLM V1's manager, single attention group).

    ``sliding_window``: every layer attends to its last ``sliding_window`` positions only, so a
    request's blocks wholly before the window of its next token are freed as it advances (they stay
    in the prefix cache until evicted) and its list holds the null block there (id -1, never read).
    A request whose KV goes to a decode engine keeps all of its blocks: they are all transferred.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.null_block = KVCacheBlock(-1)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, never covering its last token (it must be computed)."""
        if not self.enable_caching or request.needs_whole_prompt:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (tokens asked, tokens found) for the hit-rate metrics."""
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Reserve blocks so ``num_new_tokens`` more tokens fit; None (and no change) if they do not.

        ``cache=False`` defers prefix-cache registration (blocks whose KV is still being received).
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        computed = list(new_computed_blocks or ())
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        skip = self._blocks_before_window(request, request.num_computed_tokens + num_new_computed_tokens)
        self._free_before(blocks, skip)  # whatever follows: no later query of it reads them
        if skip > len(blocks):  # prefix hits no query will see: not taken at all
            n = min(skip - len(blocks), len(computed))
            computed[:n] = [self.null_block] * n
        num_new = cdiv(total, self.block_size) - len(blocks) - len(computed)
        # Touching a free cached block removes it from the free queue: it is no longer available.
        evictable_touched = sum(1 for b in computed if b.ref_cnt == 0 and b is not self.null_block)
        if num_new > self.pool.num_free_blocks - evictable_touched:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(b for b in computed if b is not self.null_block)
        blocks.extend(computed)
        new_blocks = self.pool.get_new_blocks(num_new) if num_new > 0 else []
        blocks.extend(new_blocks)
        if cache:
            self.cache_full_blocks(request, total)
        return new_blocks

    def _blocks_before_window(self, request: Request, first_new: int) -> int:
        """How many leading blocks no query from position ``first_new`` on can see (0 without a window)."""
        if self.sliding_window is None or request.keeps_kv_for_decode:
            return 0
        return max(0, first_new - self.sliding_window + 1) // self.block_size

    def _free_before(self, blocks: list[KVCacheBlock], n: int) -> None:
        """Free blocks[:n] (those still held) and put the null block in their place."""
        n = min(n, len(blocks))
        dead = [b for b in blocks[:n] if b is not self.null_block]
        if dead:
            blocks[:n] = [self.null_block] * n
            self.pool.free_blocks(dead)

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first ``num_tokens`` tokens."""
        self._cache_full(request, self.req_to_blocks.get(request.request_id, []), num_tokens)

    def _cache_full(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if end > start:
            self.pool.cache_full_blocks(
                blocks, request.block_hashes, request.all_token_ids, start, end, self.block_size
            )
            self.num_cached_blocks[request.request_id] = end

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids by position; -1 where a block before the sliding window was freed."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the tail blocks past the first ``num_tokens`` tokens (slots of rejected draft tokens).

        They are never cached (a cached block is full of verified tokens), so they go to the front of
        the free queue. Returns how many were freed.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail), front=True)
        return len(tail)

    def mark_external(self, request: Request, first_token: int, num_tokens: int) -> None:
        """Tokens first_token.. (num_tokens of them) get their KV from a connector, not from this engine."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[first_token // self.block_size : cdiv(first_token + num_tokens, self.block_size)]:
            block.external = True

    def num_local_kv_tokens(self, request: Request, num_computed: int) -> int:
        """Leading computed tokens whose blocks this engine's models wrote (no connector-written block)."""
        for i, block in enumerate(self.req_to_blocks.get(request.request_id, ())):
            if block.external:
                return min(num_computed, i * self.block_size)
        return num_computed

    def pin_cached_prefix(self, block_hashes: Sequence[bytes]) -> list[KVCacheBlock]:
        """The leading blocks of ``block_hashes`` in the prefix cache, each with a reference taken (a peer
        reads them): release them with ``unpin``."""
        blocks: list[KVCacheBlock] = []
        for h in block_hashes:
            if (block := self.pool.get_cached_block(h)) is None:
                break
            blocks.append(block)
        self.pool.touch(blocks)
        return blocks

    def unpin(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop the references ``pin_cached_prefix`` took."""
        self.pool.free_blocks(blocks)

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first so tail blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(b for b in reversed(blocks) if b is not self.null_block)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
