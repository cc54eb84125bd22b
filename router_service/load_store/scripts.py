"""The Lua scripts the Redis load stores run: ``routing.load``'s semantics on Redis' clock.

Each worker's load is a hash ``kvroute:{cluster}:load:{worker}`` = ``{v, t}`` (value in ms,
decay tick; the braces are literal, a Redis Cluster hash tag: ``redis_client.key_prefix``, so
every key of a cluster's namespace is in one slot and a script may take several). Keys expire
after an hour idle; no prompt text is ever written.

Every script runs atomically on the server's clock (``TIME``), so replicas with skewed clocks
agree. The decay, the reserve and the release are written once, in ``PRELUDE``, and every
script that reserves or releases calls them, so they cannot drift apart.
"""

from __future__ import annotations

from router_service.routing.load import DECAY_FACTOR, DECAY_TICK_MS

__all__ = ["KEY_TTL_S", "PRELUDE", "READ", "RELEASE", "RESERVE", "SYNC"]

KEY_TTL_S = 3600

# The server's clock in ticks, a key's value decayed to that tick, and the two writes.
PRELUDE = f"""
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_tick = math.floor(now_ms / {DECAY_TICK_MS})
local function decayed(key)
  local v = tonumber(redis.call('HGET', key, 'v') or '0')
  local at = tonumber(redis.call('HGET', key, 't') or tostring(now_tick))
  if now_tick > at then v = v * math.pow({DECAY_FACTOR!r}, now_tick - at) end
  return v
end
local function reserve(key, inc)
  redis.call('HSET', key, 'v', tostring(decayed(key) + inc), 't', now_tick)
  redis.call('EXPIRE', key, {KEY_TTL_S})
end
local function release(key, inc, tick)
  if redis.call('EXISTS', key) == 0 then return 0 end
  local rem = inc
  if now_tick > tick then rem = rem * math.pow({DECAY_FACTOR!r}, now_tick - tick) end
  local v = decayed(key) - rem
  if v < 0 then v = 0 end
  redis.call('HSET', key, 'v', tostring(v), 't', now_tick)
  return rem
end
"""

# KEYS: the workers' keys. Returns their loads, decayed to now.
READ = (
    PRELUDE
    + """
local out = {}
for i, key in ipairs(KEYS) do out[i] = tostring(decayed(key)) end
return out
"""
)

# KEYS[1] += ARGV[1] (ms). Returns the tick it was added at.
RESERVE = (
    PRELUDE
    + """
reserve(KEYS[1], tonumber(ARGV[1]))
return now_tick
"""
)

# KEYS[1] -= ARGV[1] (ms) reserved at tick ARGV[2], decayed since. Returns what it subtracted.
RELEASE = (
    PRELUDE
    + """
return tostring(release(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])))
"""
)

# One round trip applies a batch of reservations and releases and reads every worker's load
# (``RedisMirror``). KEYS: the keys to read (ARGV[1] of them) first, then keys only written.
# ARGV[2] reservations as (key index, inc) pairs and ARGV[3] releases as (key index, inc,
# tick) triples follow. Returns the server's clock in ms, the tick the batch was applied at,
# and the loads read.
SYNC = (
    PRELUDE
    + """
local n_read, n_res, n_rel = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local i = 4
for _ = 1, n_res do
  reserve(KEYS[tonumber(ARGV[i])], tonumber(ARGV[i + 1]))
  i = i + 2
end
for _ = 1, n_rel do
  release(KEYS[tonumber(ARGV[i])], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]))
  i = i + 3
end
local out = {tostring(now_ms), now_tick}
for j = 1, n_read do out[j + 2] = tostring(decayed(KEYS[j])) end
return out
"""
)
