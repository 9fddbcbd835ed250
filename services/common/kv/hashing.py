"""Chained SHA-256 block hashes: the one definition of a KV block's identity (router, engines, kvstore).

h_i = sha256(h_{i-1} || tokens_i || extra_keys_i), canonical little-endian encoding.
h_{-1} is derived from the model id, block size and HASH_VERSION, so two engines that disagree on
any of them never produce matching hashes. Extra keys: the LoRA adapter name on every block, an
image's content hash on the blocks its tokens touch, the request's ``cache_salt`` on the first block
only (each propagates through the chain to every later block). Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict

HASH_VERSION = 1
POOL_HASH_VERSION_ENV = "KVFERRY_HASH_VERSION"  # the pool's version (its ConfigMap), set on every pod


def check_pool_hash_version(environ: Mapping[str, str]) -> None:
    """ValueError when the pool says its blocks are hashed with another version than this build's: its pods
    would never share a prefix (a pool mixing images of two versions must not start silently)."""
    given = environ.get(POOL_HASH_VERSION_ENV)
    if given is not None and given.strip() != str(HASH_VERSION):
        raise ValueError(
            f"${POOL_HASH_VERSION_ENV}={given!r} (the pool's ConfigMap) but this kvferry hashes blocks with "
            f"version {HASH_VERSION}: run the pool's image version on every pod"
        )


def _encode_str(tag: bytes, value: str) -> bytes:
    data = value.encode("utf-8")
    return tag + struct.pack("<I", len(data)) + data


class MMSpan(BaseModel):
    """The prompt positions [start, end) one image's tokens occupy, and its content hash (of its pixels)."""

    model_config = ConfigDict(frozen=True)

    start: int
    end: int
    content_hash: str


class BlockHashExtras(BaseModel):
    """Per-request inputs to the hash besides the tokens."""

    model_config = ConfigDict(frozen=True)

    lora_name: str | None = None
    cache_salt: str | None = None
    mm_spans: tuple[MMSpan, ...] = ()  # an image's hash goes into the blocks its tokens touch

    def encode(self, block_index: int, block_size: int) -> bytes:
        out = b""
        if self.lora_name:
            out += _encode_str(b"L", self.lora_name)
        lo, hi = block_index * block_size, (block_index + 1) * block_size
        for mm in self.mm_spans:
            if mm.start < hi and mm.end > lo:
                out += _encode_str(b"M", mm.content_hash)
        if self.cache_salt and block_index == 0:
            out += _encode_str(b"S", self.cache_salt)
        return out


class BlockHasher:
    """Computes the chained block hashes of token sequences for one (model, block size, version)."""

    def __init__(self, model_id: str, block_size: int, hash_version: int = HASH_VERSION) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model_id = model_id
        self.block_size = block_size
        self.hash_version = hash_version
        seed = _encode_str(b"V", str(hash_version)) + _encode_str(b"B", str(block_size))
        self.root = hashlib.sha256(seed + _encode_str(b"N", model_id)).digest()

    def hash_block(self, parent: bytes, tokens: Sequence[int], extras: bytes = b"") -> bytes:
        """Hash one full block given its parent's hash."""
        if len(tokens) != self.block_size:
            raise ValueError(
                f"only full blocks are hashed: got {len(tokens)} tokens, block_size={self.block_size}"
            )
        payload = parent + b"T" + struct.pack(f"<{len(tokens)}I", *tokens) + b"E" + extras
        return hashlib.sha256(payload).digest()

    def extend(
        self, hashes: list[bytes], token_ids: Sequence[int], extras: BlockHashExtras | None = None
    ) -> list[bytes]:
        """Append the hashes of every newly full block of ``token_ids`` to ``hashes`` (in place)."""
        extras = extras or BlockHashExtras()
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[i - 1] if i else self.root
            hashes.append(self.hash_block(parent, token_ids[i * bs : (i + 1) * bs], extras.encode(i, bs)))
        return hashes

    def hash_tokens(self, token_ids: Sequence[int], extras: BlockHashExtras | None = None) -> list[bytes]:
        """Hashes of all full blocks of ``token_ids``."""
        return self.extend([], token_ids, extras)
