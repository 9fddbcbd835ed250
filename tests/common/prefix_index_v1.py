"""The prefix index as the previous version wrote and read it (per-engine scan): the reference for tests and benchmarks.

The scripts are copied verbatim from services/common/kv/prefix_index_keys.py before the holder sets
(schema 2). They read and write the same forward keys as today's index, so ``lookup_v1`` answers for an
index written by either version, and ``apply_v1`` plays an engine that has not been upgraded yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from services.common.kv.kv_events import KVEvent
from services.common.kv.prefix_index import EngineRef, IndexSettings, PrefixMatch, encode_events
from services.common.kv.prefix_index_keys import TIERS

V1_TIERS = ("gpu", "cpu", "kvstore")  # the tiers the previous versions knew (the disk tier came later)

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


def apply_v1(
    client: redis.Redis,
    settings: IndexSettings,
    engine: EngineRef,
    seq: int,
    events: Sequence[KVEvent],
    force: bool = False,
) -> str:
    """One batch written the previous version's way (forward sets only, no holder sets)."""
    k = settings.keys
    keys = [k.registry, k.heartbeat(engine.engine_id), k.meta(engine.engine_id)]
    keys += [k.blocks(engine.engine_id, t) for t in V1_TIERS]
    args = [engine.engine_id, engine.instance_id, engine.url, seq, int(force)]
    args += [int(settings.heartbeat_ttl_s * 1000), int(settings.reap_after_s * 1000), *encode_events(events)]
    status = client.evalsha(client.script_load(APPLY_LUA), len(keys), *keys, *args)
    return status.decode() if isinstance(status, bytes) else str(status)


def lookup_v1(
    client: redis.Redis, settings: IndexSettings, block_hashes: Sequence[bytes]
) -> dict[str, PrefixMatch]:
    """The previous lookup (visits every live engine); engines holding nothing of the prompt are left out."""
    rows = client.evalsha(
        client.script_load(LOOKUP_LUA), 1, settings.keys.registry, settings.keys.prefix, *block_hashes
    )
    out = {}
    for eid, url, gpu, cpu, kvstore, longest, routed in rows:
        m = PrefixMatch(
            eid.decode(), url.decode(), int(gpu), int(cpu), int(kvstore), int(longest), int(routed)
        )
        if m.longest or m.gpu or m.cpu or m.kvstore or m.routed:
            out[m.engine_id] = m
    return out


def lookup_scan(
    client: redis.Redis, settings: IndexSettings, block_hashes: Sequence[bytes]
) -> dict[str, PrefixMatch]:
    """The per-engine scan in Python over every tier of this version (the disk tier too): the forward sets
    of each live engine, the longest leading run per tier, in any tier, and of its routed hints."""
    k, out = settings.keys, {}
    for raw in client.zrange(k.registry, 0, -1):
        eid = raw.decode()
        url = client.get(k.heartbeat(eid))
        if url is None:
            continue
        held = {t: client.smembers(k.blocks(eid, t)) for t in TIERS}
        runs = {t: _run(block_hashes, held[t]) for t in TIERS}
        longest = _run(block_hashes, set().union(*held.values()))
        routed = _run(block_hashes, client.smembers(k.routed(eid)))
        if longest or routed:
            out[eid] = PrefixMatch(eid, url.decode(), longest=longest, routed=routed, **runs)
    return out


def _run(hashes: Sequence[bytes], held: set[bytes]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n
