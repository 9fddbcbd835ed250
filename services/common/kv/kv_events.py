"""KV cache events an engine reports about its prefix-cache blocks (consumed by the prefix index)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tier = Literal["gpu", "cpu", "kvstore", "disk"]  # disk: an engine's local-disk tier behind its host tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became cached; ``block_hashes`` are consecutive, ``parent_hash`` precedes the first."""

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: Tier = "gpu"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted."""

    block_hashes: tuple[bytes, ...]
    tier: Tier = "gpu"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache of this tier was dropped."""

    tier: Tier = "gpu"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
