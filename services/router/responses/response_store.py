"""ResponseStore: stored responses in Redis (shared by every router replica), per tenant, with a TTL, a
size cap, and bodies sealed with AES-GCM under a key derived from the pool's secret.

A record is one Redis string ``kvferry:responses:<tenant>:<id>``: the response object and the whole
conversation that produced it (so a ``previous_response_id`` chain is one read). The tenant is part of
the key and of the cipher's associated data: another tenant's id is simply absent, and a body copied
under another key does not decrypt. A marker ``...:<id>:seen`` outlives the body (``seen_factor`` times
the TTL) so an expired id is told apart from one that never existed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import SecretStr

PREFIX = "kvferry:responses"
_SEALED = b"g1"  # AES-256-GCM, 12-byte nonce
_PLAIN = b"p1"  # no key configured


class StoreTooLarge(ValueError):
    """A record over the store's size cap."""


class StoreUnreadable(RuntimeError):
    """A record that does not decrypt or parse (wrong key, tampered)."""


@dataclass
class MemoryKeyValue:
    """The store of a router without Redis: in this process only (a restart forgets), TTLs honoured."""

    items: dict[str, tuple[bytes, float]] = field(default_factory=dict)

    def _live(self, name: str) -> bytes | None:
        value = self.items.get(name)
        if value is None or value[1] < time.monotonic():
            self.items.pop(name, None)
            return None
        return value[0]

    async def get(self, name: str) -> bytes | None:
        return self._live(name)

    async def set(self, name: str, value: bytes, ex: int | None = None) -> bool:
        self.items[name] = (value, time.monotonic() + (ex if ex is not None else 10**9))
        return True

    async def delete(self, *names: str) -> int:
        return sum(self.items.pop(n, None) is not None for n in names)

    async def exists(self, *names: str) -> int:
        return sum(self._live(n) is not None for n in names)

    async def aclose(self) -> None:
        self.items.clear()


KeyValue = aioredis.Redis | MemoryKeyValue  # the pool's Redis, or this process's memory


def store_key(secret: SecretStr) -> bytes:
    """The 256-bit AES key derived from the pool's secret (the secret itself is never used as a key)."""
    return hashlib.sha256(b"kvferry-responses-store-v1:" + secret.get_secret_value().encode()).digest()


class ResponseStore:
    """Get, put and delete stored responses of one tenant at a time."""

    def __init__(
        self,
        kv: KeyValue,
        ttl_s: int,
        max_bytes: int,
        secret: SecretStr | None = None,
        seen_factor: int = 7,
    ) -> None:
        self.kv = kv
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._aead = AESGCM(store_key(secret)) if secret is not None else None
        self.seen_factor = seen_factor

    @staticmethod
    def _key(tenant: str, response_id: str) -> str:
        return f"{PREFIX}:{tenant}:{response_id}"

    def seal(self, key: str, record: dict[str, Any]) -> bytes:
        """The stored bytes of ``record`` (raises StoreTooLarge past the cap)."""
        plain = json.dumps(record, separators=(",", ":")).encode()
        if len(plain) > self.max_bytes:
            raise StoreTooLarge(f"{len(plain)} bytes, over the store's cap of {self.max_bytes}")
        if self._aead is None:
            return _PLAIN + plain
        nonce = os.urandom(12)
        return _SEALED + nonce + self._aead.encrypt(nonce, plain, key.encode())

    def open(self, key: str, blob: bytes) -> dict[str, Any]:
        head, body = blob[:2], blob[2:]
        try:
            if head == _SEALED and self._aead is not None:
                plain = self._aead.decrypt(body[:12], body[12:], key.encode())
            elif head == _PLAIN and self._aead is None:
                plain = body
            else:
                raise StoreUnreadable("stored with another encryption setting")
            record = json.loads(plain)
        except (InvalidTag, ValueError) as exc:
            raise StoreUnreadable(f"unreadable record ({exc.__class__.__name__})") from None
        if not isinstance(record, dict):
            raise StoreUnreadable("unreadable record (not an object)")
        return record

    def check_size(self, record: dict[str, Any]) -> None:
        """Raise StoreTooLarge when ``record`` could not be stored."""
        self.seal("size-check", record)

    async def put(self, tenant: str, response_id: str, record: dict[str, Any]) -> None:
        key = self._key(tenant, response_id)
        blob = self.seal(key, record)
        await self.kv.set(key, blob, ex=self.ttl_s)
        await self.kv.set(f"{key}:seen", b"1", ex=self.ttl_s * self.seen_factor)

    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        key = self._key(tenant, response_id)
        blob = await self.kv.get(key)
        if blob is None:
            return None
        return self.open(key, blob if isinstance(blob, bytes) else blob.encode())

    async def expired(self, tenant: str, response_id: str) -> bool:
        """Whether ``response_id`` was stored for ``tenant`` and its TTL ran out (not deleted)."""
        return bool(await self.kv.exists(f"{self._key(tenant, response_id)}:seen"))

    async def delete(self, tenant: str, response_id: str) -> bool:
        key = self._key(tenant, response_id)
        deleted = await self.kv.delete(key)
        await self.kv.delete(f"{key}:seen")  # a deleted id reads as unknown, not as expired
        return bool(deleted)
