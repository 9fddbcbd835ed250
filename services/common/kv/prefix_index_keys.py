"""Redis key schema of the prefix index and the Lua scripts that read and write it.

Every key starts with ``{ns}:`` (``ns`` = the pool's namespace, default ``kvferry``). The braces are a
Redis Cluster hash tag: all keys of one pool live in one slot, so the scripts may touch any of them.

    {ns}:engines               ZSET  member engine_id, score = its last write/heartbeat (Redis TIME, ms).
                                     Members idle longer than ``reap_ms`` are trimmed by any engine's write.
    {ns}:hb:{engine_id}        STRING  the engine's instance id, PX ``ttl_ms``. Liveness: when it expires
                                     the engine's blocks stop counting in lookups at once.
    {ns}:eng:{engine_id}       HASH  instance (random id per process start), seq (last applied batch),
                                     url (the engine's HTTP address), seen_ms. PX ``reap_ms``.
    {ns}:blk:{engine_id}:{tier}  SET  raw 32-byte block hashes (services.common.kv.hashing) the engine holds
                                     in tier gpu|cpu|kvstore. PX ``reap_ms``: a dead engine is reaped by
                                     Redis itself, every write or heartbeat pushes the expiry back.
    {ns}:rt:{engine_id}        SET  block hashes of prompts a router just sent to the engine, before
                                     its own KV events can say so (a hint, PX ``routed_ttl_ms``, written
                                     by routers): every router replica then sends the same prefix there.

Writes (APPLY_LUA) come from one publisher per engine as numbered batches; batch ``seq`` must be the
last applied seq + 1 (a heartbeat carries no events and the last seq). A new instance id, a gap, a
replay or a lost ``eng`` hash clears the engine's block sets, applies the batch anyway (the index then
under-reports, never over-reports) and answers ``gap``; the publisher then rewrites a full snapshot
with ``force`` (which skips the check). Cache salts and LoRA names isolate tenants because they are
folded into the hashes themselves; the index never sees them.

Events are flattened into ARGV as ``op tier [n h1..hn]`` with op S (stored), R (removed), C (cleared).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.kv.kv_events import Tier

TIERS: tuple[Tier, ...] = ("gpu", "cpu", "kvstore")


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

    def heartbeat(self, engine_id: str) -> str:
        return f"{self.prefix}hb:{engine_id}"

    def meta(self, engine_id: str) -> str:
        return f"{self.prefix}eng:{engine_id}"

    def blocks(self, engine_id: str, tier: str) -> str:
        return f"{self.prefix}blk:{engine_id}:{tier}"

    def routed(self, engine_id: str) -> str:
        return f"{self.prefix}rt:{engine_id}"

    def engine_keys(self, engine_id: str) -> list[str]:
        """KEYS of APPLY_LUA / DEREGISTER_LUA: registry, heartbeat, meta, then one block set per tier."""
        return [
            self.registry,
            self.heartbeat(engine_id),
            self.meta(engine_id),
            *(self.blocks(engine_id, t) for t in TIERS),
        ]


# KEYS: registry, hb, meta, blk:gpu, blk:cpu, blk:kvstore
# ARGV: engine_id, instance, url, seq, force(0|1), ttl_ms, reap_ms, ops...
APPLY_LUA = """
local CHUNK = 1000
local tiers = {gpu = KEYS[4], cpu = KEYS[5], kvstore = KEYS[6]}
local eid, inst, url = ARGV[1], ARGV[2], ARGV[3]
local seq, force = tonumber(ARGV[4]), ARGV[5] == '1'
local ttl, reap = tonumber(ARGV[6]), tonumber(ARGV[7])
local status = 'ok'
if not force then
  local cur = redis.call('HMGET', KEYS[3], 'instance', 'seq')
  local step = 1
  if #ARGV == 7 then step = 0 end
  if cur[1] ~= inst or not cur[2] or tonumber(cur[2]) + step ~= seq then
    status = 'gap'
    redis.call('DEL', KEYS[4], KEYS[5], KEYS[6])
  end
end
local i = 8
while i <= #ARGV do
  local op, key = ARGV[i], tiers[ARGV[i + 1]]
  if not key then return redis.error_reply('unknown tier ' .. ARGV[i + 1]) end
  if op == 'C' then
    redis.call('DEL', key)
    i = i + 2
  else
    local last = i + 2 + tonumber(ARGV[i + 2])
    local cmd = 'SADD'
    if op == 'R' then cmd = 'SREM' end
    for s = i + 3, last, CHUNK do
      redis.call(cmd, key, unpack(ARGV, s, math.min(s + CHUNK - 1, last)))
    end
    i = last + 1
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[3], 'instance', inst, 'seq', seq, 'url', url, 'seen_ms', now)
redis.call('SET', KEYS[2], inst, 'PX', ttl)
redis.call('ZADD', KEYS[1], now, eid)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - reap)
for k = 3, 6 do redis.call('PEXPIRE', KEYS[k], reap) end
return status
"""

# KEYS: same as APPLY_LUA. ARGV: engine_id, instance. Only the instance that owns the entries removes them.
DEREGISTER_LUA = """
if redis.call('HGET', KEYS[3], 'instance') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""

# KEYS: registry. ARGV: key prefix, then the prompt's block hashes in order.
# Returns one row per live engine: {engine_id, url, gpu, cpu, kvstore, any, routed} where each number
# is the length of the longest run of leading hashes held in that tier ("any": held in at least one of
# gpu/cpu/kvstore; "routed": the routers' hint set rt:{engine_id}).
# Membership is tested in chunks that double from 8 (a miss costs little, a long hit few calls).
LOOKUP_LUA = """
local prefix, n = ARGV[1], #ARGV - 1
local sets = {'blk:%s:gpu', 'blk:%s:cpu', 'blk:%s:kvstore', 'rt:%s'}
local out = {}
for _, eid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('EXISTS', prefix .. 'hb:' .. eid) == 1 then
    local keys, has, run, len = {}, {}, {}, {0, 0, 0, 0, 0}
    for t = 1, 4 do
      keys[t] = prefix .. string.format(sets[t], eid)
      has[t] = redis.call('EXISTS', keys[t]) == 1
      run[t] = has[t]
    end
    run[5] = has[1] or has[2] or has[3]
    local s, chunk = 2, 8
    while (run[4] or run[5]) and s <= n + 1 do
      local e = math.min(s + chunk - 1, n + 1)
      chunk = math.min(chunk * 2, 1024)
      local hits = {}
      for t = 1, 4 do
        if has[t] then hits[t] = redis.call('SMISMEMBER', keys[t], unpack(ARGV, s, e)) else hits[t] = {} end
      end
      for j = 1, e - s + 1 do
        local any = false
        for t = 1, 4 do
          local hit = hits[t][j] == 1
          if hit and t < 4 then any = true end
          if run[t] and hit then len[t] = len[t] + 1 else run[t] = false end
        end
        if run[5] and any then len[5] = len[5] + 1 else run[5] = false end
      end
      s = e + 1
    end
    out[#out + 1] = {eid, redis.call('HGET', prefix .. 'eng:' .. eid, 'url') or '', len[1], len[2], len[3], len[5],
                     len[4]}
  end
end
return out
"""
