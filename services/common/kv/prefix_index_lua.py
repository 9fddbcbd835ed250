"""The prefix index's Lua scripts: one write script per engine batch, one lookup per prompt (keys in prefix_index_keys.py)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.kv.prefix_index_keys import TIERS


def with_tiers(script: str, tiers: Sequence[str] = TIERS) -> str:
    """A script template with its ``@TIERS@`` table filled in (the scripts' tier order is ``tiers``')."""
    return script.replace("@TIERS@", "{" + ", ".join(f"'{t}'" for t in tiers) + "}")


# Functions every write script shares. ``unhold`` empties one forward set and takes the engine out of
# each of those blocks' holder sets (SPOP in chunks: a huge set never becomes one Lua table); ``drop``
# removes every key and set membership of an engine (deregistration and reaping).
_PRELUDE = """
local CHUNK = 1000
local TIERS = @TIERS@
local function unhold(prefix, eid, tier)
  local key = prefix .. 'blk:' .. eid .. ':' .. tier
  while true do
    local hs = redis.call('SPOP', key, CHUNK)
    if #hs == 0 then return end
    for _, h in ipairs(hs) do redis.call('SREM', prefix .. 'h:' .. tier .. ':' .. h, eid) end
  end
end
local function unroute(prefix, eid)
  local key = prefix .. 'rt:' .. eid
  for _, h in ipairs(redis.call('SMEMBERS', key)) do redis.call('ZREM', prefix .. 'rh:' .. h, eid) end
  redis.call('DEL', key)
end
local function drop(prefix, eid)
  for _, t in ipairs(TIERS) do unhold(prefix, eid, t) end
  unroute(prefix, eid)
  redis.call('DEL', prefix .. 'hb:' .. eid, prefix .. 'eng:' .. eid)
  redis.call('ZREM', prefix .. 'engines', eid)
  redis.call('ZREM', prefix .. 'engines:v2', eid)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: registry, hb, meta, blk:{tier} for each of TIERS (gpu, cpu, kvstore, disk), registry v2
# ARGV: engine_id, instance, url, seq, force(0|1), ttl_ms, reap_ms, key prefix, ops...
# Every op updates the forward set and the blocks' holder sets together; tiers are checked before any
# write, so a bad batch changes nothing. Up to REAP engines idle longer than reap_ms are dropped per call.
APPLY_TEMPLATE = (
    _PRELUDE
    + """
local REAP = 4
local fwd, REG2 = {}, KEYS[4 + #TIERS]
for c, t in ipairs(TIERS) do fwd[t] = KEYS[3 + c] end
local eid, inst, url = ARGV[1], ARGV[2], ARGV[3]
local seq, force = tonumber(ARGV[4]), ARGV[5] == '1'
local ttl, reap, prefix = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local i = 9
while i <= #ARGV do
  if not fwd[ARGV[i + 1]] then return redis.error_reply('unknown tier ' .. tostring(ARGV[i + 1])) end
  if ARGV[i] == 'C' then i = i + 2 else i = i + 3 + tonumber(ARGV[i + 2]) end
end
local status = 'ok'
if not force then
  local cur = redis.call('HMGET', KEYS[3], 'instance', 'seq')
  local step = 1
  if #ARGV == 8 then step = 0 end
  if cur[1] ~= inst or not cur[2] or tonumber(cur[2]) + step ~= seq then
    status = 'gap'
    for _, t in ipairs(TIERS) do unhold(prefix, eid, t) end
  end
end
i = 9
while i <= #ARGV do
  local op, tier = ARGV[i], ARGV[i + 1]
  if op == 'C' then
    unhold(prefix, eid, tier)
    i = i + 2
  else
    local last = i + 2 + tonumber(ARGV[i + 2])
    local cmd = 'SADD'
    if op == 'R' then cmd = 'SREM' end
    for s = i + 3, last, CHUNK do
      redis.call(cmd, fwd[tier], unpack(ARGV, s, math.min(s + CHUNK - 1, last)))
    end
    local holders = prefix .. 'h:' .. tier .. ':'
    for s = i + 3, last do redis.call(cmd, holders .. ARGV[s], eid) end
    i = last + 1
  end
end
local now = now_ms()
redis.call('HSET', KEYS[3], 'instance', inst, 'seq', seq, 'url', url, 'seen_ms', now)
redis.call('PEXPIRE', KEYS[3], reap)
redis.call('SET', KEYS[2], url, 'PX', ttl)
redis.call('ZADD', KEYS[1], now, eid)
redis.call('ZADD', REG2, now, eid)
for _, reg in ipairs({KEYS[1], REG2}) do
  for _, dead in ipairs(redis.call('ZRANGEBYSCORE', reg, '-inf', now - reap, 'LIMIT', 0, REAP)) do
    drop(prefix, dead)
  end
end
return status
"""
)

# KEYS: same as APPLY_LUA. ARGV: engine_id, instance, key prefix. Only the instance that owns the entries
# removes them (then all of them: forward sets, holder-set memberships, routed hints, registry entries).
DEREGISTER_TEMPLATE = (
    _PRELUDE
    + """
if redis.call('HGET', KEYS[3], 'instance') ~= ARGV[2] then return 0 end
drop(ARGV[3], ARGV[1])
return 1
"""
)

# KEYS: rt:{engine_id}. ARGV: key prefix, engine_id, ttl_ms, block hashes. A router's hint: the forward
# set (for deregistration, and what routers of the previous version read) and, per hash, the engine's
# expiry time in rh:{hash}; keys expire on their own, so hints never leak.
ROUTED_TEMPLATE = (
    _PRELUDE
    + """
local prefix, eid, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = now_ms()
for s = 4, #ARGV, CHUNK do redis.call('SADD', KEYS[1], unpack(ARGV, s, math.min(s + CHUNK - 1, #ARGV))) end
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
for s = 4, #ARGV do
  local key = prefix .. 'rh:' .. ARGV[s]
  redis.call('ZADD', key, now + ttl, eid)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return 1
"""
)

# KEYS: registry, registry v2. ARGV: key prefix, then the prompt's block hashes in order.
# Returns {legacy, rows}. legacy > 0: that many live engines were written by the previous index version
# (no holder sets): the answer would miss their blocks, so there are no rows and the caller refuses it.
# Otherwise one row per live engine holding at least the prompt's first block in some tier or hint:
# "engine_id\0url\0gpu\0cpu\0kvstore\0disk\0any\0routed" (TIERS' order; one string: a 1,000-row answer
# parses fast), each the length of the longest run of leading hashes
# held (as LOOKUP v1 defined them). The walk starts from the first block's holders: a prefix they all
# share costs one SINTERCARD per block, then the engines still on a run are checked block by block
# (SMISMEMBER of the candidates): its cost is the prompt's blocks times their holders, never the number
# of engines. Needs Redis >= 7.0 (SINTERCARD).
LOOKUP_TEMPLATE = """
local TIERS = @TIERS@
local NT, ANY, ROUTED = #TIERS, #TIERS + 1, #TIERS + 2
local prefix, n = ARGV[1], #ARGV - 1
if redis.call('ZCARD', KEYS[1]) ~= redis.call('ZCARD', KEYS[2]) then
  local legacy = 0
  for _, e in ipairs(redis.call('ZDIFF', 2, KEYS[1], KEYS[2])) do
    legacy = legacy + redis.call('EXISTS', prefix .. 'hb:' .. e)
  end
  if legacy > 0 then return {legacy, {}} end
end
if n == 0 then return {0, {}} end
local function among(cmd, key, members)
  if #members <= 1000 then return redis.call(cmd, key, unpack(members)) end
  local out = {}
  for s = 1, #members, 1000 do
    local part = redis.call(cmd, key, unpack(members, s, math.min(s + 999, #members)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function holders(c, s) return prefix .. 'h:' .. TIERS[c] .. ':' .. ARGV[s] end
-- Shared prefixes first, in C: while every holder of the first block also holds the next one in the same
-- tier (SINTERCARD), every run grows by one and no engine needs looking at.
local first, held, k = {}, 0, 0
for c = 1, NT do
  first[c] = redis.call('SCARD', holders(c, 2))
  held = held + first[c]
end
while held > 0 and k + 3 <= n + 1 do
  local all = true
  for c = 1, NT do
    if first[c] > 0 and redis.call('SINTERCARD', 2, holders(c, 2), holders(c, k + 3)) ~= first[c] then
      all = false
      break
    end
  end
  if not all then break end
  k = k + 1
end
local len, run, list, rlist = {}, {}, {}, {}
local function zeros(v) local z = {} for c = 1, NT do z[c] = v end return z end
for c = 1, NT do
  if first[c] > 0 then
    for _, e in ipairs(redis.call('SMEMBERS', holders(c, 2))) do
      if not len[e] then
        len[e], run[e], list[#list + 1] = zeros(0), zeros(false), e
        len[e][ANY], len[e][ROUTED] = 1 + k, 0
      end
      len[e][c], run[e][c] = 1 + k, true
    end
  end
end
-- Then engine by engine, only those still on a run.
local s = k + 3
while #list > 0 and s <= n + 1 do
  local hits, keep = {}, {}
  for c = 1, NT do
    local key = holders(c, s)
    hits[c] = redis.call('EXISTS', key) == 1 and among('SMISMEMBER', key, list)
  end
  for j, e in ipairs(list) do
    local l, r, any = len[e], run[e], false
    for c = 1, NT do
      if hits[c] and hits[c][j] == 1 then
        any = true
        if r[c] then l[c] = l[c] + 1 end
      else
        r[c] = false
      end
    end
    if any then l[ANY], keep[#keep + 1] = l[ANY] + 1, e end
  end
  list = keep
  s = s + 1
end
-- Routers' hints: unexpired entries of rh:{hash}, the same walk.
for _, e in ipairs(redis.call('ZRANGEBYSCORE', prefix .. 'rh:' .. ARGV[2], '(' .. now, '+inf')) do
  if not len[e] then len[e] = zeros(0); len[e][ANY] = 0 end
  len[e][ROUTED], rlist[#rlist + 1] = 1, e
end
s = 3
while #rlist > 0 and s <= n + 1 do
  local until_ms, keep = among('ZMSCORE', prefix .. 'rh:' .. ARGV[s], rlist), {}
  for j, e in ipairs(rlist) do
    if until_ms[j] and tonumber(until_ms[j]) > now then len[e][ROUTED], keep[#keep + 1] = len[e][ROUTED] + 1, e end
  end
  rlist = keep
  s = s + 1
end
-- Live engines only; the heartbeat key holds the url: one MGET per 1000 rows answers both.
local ids, out = {}, {}
for e in pairs(len) do ids[#ids + 1] = e end
for s0 = 1, #ids, 1000 do
  local hb = {}
  for j = s0, math.min(s0 + 999, #ids) do hb[#hb + 1] = prefix .. 'hb:' .. ids[j] end
  local urls = redis.call('MGET', unpack(hb))
  for j = 1, #hb do
    local e = ids[s0 + j - 1]
    local l = len[e]
    if urls[j] then out[#out + 1] = e .. '\0' .. urls[j] .. '\0' .. table.concat(l, '\0') end
  end
end
return {0, out}
"""

# KEYS: registry. ARGV: key prefix. Per live engine, how many blocks it holds in each tier (the pool page):
# "url\0n_gpu\0n_cpu\0n_kvstore\0n_disk" (TIERS' order). One SCARD per engine and tier: a page poll's cost.
OCCUPANCY_TEMPLATE = """
local TIERS = @TIERS@
local prefix, out = ARGV[1], {}
for _, e in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local url = redis.call('GET', prefix .. 'hb:' .. e)
  if url then
    local row = {url}
    for c, t in ipairs(TIERS) do row[c + 1] = redis.call('SCARD', prefix .. 'blk:' .. e .. ':' .. t) end
    out[#out + 1] = table.concat(row, '\0')
  end
end
return out
"""

# This version's scripts. An engine of the previous version ran APPLY_TEMPLATE with tiers gpu, cpu, kvstore
# (and three block-set KEYS): tests play one with ``with_tiers(APPLY_TEMPLATE, ("gpu", "cpu", "kvstore"))``.
APPLY_LUA = with_tiers(APPLY_TEMPLATE)
DEREGISTER_LUA = with_tiers(DEREGISTER_TEMPLATE)
ROUTED_LUA = with_tiers(ROUTED_TEMPLATE)
LOOKUP_LUA = with_tiers(LOOKUP_TEMPLATE)
OCCUPANCY_LUA = with_tiers(OCCUPANCY_TEMPLATE)
