"""The SSE relay (orchestrator/streaming.py) on the token path: the bytes the client gets do not depend on how the
engine's stream was cut into reads (the engine client itself: test_engine_client.py)."""

from __future__ import annotations

import random

import pytest

from orchestrator.resilience.migration import strip_token_ids
from orchestrator.streaming import SseRelay, StreamStats

EVENTS = [
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"Hi","token_ids":[5]}]}',
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" there","token_ids":[7,8]}]}',
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"!","finish_reason":"length","token_ids":[9]}]}',
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}',
    b"data: [DONE]",
]
STREAM = b"".join(e + b"\n\n" for e in EVENTS)


def _relay(parts, **kw) -> tuple[bytes, StreamStats, list[bytes]]:
    stats, seen = StreamStats(), []
    relay = SseRelay(stats, kw.pop("forward_usage", True), lambda: None, lambda gap: None, on_content=seen.append, **kw)
    return b"".join(relay.feed(p) for p in parts), stats, seen


def _splits(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 12)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


@pytest.mark.parametrize("seed", range(30))
def test_any_cutting_of_the_stream_relays_the_same_bytes(seed):
    rng = random.Random(seed)
    whole, stats, seen = _relay([STREAM])
    assert whole == STREAM and stats.done and stats.content_events == 3 and stats.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    parts = _splits(STREAM, rng) if seed else [e + b"\n\n" for e in EVENTS]  # seed 0: one event per read (the fast path)
    out, stats2, seen2 = _relay(parts)
    assert out == STREAM and seen2 == seen == EVENTS[:3] and stats2.done


def test_ids_are_stripped_and_usage_withheld_unless_asked():
    out, _, seen = _relay([STREAM], forward_usage=False, transform=strip_token_ids)
    assert b'"usage"' not in out and b'"token_ids":null' in out and b"[5]" not in out
    assert seen == EVENTS[:3]  # the migration tracker still sees the ids the engine sent
    assert out.endswith(b"data: [DONE]\n\n")


def test_an_unterminated_last_event_is_dropped():
    out, stats, _ = _relay([STREAM[:-2]])
    assert not stats.done and not out.endswith(b"[DONE]\n\n")


