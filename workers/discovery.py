"""Worker discovery: where workers register under a lease and frontends find them.

Protocol `Discovery` with two implementations: `InMemoryDiscovery` (the embedded default of
`kvyard up`, and unit tests) and `RedisDiscovery` (a real cluster). Both pass the same contract tests.

Redis schema (prefix defaults to "kvyard"):
    {prefix}:worker:{worker_id}   STRING  WorkerInfo as JSON, with PX = lease ttl (expires by itself)
    {prefix}:workers              SET     worker ids ever registered and not deregistered
    {prefix}:files:{model}        HASH    the model's tokenizer files (name -> zlib bytes) and "__digest",
                                          published by workers so frontends on other hosts can tokenize
    {prefix}:epoch                STRING  a random id set (NX, no expiry) by the first lister after the
                                          registry's data appeared; a new value means Redis lost its data
    {prefix}:failure:{worker_id}  STRING  WorkerFailure as JSON (PX = FAILURE_TTL_S): why a worker gave up
    {prefix}:failures             SET     worker ids with a failure report (pruned when listed)
A lease is renewed by re-setting the key's expiry; a worker whose process dies stops renewing and
its key expires, so `list_workers` stops returning it within one ttl. Stale set members are pruned
when listed.

Redis outage and restart. Every Redis error becomes `DiscoveryError`: frontends keep their last
known view (WorkerPool.refresh) and workers keep serving and retry the renewal (WorkerSupervisor),
re-registering when `renew` finds the lease gone. A Redis that comes back *empty* (restarted
without persistence, flushed, failed over) would otherwise list no workers until each has
re-registered (up to a third of its lease ttl) and make frontends drop the whole fleet. The epoch
key tells a lister this happened: for `reset_grace_s` after a new epoch, `list_workers` also
returns the workers of its last listing before the reset that have not re-registered yet.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
import zlib
from typing import Protocol, runtime_checkable

from workers.types import WorkerFailure, WorkerInfo, WorkerState

__all__ = ["FAILURE_TTL_S", "Discovery", "DiscoveryError", "InMemoryDiscovery", "RedisDiscovery", "files_digest"]

log = logging.getLogger("kvyard.discovery")

FAILURE_TTL_S = 3600.0  # how long a worker's failure report stays on /api/cluster


class DiscoveryError(RuntimeError):
    """The discovery backend could not be reached; callers keep their last known view."""


@runtime_checkable
class Discovery(Protocol):
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """Called once when an engine is healthy; the entry lives ttl_s unless renewed."""
        ...

    async def renew(self, worker_id: str, ttl_s: float) -> bool:
        """Called every few seconds by the worker; False if the lease was already gone."""
        ...

    async def set_state(self, worker_id: str, state: WorkerState) -> None:
        """Called when a worker starts draining (no new requests) and similar transitions."""
        ...

    async def deregister(self, worker_id: str) -> None:
        """Called on orderly shutdown after draining."""
        ...

    async def list_workers(self) -> list[WorkerInfo]:
        """Called by frontends on each refresh: every worker whose lease is live."""
        ...

    async def publish_files(self, model: str, files: dict[str, bytes]) -> None:
        """Called by a worker after registering: the model's tokenizer files (skipped if unchanged)."""
        ...

    async def fetch_files(self, model: str) -> dict[str, bytes]:
        """Called by a frontend that cannot read the worker's tokenizer path; {} if none published."""
        ...

    async def report_failure(self, failure: WorkerFailure, ttl_s: float = FAILURE_TTL_S) -> None:
        """Called by a worker that gives up (engine exited, never healthy, unreadable KV events), before it exits."""
        ...

    async def list_failures(self) -> list[WorkerFailure]:
        """Called by frontends on each refresh: the failures reported in the last ttl_s, newest first."""
        ...

    async def close(self) -> None: ...


def files_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


class InMemoryDiscovery:
    def __init__(self) -> None:
        self._entries: dict[str, tuple[WorkerInfo, float]] = {}
        self._files: dict[str, dict[str, bytes]] = {}
        self._failures: dict[str, tuple[WorkerFailure, float]] = {}

    async def report_failure(self, failure: WorkerFailure, ttl_s: float = FAILURE_TTL_S) -> None:
        self._failures[failure.worker_id] = (failure.model_copy(), time.monotonic() + ttl_s)

    async def list_failures(self) -> list[WorkerFailure]:
        now = time.monotonic()
        for wid in [w for w, (_, exp) in self._failures.items() if exp < now]:
            del self._failures[wid]
        return sorted((f.model_copy() for f, _ in self._failures.values()), key=lambda f: -f.at)

    async def publish_files(self, model: str, files: dict[str, bytes]) -> None:
        self._files[model] = dict(files)

    async def fetch_files(self, model: str) -> dict[str, bytes]:
        return dict(self._files.get(model, {}))

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        self._entries[info.worker_id] = (info.model_copy(), time.monotonic() + ttl_s)

    async def renew(self, worker_id: str, ttl_s: float) -> bool:
        entry = self._entries.get(worker_id)
        if entry is None or entry[1] < time.monotonic():
            return False
        self._entries[worker_id] = (entry[0], time.monotonic() + ttl_s)
        return True

    async def set_state(self, worker_id: str, state: WorkerState) -> None:
        if worker_id in self._entries:
            info, exp = self._entries[worker_id]
            self._entries[worker_id] = (info.model_copy(update={"state": state}), exp)

    async def deregister(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)

    async def list_workers(self) -> list[WorkerInfo]:
        now = time.monotonic()
        for wid in [w for w, (_, exp) in self._entries.items() if exp < now]:
            del self._entries[wid]
        return [info.model_copy() for info, _ in self._entries.values()]

    async def close(self) -> None:
        return None


class RedisDiscovery:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "kvyard", *, reset_grace_s: float = 10.0,
                 timeout_s: float = 2.0) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._prefix = prefix
        self.reset_grace_s = reset_grace_s
        self.resets = 0  # registry resets seen by list_workers (Redis restarted empty or flushed)
        self._epoch: str | None = None
        self._last_listing: dict[str, WorkerInfo] = {}
        self._remembered: dict[str, WorkerInfo] = {}  # the view before a reset, kept until _grace_until
        self._grace_until = 0.0

    def _key(self, worker_id: str) -> str:
        return f"{self._prefix}:worker:{worker_id}"

    @property
    def _set(self) -> str:
        return f"{self._prefix}:workers"

    async def _call(self, coro):
        import redis.exceptions

        try:
            return await coro
        except (redis.exceptions.RedisError, OSError) as exc:  # down, timed out, loading, read-only replica...
            raise DiscoveryError(f"redis unavailable: {exc}") from exc

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self._key(info.worker_id), info.model_dump_json(), px=int(ttl_s * 1000))
        pipe.sadd(self._set, info.worker_id)
        await self._call(pipe.execute())

    async def renew(self, worker_id: str, ttl_s: float) -> bool:
        pipe = self._redis.pipeline(transaction=True)
        pipe.pexpire(self._key(worker_id), int(ttl_s * 1000))
        pipe.sadd(self._set, worker_id)  # heals a concurrent prune by a frontend
        alive, _ = await self._call(pipe.execute())
        if not alive:
            await self._call(self._redis.srem(self._set, worker_id))
        return bool(alive)

    async def set_state(self, worker_id: str, state: WorkerState) -> None:
        raw = await self._call(self._redis.get(self._key(worker_id)))
        if raw is None:
            return
        info = WorkerInfo.model_validate_json(raw).model_copy(update={"state": state})
        await self._call(self._redis.set(self._key(worker_id), info.model_dump_json(), keepttl=True))

    async def deregister(self, worker_id: str) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._key(worker_id))
        pipe.srem(self._set, worker_id)
        await self._call(pipe.execute())

    def _observe_epoch(self, epoch: str) -> None:
        if self._epoch is not None and epoch != self._epoch:
            self.resets += 1
            self._remembered = dict(self._last_listing)
            self._grace_until = time.monotonic() + self.reset_grace_s
            log.warning("registry was reset (Redis restarted empty or flushed): keeping the %d last known workers "
                        "for %.0f s while they re-register", len(self._remembered), self.reset_grace_s)
        self._epoch = epoch

    async def list_workers(self) -> list[WorkerInfo]:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(f"{self._prefix}:epoch", uuid.uuid4().hex, nx=True)
        pipe.get(f"{self._prefix}:epoch")
        pipe.smembers(self._set)
        _, epoch, members = await self._call(pipe.execute())
        self._observe_epoch(epoch.decode() if isinstance(epoch, bytes) else str(epoch))
        out = await self._live(sorted(m.decode() if isinstance(m, bytes) else m for m in members))
        if self._remembered:
            if time.monotonic() < self._grace_until:
                listed = {w.worker_id for w in out}
                out += [w for wid, w in sorted(self._remembered.items()) if wid not in listed]
            else:
                self._remembered = {}
        self._last_listing = {w.worker_id: w for w in out}
        return out

    async def _live(self, ids: list[str]) -> list[WorkerInfo]:
        if not ids:
            return []
        raws = await self._call(self._redis.mget([self._key(w) for w in ids]))
        out: list[WorkerInfo] = []
        gone: list[str] = []
        for wid, raw in zip(ids, raws):
            if raw is None:
                gone.append(wid)
                continue
            try:
                out.append(WorkerInfo.model_validate_json(raw))
            except ValueError:
                gone.append(wid)  # unreadable entry: treat as absent
        if gone:
            await self._call(self._redis.srem(self._set, *gone))
        return out

    async def publish_files(self, model: str, files: dict[str, bytes]) -> None:
        key = f"{self._prefix}:files:{model}"
        digest = files_digest(files)
        current = await self._call(self._redis.hget(key, "__digest"))
        if current is not None and current.decode() == digest:
            return
        mapping = {name: zlib.compress(data, 6) for name, data in files.items()}
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping={**mapping, "__digest": digest})
        await self._call(pipe.execute())

    async def fetch_files(self, model: str) -> dict[str, bytes]:
        raw = await self._call(self._redis.hgetall(f"{self._prefix}:files:{model}"))
        out: dict[str, bytes] = {}
        for name, data in raw.items():
            name = name.decode()
            if name == "__digest":
                continue
            try:
                out[name] = zlib.decompress(data)
            except zlib.error:
                return {}  # a damaged upload: behave as if none were published
        return out

    async def report_failure(self, failure: WorkerFailure, ttl_s: float = FAILURE_TTL_S) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(f"{self._prefix}:failure:{failure.worker_id}", failure.model_dump_json(), px=int(ttl_s * 1000))
        pipe.sadd(f"{self._prefix}:failures", failure.worker_id)
        await self._call(pipe.execute())

    async def list_failures(self) -> list[WorkerFailure]:
        ids = sorted(m.decode() if isinstance(m, bytes) else m for m in await self._call(self._redis.smembers(f"{self._prefix}:failures")))
        if not ids:
            return []
        raws = await self._call(self._redis.mget([f"{self._prefix}:failure:{w}" for w in ids]))
        out, gone = [], []
        for wid, raw in zip(ids, raws):
            try:
                out.append(WorkerFailure.model_validate_json(raw)) if raw is not None else gone.append(wid)
            except ValueError:
                gone.append(wid)
        if gone:
            await self._call(self._redis.srem(f"{self._prefix}:failures", *gone))
        return sorted(out, key=lambda f: -f.at)

    async def close(self) -> None:
        await self._redis.aclose()
