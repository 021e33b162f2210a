"""Where the shared tier keeps things in Redis, and the Lua scripts that change
them atomically.

Every key of one tenant carries the hash tag `{t:TENANT}`, so Redis Cluster
puts a tenant's blocks, LRU order, sizes, leases and usage on one slot and a
script can change them together:

    yinian:kv:{t:A}:b:FP:HASH        a stored block (block_format.py), no TTL
    yinian:kv:{t:A}:tmp:FP:HASH:N    a put in progress, with a TTL
    yinian:kv:{t:A}:lru              zset  FP:HASH -> last use (ms)
    yinian:kv:{t:A}:size             hash  FP:HASH -> bytes
    yinian:kv:{t:A}:lease            hash  FP:HASH -> "first:until" (ms)
    yinian:kv:{t:A}:usage            bytes the tenant holds

and three keys across tenants (on slots of their own):

    yinian:kv:tenants                set of tenants with blocks
    yinian:kv:total                  bytes held by every tenant
    yinian:kv:fingerprints           hash  FP -> canonical fingerprint
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "yinian:kv"
TENANTS_KEY = f"{ROOT}:tenants"
TOTAL_KEY = f"{ROOT}:total"
FINGERPRINTS_KEY = f"{ROOT}:fingerprints"
NO_SCORE_LIMIT = 9e15  # above any millisecond timestamp
_PLAIN_TENANT = re.compile(r"[\w.@:/+=-]*")


def member(fingerprint_id: str, block_hash: int) -> str:
    return f"{fingerprint_id}:{block_hash:016x}"


def parse_member(text: bytes | str) -> tuple[str, int]:
    if isinstance(text, bytes):
        text = text.decode()
    fingerprint_id, _, block_hash = text.partition(":")
    return fingerprint_id, int(block_hash, 16)


@dataclass(frozen=True, slots=True)
class Namespace:
    """The keys of one tenant."""

    tenant: str

    @property
    def prefix(self) -> str:
        # Braces would end the hash tag early: such tenants are written in hex.
        plain = _PLAIN_TENANT.fullmatch(self.tenant)
        tag = self.tenant if plain else "~" + self.tenant.encode().hex()
        return f"{ROOT}:{{t:{tag}}}:"

    def block(self, member_: str) -> str:
        return f"{self.prefix}b:{member_}"

    def temp(self, member_: str, nonce: str) -> str:
        return f"{self.prefix}tmp:{member_}:{nonce}"

    @property
    def lru(self) -> str:
        return self.prefix + "lru"

    @property
    def size(self) -> str:
        return self.prefix + "size"

    @property
    def lease(self) -> str:
        return self.prefix + "lease"

    @property
    def usage(self) -> str:
        return self.prefix + "usage"

    @property
    def accounting(self) -> list[str]:
        """The keys the eviction scripts take, in their order."""
        return [self.lru, self.size, self.lease, self.usage]


# Functions shared by the scripts. A lease record is "first:until": `first`
# starts a lease chain, renewals extend `until` up to first + max_lease, and a
# block whose chain hit that bound gets no new lease for one lease period, so
# probes in a loop cannot keep a block unevictable (Mooncake #2187).
_PRELUDE = """
local function lease_of(lease, m)
  local rec = redis.call('HGET', lease, m)
  if not rec then return nil, nil end
  local first, untl = string.match(rec, '^(%d+):(%d+)$')
  return tonumber(first), tonumber(untl)
end

local function remove(prefix, lru, size, lease, usage, m)
  local bytes = tonumber(redis.call('HGET', size, m)) or 0
  redis.call('DEL', prefix .. 'b:' .. m)
  redis.call('ZREM', lru, m)
  redis.call('HDEL', size, m)
  redis.call('HDEL', lease, m)
  if bytes > 0 then redis.call('DECRBY', usage, bytes) end
  return bytes
end

-- Unleased blocks in LRU order (last use <= max_score) until `need` bytes are
-- freed, scanning at most `limit`; with dry == 1 only counts. -> freed, members
local function evict(prefix, lru, size, lease, usage, now, need, max_score, limit, dry)
  local freed, out, kept, scanned = 0, {}, 0, 0
  while freed < need and scanned < limit do
    local batch = redis.call('ZRANGE', lru, kept, kept + 63, 'WITHSCORES')
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      local m, score = batch[i], tonumber(batch[i + 1])
      if score > max_score then return freed, out end
      scanned = scanned + 1
      local _, untl = lease_of(lease, m)
      if untl and now < untl then
        kept = kept + 1
      elseif dry == 1 then
        freed = freed + (tonumber(redis.call('HGET', size, m)) or 0)
        kept = kept + 1
        out[#out + 1] = m
      else
        freed = freed + remove(prefix, lru, size, lease, usage, m)
        out[#out + 1] = m
      end
      if freed >= need or scanned >= limit then return freed, out end
    end
  end
  return freed, out
end
"""

# KEYS tmp, block, lru, size, lease, usage
# ARGV prefix, member, bytes, now, quota, scan limit
# -> {"stored" | "present" | "expired" | "quota", freed bytes, evicted members}
COMMIT = (
    _PRELUDE
    + """
local prefix, m = ARGV[1], ARGV[2]
local bytes, now, quota, limit = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[1])
  redis.call('ZADD', KEYS[3], 'XX', now, m)
  return {'present', 0, {}}
end
if redis.call('EXISTS', KEYS[1]) == 0 then return {'expired', 0, {}} end
local over = (tonumber(redis.call('GET', KEYS[6])) or 0) + bytes - quota
local freed, out = 0, {}
if over > 0 then
  freed = evict(prefix, KEYS[3], KEYS[4], KEYS[5], KEYS[6], now, over, 9e15, limit, 1)
  if freed < over then
    redis.call('DEL', KEYS[1])
    return {'quota', 0, {}}
  end
  freed, out = evict(prefix, KEYS[3], KEYS[4], KEYS[5], KEYS[6], now, over, 9e15, limit, 0)
end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('PERSIST', KEYS[2])
redis.call('ZADD', KEYS[3], now, m)
redis.call('HSET', KEYS[4], m, bytes)
redis.call('INCRBY', KEYS[6], bytes)
return {'stored', freed, out}
"""
)

# KEYS lru ; ARGV prefix, members... -> 1/0 per member (its value exists)
PRESENT = """
local out = {}
for i = 2, #ARGV do out[i - 1] = redis.call('EXISTS', ARGV[1] .. 'b:' .. ARGV[i]) end
return out
"""

# KEYS lru, lease ; ARGV now, lease ms, max lease ms, members...
# Marks each stored member used now and leases it (see _PRELUDE). -> leases granted
LEASE = (
    _PRELUDE
    + """
local now, lease_ms, max_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local granted = 0
for i = 4, #ARGV do
  local m = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], m) then
    redis.call('ZADD', KEYS[1], 'XX', now, m)
    local first, untl = lease_of(KEYS[2], m)
    if not first or (now >= untl and (untl < first + max_ms or now >= untl + lease_ms)) then
      first, untl = now, now + math.min(lease_ms, max_ms)
    elseif now < untl then
      untl = math.min(math.max(untl, now + lease_ms), first + max_ms)
    else
      untl = nil  -- the chain reached its bound: no lease until it cools down
    end
    if untl then
      redis.call('HSET', KEYS[2], m, string.format('%.0f:%.0f', first, untl))
      granted = granted + 1
    end
  end
end
return granted
"""
)

# KEYS lru, size, lease, usage ; ARGV prefix, now, need, max score, limit
# -> {freed bytes, evicted members}
EVICT = (
    _PRELUDE
    + """
local freed, out = evict(ARGV[1], KEYS[1], KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[2]),
  tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), 0)
return {freed, out}
"""
)

# KEYS lru, lease ; ARGV now, limit -> last use (ms) of the least recently used
# unleased block, or -1
OLDEST = (
    _PRELUDE
    + """
local now, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local offset = 0
while offset < limit do
  local batch = redis.call('ZRANGE', KEYS[1], offset, offset + 63, 'WITHSCORES')
  if #batch == 0 then return -1 end
  for i = 1, #batch, 2 do
    local _, untl = lease_of(KEYS[2], batch[i])
    if not untl or now >= untl then return tonumber(batch[i + 1]) end
  end
  offset = offset + 64
end
return -1
"""
)

# KEYS lru, size, lease, usage ; ARGV prefix, member -> bytes freed
DROP = (
    _PRELUDE
    + """
return remove(ARGV[1], KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2])
"""
)
