"""Relay an engine's SSE stream to the client, event by event, measuring as it goes.

The frontend always asks the engine for `stream_options.include_usage` so it learns exact token
counts; the usage-only chunk (`"choices":[]`) is passed on only if the client asked for it.
Events are split on the blank line that ends each SSE event; everything else is forwarded as the
engine wrote it (no re-encoding on the token path).

`stats.done` records whether the engine finished the stream with `data: [DONE]`: a stream that ends
without it is broken (the engine died), and an unterminated trailing event is never forwarded.
For mid-stream migration (orchestrator/resilience/migration.py) the relay also hands each content
event to `on_content` (before any `transform`), and a continuation stream is relayed with
`transform` rewriting its chunks and `forward_done=False` (the service ends the stream itself).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SseRelay", "StreamStats", "sse_error_event"]

_DONE = b"data: [DONE]"


@dataclass(slots=True)
class StreamStats:
    first_token_at: float | None = None
    last_token_at: float | None = None
    content_events: int = 0
    usage: dict | None = None
    gaps: list[float] | None = None
    done: bool = False


def _is_usage_event(ev: bytes) -> bool:
    return b'"usage"' in ev and (b'"choices":[]' in ev or b'"choices": []' in ev)


def sse_error_event(message: str, code: int = 503) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n" + _DONE + b"\n\n"


class SseRelay:
    """The relay's per-chunk step: `feed(chunk)` takes the engine's next bytes and returns what the client gets now
    (complete events only; b"" when nothing is complete yet). Called for every streamed token, from an awaited read
    or straight from the engine socket's read callback (`EngineResponse.stream_into`; orchestrator/service.py). A
    trailing event without its blank line stays buffered: if the stream ends there it is dropped (the engine died
    writing it)."""

    __slots__ = ("buf", "stats", "forward_usage", "on_first_token", "on_gap", "on_content", "transform", "forward_done")

    def __init__(self, stats: StreamStats, forward_usage: bool, on_first_token: Callable[[], None],
                 on_gap: Callable[[float], None], on_content: Callable[[bytes], None] | None = None,
                 transform: Callable[[bytes], bytes | None] | None = None, forward_done: bool = True) -> None:
        self.buf = b""
        self.stats = stats
        self.forward_usage = forward_usage
        self.on_first_token = on_first_token
        self.on_gap = on_gap
        self.on_content = on_content
        self.transform = transform
        self.forward_done = forward_done

    def feed(self, chunk: bytes) -> bytes:
        buf = self.buf + chunk  # onto an empty buf CPython hands back chunk itself: no copy in the usual case
        if b"\n\n" not in buf:
            self.buf = buf
            return b""
        *events, self.buf = buf.split(b"\n\n")
        stats = self.stats
        out: list[bytes] = []
        now = time.perf_counter()
        for ev in events:
            if not ev:
                continue
            if ev == _DONE:
                stats.done = True
                if self.forward_done:
                    out.append(ev)
                continue
            if ev.startswith(b"data: {") and _is_usage_event(ev):
                try:
                    stats.usage = json.loads(ev[6:])["usage"]
                except (ValueError, KeyError, TypeError):
                    pass
                if self.forward_usage:
                    out.append(ev)
                continue
            if ev.startswith(b"data: "):
                if stats.first_token_at is None:
                    stats.first_token_at = now
                    self.on_first_token()
                else:
                    self.on_gap(now - stats.last_token_at)
                stats.last_token_at = now
                stats.content_events += 1
                if self.on_content is not None:
                    self.on_content(ev)  # as the engine wrote it (with any token ids the frontend asked for)
                if self.transform is not None:
                    ev = self.transform(ev)
                    if ev is None:
                        continue
            out.append(ev)
        if not out:
            return b""
        out.append(b"")
        return b"\n\n".join(out)
