"""KV-event ingestion: the I/O edge that keeps a KvIndex in step with the workers' caches.

    ingestor = KvEventIngestor(router.kv_index)
    ingestor.sync(workers)     # on every discovery refresh (inside the event loop): starts a source per
                               # new worker, stops and forgets vanished ones, restarts changed ones
    await ingestor.close()

Per worker, by event format (WorkerInfo.labels["kv_events_format"], else its backend; sim -> vllm):
    vllm, sglang  SUB socket on kv_events_endpoint (topic filter kv_events_topic); frames
                  [topic, seq (8 bytes BE), payload] decoded by workers.<format>.kv_events.decode_payload;
                  on start the engine's buffer is replayed from 0 (the index is rebuilt at once), and
                  gaps are replayed from kv_replay_endpoint with a DEALER: send [b"", start_seq], read
                  [b"", topic, seq, payload] until seq == -1 (router/event_stream.py decides).
    trtllm        POST {url}/kv_cache_events every poll_interval_s (drains the engine's queue: one
                  frontend per engine); event_id gaps purge the worker (no replay exists).
    no endpoint   approximate mode in the index (predicted from routing decisions), logged loudly.

Each wake-up drains every message already queued (up to `drain_max`) before yielding, so the
event loop pays one wake-up per burst, not per batch. Malformed frames and rejected events are
logged at most once per `log_interval_s` per worker (with a count) and skipped; nothing here
raises into the caller. Defaults: replay_timeout_s 2.0, poll_interval_s 0.1, expire_interval_s 5.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import struct
import time
from collections.abc import Iterable
from dataclasses import asdict

import httpx
import zmq
import zmq.asyncio

from router.event_stream import EventStream, Replay
from router.kv_index import KvIndex
from router.kv_events import KvEventBatch, KvEventDecodeError
from workers.types import WorkerInfo

__all__ = ["KvEventIngestor", "event_format"]

log = logging.getLogger("kvyard.router.events")

_CODECS = {"vllm": "workers.vllm.kv_events", "sglang": "workers.sglang.kv_events", "trtllm": "workers.trtllm.kv_events"}
_END = b"\xff" * 8
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # plain ints: no enum arithmetic per read


def event_format(info: WorkerInfo) -> str:
    """Which wire format a worker's KV events use."""
    return info.labels.get("kv_events_format") or {"sim": "vllm"}.get(info.backend, info.backend)


def _seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise KvEventDecodeError(f"sequence frame must be 8 bytes, got {len(raw)}")
    return -1 if raw == _END else struct.unpack(">Q", raw)[0]


class _Source:
    """One worker's event feed: a task that reads, decodes and hands batches to its EventStream."""

    def __init__(self, owner: KvEventIngestor, info: WorkerInfo, fmt: str) -> None:
        self.owner = owner
        self.info = info
        self.fmt = fmt
        self.codec = importlib.import_module(_CODECS[fmt])
        decode = getattr(self.codec, "decode_payload", None)  # ZMQ formats; token ids as uint32 buffers where offered
        self._decode_payload = (functools.partial(decode, packed_ids=True)
                                if decode is not None and "packed_ids" in inspect.signature(decode).parameters else decode)
        self.stream = EventStream(info.worker_id, owner.index, replayable=bool(info.kv_replay_endpoint) and fmt != "trtllm")
        self._logged_at = 0.0
        self._suppressed = 0
        self.malformed = 0  # messages skipped before decoding (bad frames) and unreadable polled events
        self.last_error: str | None = None  # the newest complaint, shown on /api/cluster
        self.task: asyncio.Task | None = None

    @staticmethod
    def key_of(info: WorkerInfo, fmt: str) -> tuple:
        """What identifies a feed: a change restarts the source and drops the worker's entries."""
        return (fmt, info.kv_events_endpoint, info.kv_replay_endpoint, info.kv_events_topic, info.url if fmt == "trtllm" else None)

    def complain(self, what: str) -> None:
        self.last_error = what
        now = time.monotonic()
        if now - self._logged_at < self.owner.log_interval_s:
            self._suppressed += 1
            return
        more = f" (+{self._suppressed} more since last report)" if self._suppressed else ""
        log.warning("worker %s: %s%s", self.info.worker_id, what, more)
        self._logged_at, self._suppressed = now, 0

    def decode(self, seq: int, payload: bytes) -> KvEventBatch | None:
        try:
            return self._decode_payload(payload, seq)
        except KvEventDecodeError as exc:  # counted by the stream as undecodable
            self.complain(f"skipped undecodable KV event batch {seq}: {exc}")
            return None

    def feed(self, seq: int, batch: KvEventBatch | None) -> Replay | None:
        rejected = self.stream.stats.rejected
        replay = self.stream.on_live(seq, batch)
        self._report(rejected)
        return replay

    def _report(self, rejected_before: int) -> None:
        if self.stream.stats.rejected != rejected_before:
            self.complain(f"rejected KV event: {self.stream.last_rejection}")

    async def run(self) -> None:
        try:
            await (self._poll() if self.fmt == "trtllm" else self._subscribe())
        except asyncio.CancelledError:
            raise
        except Exception:  # a source must never take the frontend down
            log.exception("worker %s: KV event source failed; the worker falls back to approximate routing", self.info.worker_id)
            self.owner.index.add_worker(self.info.worker_id, approximate=True, block_size=self.info.block_size)

    async def _subscribe(self) -> None:
        # A plain (synchronous) socket, read when the loop sees its file descriptor readable. ZeroMQ signals that
        # descriptor on edges, so ZMQ_EVENTS is asked before each read and before each wait. pyzmq's asyncio
        # socket does the same with a future, a zmq.Again and a handler update per wake-up and message
        # (docs/benchmarks.md, "KV events and the engine send").
        sub = zmq.Socket(self.owner.ctx, zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.info.kv_events_topic.encode())
        sub.connect(self.info.kv_events_endpoint)
        loop = asyncio.get_running_loop()
        fd = sub.getsockopt(zmq.FD)
        waiter: list[asyncio.Future | None] = [None]

        def readable() -> None:
            w = waiter[0]
            if w is not None and not w.done():
                w.set_result(None)

        loop.add_reader(fd, readable)
        try:
            if self.stream.replayable:  # rebuild from the engine's buffer now; live batches queue meanwhile
                batches = await self._replay(0)
                if batches:
                    rejected = self.stream.stats.rejected
                    self.stream.on_bootstrap(batches)
                    self._report(rejected)
            handled = 0
            while True:
                if not sub.getsockopt(_EVENTS) & _POLLIN:
                    waiter[0] = loop.create_future()
                    try:
                        await waiter[0]
                    finally:
                        waiter[0] = None
                    continue
                await self._on_frames(sub.recv_multipart(_NOBLOCK))
                handled += 1
                if handled % self.owner.drain_max == 0:
                    await asyncio.sleep(0)  # a long burst must not starve request handling
        finally:
            loop.remove_reader(fd)
            sub.close()

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.malformed += 1
            self.complain(f"skipped a KV event message of {len(frames)} frames (expected 3)")
            return
        try:
            seq = _seq(frames[1])
        except KvEventDecodeError as exc:
            self.malformed += 1
            self.complain(f"skipped a KV event message: {exc}")
            return
        batch = self.decode(seq, frames[2])
        replay = self.feed(seq, batch)
        if replay is not None:
            rejected = self.stream.stats.rejected
            self.stream.on_replay(replay, await self._replay(replay.start), batch)
            self._report(rejected)

    async def _replay(self, start: int) -> list[tuple[int, KvEventBatch | None]] | None:
        dealer = self.owner.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, KvEventBatch | None]] = []
        try:
            dealer.connect(self.info.kv_replay_endpoint)
            await dealer.send_multipart([b"", struct.pack(">Q", start)])
            while True:
                if not await dealer.poll(self.owner.replay_timeout_s * 1000):
                    self.complain(f"KV event replay from {start} timed out after {len(out)} batches")
                    return None
                frames = await dealer.recv_multipart()
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) not in (2, 3):
                    self.complain(f"skipped a replay message of {len(frames)} frames")
                    continue
                seq = _seq(body[-2])
                if seq == -1:
                    return out
                out.append((seq, self.decode(seq, body[-1])))
                if len(out) % 256 == 0:
                    await asyncio.sleep(0)  # a long replay must not starve request handling
        except (zmq.ZMQError, KvEventDecodeError) as exc:
            self.complain(f"KV event replay from {start} failed: {exc}")
            return None
        finally:
            dealer.close()

    async def _poll(self) -> None:
        codec, url = self.codec, self.info.url.rstrip("/") + self.codec.KV_EVENTS_PATH
        while True:
            try:
                resp = await self.owner.http.post(url)
                resp.raise_for_status()
                items = codec.decode_events(resp.content)
            except httpx.HTTPError as exc:
                self.complain(f"cannot poll KV events at {url}: {exc}")
                await asyncio.sleep(max(1.0, self.owner.poll_interval_s))  # the engine is down or restarting
                continue
            for item in items:
                if isinstance(item, KvEventDecodeError):
                    self.malformed += 1
                    self.complain(f"skipped an undecodable KV event: {item}")
                else:
                    self.feed(item.seq, item)
            await asyncio.sleep(self.owner.poll_interval_s)


class KvEventIngestor:
    def __init__(
        self,
        index: KvIndex,
        *,
        replay_timeout_s: float = 2.0,
        poll_interval_s: float = 0.1,
        expire_interval_s: float = 5.0,
        log_interval_s: float = 10.0,
        drain_max: int = 1024,
        http: httpx.AsyncClient | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self.poll_interval_s = poll_interval_s
        self.expire_interval_s = expire_interval_s
        self.log_interval_s = log_interval_s
        self.drain_max = drain_max
        self.ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self.http = http or httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._own_http = http is None
        self.sources: dict[str, _Source] = {}
        self._approx: set[str] = set()
        self._expirer: asyncio.Task | None = None

    def sync(self, workers: Iterable[WorkerInfo]) -> None:
        """Make the sources match `workers` (the pool's current list). Call from inside the event loop."""
        live = {w.worker_id: w for w in workers}
        for wid in [w for w in list(self.sources) + list(self._approx) if w not in live]:
            self._stop(wid)
            self.index.remove_worker(wid)
        for wid, info in live.items():
            self._start(info)
        if self._expirer is None:
            self._expirer = asyncio.get_running_loop().create_task(self._expire_loop())

    def _start(self, info: WorkerInfo) -> None:
        wid = info.worker_id
        fmt = event_format(info)
        wants_source = fmt in _CODECS and (fmt == "trtllm" or bool(info.kv_events_endpoint))
        if not wants_source:
            if wid in self.sources:
                self._stop(wid)
            if wid not in self._approx:
                if info.kv_events_endpoint:
                    log.error("worker %s: unknown KV event format %r; known: %s", wid, fmt, ", ".join(sorted(_CODECS)))
                self._approx.add(wid)
                self.index.add_worker(wid, approximate=True, block_size=info.block_size)
            return
        src = self.sources.get(wid)
        if src is not None:
            if _Source.key_of(src.info, src.fmt) == _Source.key_of(info, fmt):
                src.info = info
                return
            self._stop(wid)
            self.index.clear_worker(wid)
        self._approx.discard(wid)
        self.index.add_worker(wid, approximate=False, block_size=info.block_size)
        src = self.sources[wid] = _Source(self, info, fmt)
        src.task = asyncio.get_running_loop().create_task(src.run(), name=f"kv-events-{wid}")
        log.info("worker %s: indexing its KV events (%s, %s)", wid, fmt, info.kv_events_endpoint or info.url)

    def _stop(self, wid: str) -> None:
        self._approx.discard(wid)
        src = self.sources.pop(wid, None)
        if src is not None and src.task is not None:
            src.task.cancel()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.expire_interval_s)
            self.index.expire()

    def stats(self) -> dict[str, dict]:
        """Per worker: last sequence applied, counters (batches, events, rejected, undecodable, replays, purges, malformed...)
        and the newest problem (last_error, None while all is well)."""
        return {wid: {"format": s.fmt, "last_seq": s.stream.last, **asdict(s.stream.stats), "malformed": s.malformed,
                      "last_error": s.last_error} for wid, s in self.sources.items()}

    async def close(self) -> None:
        tasks = [s.task for s in self.sources.values() if s.task is not None]
        if self._expirer is not None:
            tasks.append(self._expirer)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.sources.clear()
        self._expirer = None
        if self._own_http:
            await self.http.aclose()
        if self._own_ctx:
            self.ctx.destroy(linger=0)
