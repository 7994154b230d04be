"""The hung-engine, SIGSTOP and bad-registry faults of benchmarks/faults.py, and how their effect is timed.

    BlackHole      an "engine" that accepts connections and never answers, registered (and its lease kept
                   renewed, signed with the cluster's registry secret) as a worker of the benchmark's model:
                   what a wedged engine under a live worker process looks like to the frontends
    stop_engine    SIGSTOP (or SIGCONT) a worker's engine process tree; the worker process itself runs on
    plant_bad_entries  garbage over a live worker's registry entry, a signed entry with block_size 0, and an
                   unsigned (forged) entry pointing at a server of the "attacker's"
    RoutingWatch   polls every frontend (/api/cluster, /metrics) and records, per frontend, when a worker was
                   first listed, first routable, then out of routing (gone from its view, or its breaker not
                   closed), and routable again
    heal_time      how long a worker's overwritten registry entry stays unreadable (until its renewal)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import uuid

import aiohttp

from orchestrator.testing.procs import descendants
from workers.discovery import RedisDiscovery
from workers.signing import sign_entry
from workers.types import WorkerInfo

__all__ = ["BlackHole", "stop_engine", "plant_bad_entries", "heal_time", "RoutingWatch", "worker_id_at"]


class BlackHole:
    def __init__(self, redis_url: str, prefix: str, model: str, secret: str | None, lease_ttl_s: float) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)  # the kernel completes handshakes; nothing ever reads or answers
        self.worker_id = f"blackhole-{uuid.uuid4().hex[:6]}"
        self.info = WorkerInfo(worker_id=self.worker_id, model=model, backend="sim",
                               url=f"http://127.0.0.1:{self.sock.getsockname()[1]}", max_model_len=8192)
        self.discovery = RedisDiscovery(redis_url, prefix=prefix, secret=secret)
        self.ttl = lease_ttl_s
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.discovery.register(self.info, self.ttl)

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.ttl / 3)
                try:
                    await self.discovery.renew(self.worker_id, self.ttl, info=self.info)
                except Exception:  # noqa: BLE001 - Redis may be down in another fault; retry
                    pass

        self._task = asyncio.create_task(renew())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self.discovery.deregister(self.worker_id)
        except Exception:  # noqa: BLE001
            pass
        await self.discovery.close()
        self.sock.close()


def stop_engine(worker_pid: int, sig: int = signal.SIGSTOP) -> list[int]:
    """Send `sig` to every process under the worker (its engine and the engine's children)."""
    pids = descendants(worker_pid)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


async def plant_bad_entries(redis_url: str, prefix: str, model: str, secret: str | None, victim: str | None) -> dict[str, str]:
    """Write the bad registry entries; {worker id: what it is}."""
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url)
    planted = {}
    try:
        if victim:  # a live worker's entry overwritten with garbage: its next renewal must heal it
            await r.set(f"{prefix}:worker:{victim}", b"\x00garbage{", keepttl=True)
            planted[victim] = "live worker's entry overwritten with garbage"
        zero = f"zero-blocks-{uuid.uuid4().hex[:6]}"
        doc = WorkerInfo(worker_id=zero, model=model, backend="sim", url="http://127.0.0.1:9").model_dump(mode="json") | {"block_size": 0}
        await r.set(f"{prefix}:worker:{zero}", sign_entry(doc, secret.encode() if secret else None, 60), px=60_000)
        planted[zero] = "signed entry with block_size 0"
        forged = f"forged-{uuid.uuid4().hex[:6]}"
        doc = WorkerInfo(worker_id=forged, model=model, backend="sim", url="http://127.0.0.1:9").model_dump(mode="json")
        await r.set(f"{prefix}:worker:{forged}", json.dumps(doc), px=60_000)
        planted[forged] = "unsigned entry (a writer without the registry secret)"
        await r.sadd(f"{prefix}:workers", *planted)
    finally:
        await r.aclose()
    return planted


async def heal_time(redis_url: str, prefix: str, worker_id: str, timeout_s: float = 30.0) -> float | None:
    """Seconds until the entry under `worker_id` parses as JSON again (the worker rewrote it); None if it never did."""
    import redis.asyncio as aioredis

    r = aioredis.from_url(redis_url)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout_s:
            raw = await r.get(f"{prefix}:worker:{worker_id}")
            try:
                if raw is not None and isinstance(json.loads(raw), dict):
                    return round(time.monotonic() - t0, 2)
            except (ValueError, UnicodeDecodeError):
                pass
            await asyncio.sleep(0.02)
        return None
    finally:
        await r.aclose()


def worker_id_at(view: dict | None, port: int) -> str | None:
    for w in (view or {}).get("workers", []):
        if w["url"].endswith(f":{port}"):
            return w["worker_id"]
    return None


class RoutingWatch:
    """For each watched (label, worker id): per frontend, the first time it stopped being routable and the first
    time it was routable again, in seconds from when the watch began."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.watches: dict[str, dict] = {}

    def watch(self, label: str, worker_id: str) -> None:
        self.watches[label] = {"worker_id": worker_id, "t0": time.time(), "listed": {}, "routable": {}, "out": {}, "back": {}}

    async def _state(self, session: aiohttp.ClientSession, url: str, wid: str) -> str | None:
        try:
            async with session.get(url + "/api/cluster", timeout=aiohttp.ClientTimeout(total=2)) as r:
                view = await r.json()
            async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                text = await r.text()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None  # this frontend is down (another fault): no reading
        listed = any(w["worker_id"] == wid for w in view.get("workers", []))
        needle = f'kvyard_breaker_state{{worker="{wid}"}} '
        breaker = next((line.split()[-1] for line in text.splitlines() if line.startswith(needle)), "0.0")
        return "routable" if listed and float(breaker) == 0 else ("listed" if listed else "absent")

    async def poll(self, session: aiohttp.ClientSession) -> None:
        for w in self.watches.values():
            for fe, url in self.urls.items():
                state = await self._state(session, url, w["worker_id"])
                if state is None:
                    continue
                t = round(time.time() - w["t0"], 2)
                if state != "absent":
                    w["listed"].setdefault(fe, t)
                if state == "routable":
                    w["routable"].setdefault(fe, t)
                    if fe in w["out"]:
                        w["back"].setdefault(fe, t)
                elif fe in w["routable"]:
                    w["out"].setdefault(fe, t)

    def report(self) -> dict[str, dict]:
        return {label: {k: v for k, v in w.items() if k != "t0"} for label, w in self.watches.items()}
