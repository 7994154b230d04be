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
A lease is renewed by rewriting the whole entry with a fresh expiry (`renew(..., info=)`): an entry
damaged or overwritten in Redis heals at the next renewal. A worker whose process dies stops renewing
and its key expires, so `list_workers` stops returning it within one ttl. Members whose key is gone
are pruned when listed.

Entries are not trusted: each is validated as it is read (WorkerInfo's types, ranges, URL schemes, and
its key matching its worker id) and, with a `secret` (workers/signing.py), its HMAC signature. A bad one
is skipped with one log line (again only once it changes) and left in the set, so its worker's next
renewal brings it back.

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

from workers.redis_conn import redis_client
from workers.signing import EntryRejected, digest_signed, sign_digest, sign_entry, verify_entry
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

    async def renew(self, worker_id: str, ttl_s: float, info: WorkerInfo | None = None) -> bool:
        """Called every few seconds by the worker; False if the lease was already gone. With `info`, the entry
        is rewritten from it (a damaged or overwritten entry heals) and re-created if it had lapsed."""
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

    async def renew(self, worker_id: str, ttl_s: float, info: WorkerInfo | None = None) -> bool:
        entry = self._entries.get(worker_id)
        alive = entry is not None and entry[1] >= time.monotonic()
        if info is not None:
            self._entries[worker_id] = (info.model_copy(), time.monotonic() + ttl_s)
        elif alive:
            self._entries[worker_id] = (entry[0], time.monotonic() + ttl_s)
        return alive

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
                 timeout_s: float = 2.0, secret: str | bytes | None = None) -> None:
        self._redis = redis_client(url, timeout_s)
        self._prefix = prefix
        self._secret = (secret.encode() if isinstance(secret, str) else secret) or None  # registry_secret: sign and verify
        self._rejected: dict[str, str] = {}  # worker id -> why its entry was last skipped (logged once per change)
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

    def _encode(self, info: WorkerInfo, valid_s: float) -> str:
        return sign_entry(info.model_dump(mode="json"), self._secret, valid_s)

    def _decode(self, worker_id: str, raw: bytes) -> WorkerInfo:
        """The entry stored under `worker_id`'s key; EntryRejected (with the reason) when it must be skipped."""
        doc = verify_entry(raw, self._secret)
        try:
            info = WorkerInfo.model_validate(doc)
        except ValueError as exc:  # pydantic's ValidationError
            err = exc.errors()[0] if hasattr(exc, "errors") else {}
            where = ".".join(str(p) for p in err.get("loc", ())) or "entry"
            raise EntryRejected(f"invalid {where}: {err.get('msg', exc)}") from None
        if info.worker_id != worker_id:
            raise EntryRejected(f"stored under worker id {worker_id!r} but names {info.worker_id!r}")
        if not info.url.startswith(("http://", "https://")):
            raise EntryRejected(f"invalid url: an engine in the registry is reached over http(s), not {info.url[:100]!r}")
        return info

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self._key(info.worker_id), self._encode(info, ttl_s), px=int(ttl_s * 1000))
        pipe.sadd(self._set, info.worker_id)
        await self._call(pipe.execute())

    async def renew(self, worker_id: str, ttl_s: float, info: WorkerInfo | None = None) -> bool:
        pipe = self._redis.pipeline(transaction=True)
        if info is None:
            pipe.pexpire(self._key(worker_id), int(ttl_s * 1000))
        else:  # rewrite: whatever the key holds now (damaged, overwritten) is replaced by the worker's own entry
            pipe.exists(self._key(worker_id))
            pipe.set(self._key(worker_id), self._encode(info, ttl_s), px=int(ttl_s * 1000))
        pipe.sadd(self._set, worker_id)  # heals a concurrent prune by a frontend
        alive = (await self._call(pipe.execute()))[0]
        if not alive and info is None:
            await self._call(self._redis.srem(self._set, worker_id))
        return bool(alive)

    async def set_state(self, worker_id: str, state: WorkerState) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.get(self._key(worker_id))
        pipe.pttl(self._key(worker_id))
        raw, pttl = await self._call(pipe.execute())
        if raw is None:
            return
        try:
            info = self._decode(worker_id, raw).model_copy(update={"state": state})
        except EntryRejected as exc:
            log.warning("cannot change the state of %s: its registry entry is unusable (%s)", worker_id, exc)
            return
        valid_s = max(pttl, 0) / 1000 if isinstance(pttl, int) else 0.0
        await self._call(self._redis.set(self._key(worker_id), self._encode(info, valid_s), keepttl=True))

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
                out.append(self._decode(wid, raw))
            except EntryRejected as exc:  # skipped, not pruned: the worker's next renewal rewrites it
                if self._rejected.get(wid) != str(exc):
                    self._rejected[wid] = str(exc)
                    log.warning("registry entry of worker %r skipped: %s", wid[:200], exc)
                continue
            if self._rejected.pop(wid, None) is not None:
                log.info("registry entry of worker %s is usable again", wid)
        if gone:
            await self._call(self._redis.srem(self._set, *gone))
            for wid in gone:
                self._rejected.pop(wid, None)
        return out

    async def publish_files(self, model: str, files: dict[str, bytes]) -> None:
        key = f"{self._prefix}:files:{model}"
        digest = files_digest(files)
        current = await self._call(self._redis.hget(key, "__digest"))
        if current is not None and current.decode() == digest:
            return
        mapping = {name: zlib.compress(data, 6) for name, data in files.items()}
        signed = {"__sig": sig} if (sig := sign_digest(digest, self._secret)) else {}
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping={**mapping, "__digest": digest, **signed})
        await self._call(pipe.execute())

    async def fetch_files(self, model: str) -> dict[str, bytes]:
        raw = await self._call(self._redis.hgetall(f"{self._prefix}:files:{model}"))
        out: dict[str, bytes] = {}
        for name, data in raw.items():
            name = name.decode("utf-8", "replace")
            if name in ("__digest", "__sig"):
                continue
            try:
                out[name] = zlib.decompress(data)
            except zlib.error:
                return {}  # a damaged upload: behave as if none were published
        if self._secret and out and not digest_signed(files_digest(out), raw.get(b"__sig"), self._secret):
            log.warning("tokenizer files of %r in the registry are not signed with this cluster's secret: ignored", model[:200])
            return {}
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
