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

Two twins: `SseRelay` below is the reference, in Python; `Relay` is the one the service uses, the C
extension orchestrator._relaycore when it is built (setup.py), else this one. They take the same
arguments and give the same bytes, callbacks and stats (tests/unit/orchestrator/test_relay.py runs
both). The C one costs 1–2 µs a token where this one costs 4–6 (benchmarks/relay_step.py).
"""

from __future__ import annotations

import json
import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.resilience.migration import strip_token_ids

__all__ = ["Relay", "SseRelay", "StreamStats", "sse_error_event", "RELAY_IN_C"]

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
    writing it).

    Each content event's gap since the one before goes to `on_gap(gap)`, or, with `gap_bounds` (a histogram's
    ascending upper bounds, +Inf last), is counted in bucket `bisect_left(gap_bounds, gap)` and handed on as
    `on_gaps(counts, sum, n)` every `gap_every` gaps and on `flush()`. `strip_ids` hides the token ids the frontend
    asked the engine for (`strip_token_ids`) where no `transform` is given."""

    __slots__ = ("buf", "stats", "forward_usage", "on_first_token", "on_gap", "on_content", "transform", "forward_done",
                 "_bounds", "_on_gaps", "_every", "_counts", "_sum", "_n")

    def __init__(self, stats: StreamStats, forward_usage: bool, on_first_token: Callable[[], None],
                 on_gap: Callable[[float], None], on_content: Callable[[bytes], None] | None = None,
                 transform: Callable[[bytes], bytes | None] | None = None, forward_done: bool = True,
                 strip_ids: bool = False, gap_bounds: Sequence[float] | None = None,
                 on_gaps: Callable[[list[int], float, int], None] | None = None, gap_every: int = 64) -> None:
        self.buf = b""
        self.stats = stats
        self.forward_usage = forward_usage
        self.on_first_token = on_first_token
        self.on_content = on_content
        self.transform = transform if transform is not None else (strip_token_ids if strip_ids else None)
        self.forward_done = forward_done
        self._bounds, self._on_gaps, self._every = gap_bounds, on_gaps, gap_every
        if gap_bounds is not None:
            if on_gaps is None or gap_every < 1 or not len(gap_bounds):
                raise ValueError("gap_bounds needs on_gaps and gap_every >= 1")
            self._counts, self._sum, self._n = [0] * len(gap_bounds), 0.0, 0
            self.on_gap = self._count_gap
        else:
            self.on_gap = on_gap

    def _count_gap(self, gap: float) -> None:
        self._counts[min(bisect_left(self._bounds, gap), len(self._counts) - 1)] += 1
        self._sum += gap
        self._n += 1
        if self._n >= self._every:
            self.flush()

    def flush(self) -> None:
        """Hand on the gaps counted and not yet reported (gap_bounds mode)."""
        if self._bounds is not None and self._n:
            counts, total, n = self._counts, self._sum, self._n
            self._counts, self._sum, self._n = [0] * len(counts), 0.0, 0
            self._on_gaps(counts, total, n)

    def pipe(self, write: Callable[[bytes], None], chunk: bytes) -> None:
        """`write(feed(chunk))` when that is not empty: the engine socket's read callback's whole step."""
        out = self.feed(chunk)
        if out:
            write(out)

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


try:  # the same step in C (setup.py builds it; without a compiler the Python twin above serves)
    from orchestrator._relaycore import SseRelay as Relay

    RELAY_IN_C = True
except ImportError:  # pragma: no cover - depends on the build
    Relay = SseRelay  # type: ignore[misc,assignment]
    RELAY_IN_C = False
    logging.getLogger("kvyard.frontend").warning(
        "orchestrator._relaycore is not built; the SSE relay uses its pure-Python twin (about 5x the CPU a token)")
