"""BlockBytes: whole KV blocks as bytes in one canonical layout, from one KV cache or from every
tensor-parallel rank's shard, so that a block's bytes mean the same to every engine of the model.

The canonical layout is the unsharded one: ``[layers, 2, block_size, kv_heads, head_dim]``. Under tensor
parallelism rank r holds its KV heads (one replicated head when there are fewer heads than ranks); a
block's bytes are its ranks' shards joined along the head axis (a replicated head taken once), and a
block written back is cut the same way, so a TP=2 engine's blocks read back on TP=1 or TP=2 alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from services.engine.kv_transfer.rank_transfer import RankTransferClient


class BlockBytes(Protocol):
    """Reads and writes whole blocks as canonical bytes (engine thread)."""

    def read(self, block_ids: Sequence[int]) -> list[bytes]: ...

    def write(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None: ...


class LocalBlocks:
    """The blocks of one unsharded KV cache."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self._bytes = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        return [self._bytes[b].numpy().tobytes() for b in block_ids]

    def write(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        for b, data in zip(block_ids, payloads, strict=True):
            self._bytes[b].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


class ShardedBlocks:
    """Rank 0's KV shard and the workers' (over their rank pipes); ``heads``: each rank's (first KV head,
    count), rank order."""

    def __init__(
        self, kv_cache: torch.Tensor, ranks: Sequence[RankTransferClient], heads: Sequence[tuple[int, int]]
    ) -> None:
        self.local, self.ranks, self.heads = kv_cache, list(ranks), list(heads)
        # each distinct head range once, from the first rank that holds it (replicated heads), in head order
        self.owners = sorted({first: r for r, (first, _) in reversed(list(enumerate(self.heads)))}.items())

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        ids = list(block_ids)
        shards = [self.local[ids]] + [
            _tensor(r.call("block_bytes", ids), self.local) for r in self.ranks
        ]  # each [n, layers, 2, block_size, heads_r, head_dim]
        whole = torch.cat([shards[r] for _, r in self.owners], dim=4)
        return [whole[i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(len(ids))]

    def write(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        ids = list(block_ids)
        shape = (len(ids), *self.local.shape[1:4], -1, self.local.shape[5])
        whole = (
            torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
            .view(self.local.dtype)
            .view(shape)
        )
        for r, (first, count) in enumerate(self.heads):
            part = whole[:, :, :, :, first : first + count].contiguous()
            if r == 0:
                self.local[ids] = part
            else:
                self.ranks[r - 1].call("write_blocks", ids, part.view(torch.uint8).numpy().tobytes())


def _tensor(data: bytes, like: torch.Tensor) -> torch.Tensor:
    """A worker's shard of some blocks, shaped as rank 0's (every rank holds as many heads)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(like.dtype).view(-1, *like.shape[1:])
