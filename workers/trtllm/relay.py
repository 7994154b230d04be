"""The TRT-LLM KV-event relay: the one reader of trtllm-serve's drain-on-read `POST /kv_cache_events`.

A trtllm-serve engine hands each event out once, to whoever polls first, so two frontends polling it
would each see half the events. The worker process (workers/worker.py) runs this relay instead:

    every poll_interval_s: POST {engine}/kv_cache_events -> decode (workers/trtllm/kv_events.py)
        -> publish on the worker's ZMQ endpoint in vLLM's wire format, with a replay socket
           (workers/kv_publisher.py), where every frontend subscribes like to a vLLM engine

An `event_id` gap (the engine's buffer overflowed between two polls) is republished as
AllBlocksCleared before the next events, so subscribers drop what they can no longer trust (what
TRT-LLM's own in-process fan-out does). A single undecodable event is logged and skipped; an engine
whose answers stay undecodable for `max_bad_polls` polls in a row, with no event read in between, is
not speaking TRT-LLM's format at all: `run()` raises KvRelayError and the worker deregisters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from router.kv_events import AllBlocksCleared, KvEvent, KvEventDecodeError
from workers.kv_publisher import KvEventPublisher
from workers.trtllm.kv_events import KV_EVENTS_PATH, decode_events

__all__ = ["KvEventRelay", "KvRelayError", "RelaySettings"]

log = logging.getLogger("kvyard.worker.relay")


class KvRelayError(RuntimeError):
    """The engine's KV events could not be read (the message says why)."""


@dataclass
class RelaySettings:
    """The publisher side (PublisherSettings of workers/kv_publisher.py)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    hwm: int = 100_000
    buffer_steps: int = 10_000


class KvEventRelay:
    def __init__(self, engine_url: str, settings: RelaySettings, *, poll_interval_s: float = 0.1, max_bad_polls: int = 50,
                 log_interval_s: float = 10.0, http: httpx.AsyncClient | None = None) -> None:
        self.url = engine_url.rstrip("/") + KV_EVENTS_PATH
        self.publisher = KvEventPublisher(settings)
        self.poll_interval_s = poll_interval_s
        self.max_bad_polls = max_bad_polls
        self.log_interval_s = log_interval_s
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._own_http = http is None
        self.last_event_id: int | None = None
        self.events = 0  # events republished
        self.undecodable = 0  # events (or whole answers) skipped
        self.gaps = 0
        self.last_error: str | None = None
        self._bad_polls = 0
        self._logged_at = 0.0

    @property
    def endpoint(self) -> str:
        """Where subscribers connect (after start: an ephemeral port resolved)."""
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def start(self) -> None:
        """Bind the PUB and replay sockets (call from the running event loop)."""
        self.publisher.start()

    def _complain(self, what: str) -> None:
        self.last_error = what
        now = time.monotonic()
        if now - self._logged_at >= self.log_interval_s:
            log.warning("KV events of %s: %s", self.url, what)
            self._logged_at = now

    def handle(self, body: bytes) -> int:
        """One poll's answer: republish what decodes. Returns how many events were republished."""
        out: list[KvEvent] = []
        good = bad = 0
        for item in decode_events(body):
            if isinstance(item, KvEventDecodeError):
                bad += 1
                self.undecodable += 1
                self._complain(f"skipped an undecodable event: {item}")
                continue
            good += 1
            if self.last_event_id is not None and item.seq != self.last_event_id + 1:
                if item.seq <= self.last_event_id:  # the engine restarted its numbering: a new cache
                    log.info("KV events of %s: event ids restarted at %d", self.url, item.seq)
                else:
                    self.gaps += 1
                    self._complain(f"events {self.last_event_id + 1}..{item.seq - 1} were lost: cache view reset")
                out.append(AllBlocksCleared())
            self.last_event_id = item.seq
            out.extend(item.events)
        if good:
            self._bad_polls = 0
        elif bad:
            self._bad_polls += 1
            if self._bad_polls >= self.max_bad_polls:
                raise KvRelayError(f"{self.max_bad_polls} polls of {self.url} in a row returned nothing decodable "
                                   f"(last: {self.last_error}); is this a TensorRT-LLM engine?")
        if out:
            self.publisher.publish(out)
            self.events += len(out)
        return len(out)

    async def run(self) -> None:
        """Poll until cancelled; raises KvRelayError when the engine's events stay unreadable."""
        while True:
            try:
                resp = await self._http.post(self.url)
                resp.raise_for_status()
            except httpx.HTTPError as exc:  # the engine is restarting or gone: the worker notices that itself
                self._complain(f"cannot poll: {exc!r}")
                await asyncio.sleep(max(1.0, self.poll_interval_s))
                continue
            self.handle(resp.content)
            await asyncio.sleep(self.poll_interval_s)

    def stats(self) -> dict[str, object]:
        return {"events": self.events, "undecodable": self.undecodable, "gaps": self.gaps, "last_error": self.last_error}

    async def close(self) -> None:
        await self.publisher.close()
        if self._own_http:
            await self._http.aclose()
