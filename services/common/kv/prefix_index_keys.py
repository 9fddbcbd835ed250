"""Redis key schema of the prefix index (its Lua scripts are in prefix_index_lua.py).

Every key starts with ``{ns}:`` (``ns`` = the pool's namespace, default ``kvferry``). The braces are a
Redis Cluster hash tag: all keys of one pool live in one slot, so the scripts may touch any of them.

    {ns}:engines               ZSET  member engine_id, score = its last write/heartbeat (Redis TIME, ms).
    {ns}:engines:v2            ZSET  the same for engines written by this version (schema 2: holder sets).
                                     Members idle longer than ``reap_ms`` in either are dropped (all their
                                     keys and memberships) by any engine's write, a few per write.
    {ns}:hb:{engine_id}        STRING  the engine's url, PX ``ttl_ms``. Liveness: when it expires
                                     the engine's blocks stop counting in lookups at once.
    {ns}:eng:{engine_id}       HASH  instance (random id per process start), seq (last applied batch),
                                     url (the engine's HTTP address), seen_ms. PX ``reap_ms``.
    {ns}:blk:{engine_id}:{tier}  SET  raw 32-byte block hashes (services.common.kv.hashing) the engine holds
                                     in tier gpu|cpu|kvstore|disk (the forward map: what to undo on a clear).
    {ns}:h:{tier}:{hash}       SET   engine ids holding block ``hash`` in ``tier`` (the reverse map the
                                     lookup walks). Always the exact transpose of the blk sets: every
                                     script that changes one changes the other; empty sets vanish.
    {ns}:rt:{engine_id}        SET  block hashes of prompts a router just sent to the engine, before
                                     its own KV events can say so (a hint, PX ``routed_ttl_ms``, written
                                     by routers): every router replica then sends the same prefix there.
    {ns}:rh:{hash}             ZSET  the same hints by hash: engine id, score = when its hint expires.

Writes (APPLY_LUA) come from one publisher per engine as numbered batches; batch ``seq`` must be the
last applied seq + 1 (a heartbeat carries no events and the last seq). A new instance id, a gap, a
replay or a lost ``eng`` hash clears the engine's block sets, applies the batch anyway (the index then
under-reports, never over-reports) and answers ``gap``; the publisher then rewrites a full snapshot
with ``force`` (which skips the check). Cache salts and LoRA names isolate tenants because they are
folded into the hashes themselves; the index never sees them.

Events are flattened into ARGV as ``op tier [n h1..hn]`` with op S (stored), R (removed), C (cleared).

Mixed versions: engines of the previous version write the forward sets and ``engines`` only. While any
live engine is in ``engines`` but not in ``engines:v2``, a lookup refuses to answer (the router routes
by load and logs why) rather than miss that engine's blocks. Routers of the previous version keep
working on an index written by this one (the forward sets and ``rt`` keys are unchanged); their
routed hints are not seen by routers of this version. Rolling engines back to the previous version
under routers of this version is not supported (their holder sets would go stale): roll routers back
first. The lookup needs Redis >= 7.0 (SINTERCARD).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.kv.kv_events import Tier

TIERS: tuple[Tier, ...] = ("gpu", "cpu", "kvstore", "disk")  # the Lua scripts' order (lookup rows too)


@dataclass(frozen=True, slots=True)
class IndexKeys:
    """Key names of one pool's index."""

    namespace: str = "kvferry"

    @property
    def prefix(self) -> str:
        return "{" + self.namespace + "}:"

    @property
    def registry(self) -> str:
        return self.prefix + "engines"

    @property
    def registry_v2(self) -> str:
        return self.prefix + "engines:v2"

    def heartbeat(self, engine_id: str) -> str:
        return f"{self.prefix}hb:{engine_id}"

    def meta(self, engine_id: str) -> str:
        return f"{self.prefix}eng:{engine_id}"

    def blocks(self, engine_id: str, tier: str) -> str:
        return f"{self.prefix}blk:{engine_id}:{tier}"

    def routed(self, engine_id: str) -> str:
        return f"{self.prefix}rt:{engine_id}"

    def holders(self, tier: str, block_hash: bytes) -> bytes:
        return f"{self.prefix}h:{tier}:".encode() + block_hash

    def routed_holders(self, block_hash: bytes) -> bytes:
        return f"{self.prefix}rh:".encode() + block_hash

    def lookup_keys(self) -> list[str]:
        """KEYS of LOOKUP_LUA: the registry and the registry of engines written by this version."""
        return [self.registry, self.registry_v2]

    def engine_keys(self, engine_id: str) -> list[str]:
        """KEYS of APPLY_LUA / DEREGISTER_LUA: registry, heartbeat, meta, one block set per tier, registry v2."""
        return [
            self.registry,
            self.heartbeat(engine_id),
            self.meta(engine_id),
            *(self.blocks(engine_id, t) for t in TIERS),
            self.registry_v2,
        ]
