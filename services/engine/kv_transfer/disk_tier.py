"""DiskKVTier: an engine's local-disk KV tier: one checksummed file per block, LRU within a byte budget,
kept across restarts (a file whose header or checksum does not hold is never served: it is dropped).

A block file is ``MAGIC | compat digest (32) | block hash length (2) | block hash | SHA-256 of the
payload (32) | payload``, written to a temporary name and renamed, so a crash leaves no half-written
block under a real name. The compat digest names the KV layout (model, dtype, block shape): an engine
never reads another layout's blocks. Reads and writes run on the caller's worker thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from services.engine.kv_transfer.tier_log import TierLog

log = logging.getLogger(__name__)

MAGIC = b"KVFB1\n"


class DiskKVTier:
    """Block payloads by block hash under ``root``, at most ``budget`` bytes of files."""

    def __init__(self, root: str | Path, budget: int, layout: str, block_bytes: int) -> None:
        if budget < block_bytes:
            raise ValueError(f"kv_offload_disk_bytes={budget}: below one KV block ({block_bytes} bytes)")
        self.root, self.budget, self.block_bytes = Path(root), budget, block_bytes
        self.layout = hashlib.sha256(layout.encode()).digest()
        self.root.mkdir(parents=True, exist_ok=True)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self.used = 0
        self.corrupt = self.evicted = 0
        self._lock = threading.Lock()
        self.log = TierLog("disk")  # what the tier holds, as it changes (the KV events of tier "disk")
        self._scan()
        self.log.stored(list(self.index))  # a restart re-announces the blocks kept (after the trim)

    def _path(self, block_hash: bytes) -> Path:
        return self.root / f"{block_hash.hex()}.kvb"

    def _scan(self) -> None:
        """Index the block files a previous run left (oldest first); checked when read, not now."""
        files = sorted(self.root.glob("*.kvb"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                self.index[bytes.fromhex(path.stem)] = path.stat().st_size
            except ValueError:
                continue
            self.used += self.index[bytes.fromhex(path.stem)]
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        if self.index:
            log.info("disk KV tier: %d blocks kept from a previous run in %s", len(self.index), self.root)
        self._trim()

    def has(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self.index

    def leading(self, hashes: list[bytes]) -> int:
        """How many of the leading ``hashes`` the tier holds (stops at the first miss)."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self.index:
                    break
                self.index.move_to_end(h)
                n += 1
            return n

    def write(self, block_hash: bytes, payload: bytes) -> None:
        """Store one block (a block already held is left as it is)."""
        if self.has(block_hash):
            return
        data = b"".join(
            [MAGIC, self.layout, len(block_hash).to_bytes(2, "little"), block_hash,
             hashlib.sha256(payload).digest(), payload]
        )  # fmt: skip
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        with self._lock:
            self.index[block_hash] = len(data)
            self.used += len(data)
        self.log.stored((block_hash,))
        self._trim()

    def read(self, block_hash: bytes) -> bytes | None:
        """One block's payload, or None (missing, truncated, another layout, or a bad checksum: dropped)."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            self._drop(block_hash, path)
            return None
        head = len(MAGIC) + 32 + 2
        if (
            len(data) < head
            or not data.startswith(MAGIC)
            or data[len(MAGIC) : len(MAGIC) + 32] != self.layout
        ):
            self._corrupt(block_hash, path, "header")
            return None
        n = int.from_bytes(data[head - 2 : head], "little")
        stored_hash, digest = data[head : head + n], data[head + n : head + n + 32]
        payload = data[head + n + 32 :]
        if stored_hash != block_hash or len(payload) != self.block_bytes:
            self._corrupt(block_hash, path, "length")
            return None
        if hashlib.sha256(payload).digest() != digest:
            self._corrupt(block_hash, path, "checksum")
            return None
        return payload

    def _corrupt(self, block_hash: bytes, path: Path, what: str) -> None:
        log.warning("disk KV tier: %s fails its %s check; dropped, never served", path.name, what)
        self.corrupt += 1
        self._drop(block_hash, path)

    def _drop(self, block_hash: bytes, path: Path) -> None:
        with self._lock:
            self.used -= self.index.pop(block_hash, 0)
        path.unlink(missing_ok=True)
        self.log.removed((block_hash,))

    def _trim(self) -> None:
        """Least recently used files removed until the tier fits its budget."""
        while True:
            with self._lock:
                if self.used <= self.budget or not self.index:
                    return
                victim, size = self.index.popitem(last=False)
                self.used -= size
                self.evicted += 1
            self._path(victim).unlink(missing_ok=True)
            self.log.removed((victim,))
