"""Per-key rate limits shared by every frontend of a cluster: the token buckets of ratelimit.py, kept in
Redis and charged by one atomic Lua script per request (Redis's own clock, so frontends' clocks do
not matter).

    key   <prefix>:ratelimit:<key id>   hash {rl, rlim, tl, tlim, at}: levels, limits, last update
    TTL   until both buckets would be full again, plus a minute (an idle key costs nothing)

If Redis cannot be reached (or refuses the script) the request is charged to an in-process RateLimiter instead (a warning at
most every 30 s): during an outage each frontend enforces the limit on its own, and serving goes on.
"""

from __future__ import annotations

import logging
import time

from orchestrator.security.keys import Principal
from orchestrator.security.ratelimit import Grant, RateLimiter, refusal

__all__ = ["RedisRateLimiter"]

log = logging.getLogger("kvyard.auth")

# ARGV: rpm (0: none), tpm (0: none), tokens. Returns {verdict (0 ok, 1 requests, 2 tokens), wait_s,
# requests level, tokens level} as strings (Lua numbers would be truncated to integers).
_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'rl', 'rlim', 'tl', 'tlim', 'at')
local at = tonumber(h[5]) or now
local function refill(level, old_limit, limit)
  if limit == 0 then return nil end
  level = tonumber(level)
  if level == nil then return limit end
  if tonumber(old_limit) ~= limit then level = math.min(level, limit) end
  return math.min(limit, level + math.max(0, now - at) * limit / 60.0)
end
local rl = refill(h[1], h[2], rpm)
local tl = refill(h[3], h[4], tpm)
local verdict, wait = 0, 0
if rl ~= nil and rl < 1 then
  verdict, wait = 1, (1 - rl) * 60.0 / rpm
elseif tl ~= nil and tl <= 0 then
  verdict, wait = 2, (1 - tl) * 60.0 / tpm
else
  if rl ~= nil then rl = rl - 1 end
  if tl ~= nil then tl = tl - cost end
end
redis.call('HSET', KEYS[1], 'rl', tostring(rl or 0), 'rlim', rpm, 'tl', tostring(tl or 0), 'tlim', tpm, 'at', tostring(now))
local full = 0
if rl ~= nil then full = math.max(full, (rpm - rl) * 60.0 / rpm) end
if tl ~= nil then full = math.max(full, (tpm - tl) * 60.0 / tpm) end
redis.call('PEXPIRE', KEYS[1], math.ceil((full + 60) * 1000))
return {verdict, tostring(wait), tostring(rl or 0), tostring(tl or 0)}
"""


class RedisRateLimiter:
    def __init__(self, url: str, prefix: str = "kvyard", *, client=None, timeout_s: float = 0.5,
                 fallback: RateLimiter | None = None) -> None:
        from workers.redis_conn import redis_client

        self._redis = client or redis_client(url, timeout_s)
        self._own = client is None
        self.prefix = prefix
        self.fallback = fallback or RateLimiter()
        self._script = self._redis.register_script(_ADMIT_LUA)
        self._warned_at = 0.0

    async def admit(self, p: Principal, tokens: int = 0) -> Grant:
        """Charge one request and `tokens` to the key in Redis, or raise RateLimitError (429)."""
        import redis.exceptions

        try:
            verdict, wait, rl, tl = await self._script(keys=[f"{self.prefix}:ratelimit:{p.key_id}"],
                                                       args=[p.rpm or 0, p.tpm or 0, max(0, int(tokens))])
        except (redis.exceptions.RedisError, OSError) as exc:  # down, or refusing (e.g. an ACL without a command)
            now = time.monotonic()
            if now - self._warned_at > 30:
                self._warned_at = now
                log.warning("rate limits: Redis unreachable (%s); enforcing them per frontend until it is back", exc)
            return self.fallback.admit(p, tokens)
        grant = Grant.of(p.rpm, float(rl), p.tpm, float(tl))
        verdict = int(verdict)
        if verdict:
            raise refusal(p, "requests" if verdict == 1 else "tokens", float(wait), grant)
        return grant

    async def close(self) -> None:
        if self._own:
            await self._redis.aclose()
