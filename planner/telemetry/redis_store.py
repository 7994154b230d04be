"""RedisTelemetryStore: the TelemetryStore on Redis (redis.asyncio), batched and pipelined.

One `write` is one non-transactional pipeline: per bucket delta, HINCRBY / HINCRBYFLOAT of its
non-zero fields plus EXPIRE retention_s; ZADD of the pool index; per worker sample, a HSET of the
whole hash with EXPIRE worker_ttl_s plus ZADD of the worker index. Reads are one pipeline of
HGETALLs. Key schema: schema.py. Connection errors become TelemetryUnavailableError.
"""

from __future__ import annotations

import json
import logging
import time

from planner.telemetry.schema import PoolBucket, PoolKey, TelemetryBatch, TelemetryParseError, TelemetrySchema, WorkerSample, parse_bucket
from planner.telemetry.store import TelemetryUnavailableError

__all__ = ["RedisTelemetryStore"]

log = logging.getLogger("kvyard.telemetry")

_INT_FIELDS = {"a", "n", "err", "gn"}


def _s(raw: object) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)  # junk: a malformed id, skipped


class RedisTelemetryStore:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", schema: TelemetrySchema | None = None, *,
                 client=None, timeout_s: float = 2.0) -> None:
        from workers.redis_conn import redis_client

        self.schema = schema or TelemetrySchema()
        self._redis = client or redis_client(url, timeout_s)

    async def _run(self, coro):
        import redis.exceptions

        try:
            return await coro
        except (redis.exceptions.RedisError, OSError) as exc:  # down, timed out, loading, read-only replica, OOM...
            raise TelemetryUnavailableError(f"redis unavailable: {exc}") from exc

    async def write(self, batch: TelemetryBatch) -> None:
        if batch.is_empty():
            return
        s = self.schema
        now = time.time()
        pipe = self._redis.pipeline(transaction=False)
        last_write: dict[str, float] = {}
        for (pool, start), b in batch.buckets.items():
            key = s.bucket_key(pool, start)
            for f, v in b.to_fields().items():
                if f in _INT_FIELDS or f[:2] in ("t:", "i:"):
                    pipe.hincrby(key, f, int(v))
                else:
                    pipe.hincrbyfloat(key, f, float(v))
            pipe.expire(key, s.retention_s)
            last_write[pool.id] = max(last_write.get(pool.id, 0.0), start)
        if last_write:
            pipe.zadd(s.pools_key, last_write)
            pipe.zremrangebyscore(s.pools_key, "-inf", now - s.retention_s)
        for w in batch.workers:
            key = s.worker_key(w.worker_id)
            pipe.delete(key)
            pipe.hset(key, mapping=w.to_fields())
            pipe.expire(key, s.worker_ttl_s)
            pipe.zadd(s.workers_key, {w.worker_id: w.at})
        if batch.workers:
            pipe.zremrangebyscore(s.workers_key, "-inf", now - s.worker_ttl_s)
        await self._run(pipe.execute())

    async def read_pool_buckets(self, since: float, until: float) -> dict[PoolKey, list[PoolBucket]]:
        s = self.schema
        since = max(since, until - s.retention_s, time.time() - s.retention_s)  # nothing older is kept
        ids = await self._run(self._redis.zrangebyscore(s.pools_key, s.bucket_start(since), "+inf"))
        pools: list[PoolKey] = []
        for raw in ids:
            try:
                pools.append(PoolKey.from_id(_s(raw)))
            except TelemetryParseError as exc:
                log.warning("skipping malformed telemetry pool id: %s", exc)
        pools.sort()
        first = s.bucket_start(since)
        if first < since:
            first += s.bucket_s
        starts = []
        t = first
        while t < until:
            starts.append(t)
            t += s.bucket_s
        if not pools or not starts:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for pool in pools:
            for start in starts:
                pipe.hgetall(s.bucket_key(pool, start))
        raws = await self._run(pipe.execute())
        out: dict[PoolKey, list[PoolBucket]] = {}
        k = 0
        for pool in pools:
            for start in starts:
                raw = raws[k]
                k += 1
                if not raw:
                    continue
                b = parse_bucket(start, raw, where=s.bucket_key(pool, start))
                if b is not None:
                    out.setdefault(pool, []).append(b)
        return out

    async def read_workers(self, now: float | None = None) -> list[WorkerSample]:
        s = self.schema
        now = time.time() if now is None else now
        ids = [_s(i) for i in await self._run(self._redis.zrangebyscore(s.workers_key, now - s.worker_ttl_s, "+inf"))]
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for wid in ids:
            pipe.hgetall(s.worker_key(wid))
        out = []
        for wid, raw in zip(ids, await self._run(pipe.execute())):
            if not raw:
                continue
            try:
                sample = WorkerSample.from_fields(wid, raw)
            except TelemetryParseError as exc:
                log.warning("skipping malformed worker telemetry: %s", exc)
                continue
            if sample.at >= now - s.worker_ttl_s:
                out.append(sample)
        return sorted(out, key=lambda w: w.worker_id)

    async def append_decision(self, record: dict) -> None:
        s = self.schema
        pipe = self._redis.pipeline(transaction=False)
        pipe.lpush(s.decisions_key, json.dumps(record, default=str))
        pipe.ltrim(s.decisions_key, 0, s.decisions_cap - 1)
        await self._run(pipe.execute())

    async def recent_decisions(self, limit: int = 100) -> list[dict]:
        raws = await self._run(self._redis.lrange(self.schema.decisions_key, 0, max(limit, 1) - 1))
        out = []
        for raw in raws:
            try:
                rec = json.loads(raw)
                if isinstance(rec, dict):
                    out.append(rec)
                    continue
            except ValueError:
                pass
            log.warning("skipping malformed planner decision record %r", raw[:80])
        return out

    async def close(self) -> None:
        await self._redis.aclose()
