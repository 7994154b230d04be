"""The SSE relay (orchestrator/streaming.py) on the token path: the bytes the client gets do not depend on how the
engine's stream was cut into reads (the engine client itself: test_engine_client.py). Every test runs both twins, the
Python reference and the C step (orchestrator/_relaycore.c), and the twins are checked against each other on random
streams: the same bytes out, the same callbacks, the same stats."""

from __future__ import annotations

import random

import pytest

from orchestrator.resilience.migration import strip_token_ids
from orchestrator.streaming import RELAY_IN_C, Relay, SseRelay, StreamStats

TWINS = [pytest.param(SseRelay, id="python"),
         pytest.param(Relay, id="c", marks=pytest.mark.skipif(not RELAY_IN_C, reason="orchestrator._relaycore not built"))]

EVENTS = [
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"Hi","token_ids":[5]}]}',
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" there","token_ids":[7,8]}]}',
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"!","finish_reason":"length","token_ids":[9]}]}',
    b'data: {"id":"c1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}',
    b"data: [DONE]",
]
STREAM = b"".join(e + b"\n\n" for e in EVENTS)


def _relay(parts, cls=SseRelay, **kw) -> tuple[bytes, StreamStats, list[bytes]]:
    stats, seen = StreamStats(), []
    relay = cls(stats, kw.pop("forward_usage", True), lambda: None, lambda gap: None, on_content=seen.append, **kw)
    return b"".join(relay.feed(p) for p in parts), stats, seen


def _splits(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 12)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


@pytest.mark.parametrize("cls", TWINS)
@pytest.mark.parametrize("seed", range(30))
def test_any_cutting_of_the_stream_relays_the_same_bytes(seed, cls):
    rng = random.Random(seed)
    whole, stats, seen = _relay([STREAM], cls)
    assert whole == STREAM and stats.done and stats.content_events == 3 and stats.usage == {"prompt_tokens": 3, "completion_tokens": 4}
    parts = _splits(STREAM, rng) if seed else [e + b"\n\n" for e in EVENTS]  # seed 0: one event per read (the fast path)
    out, stats2, seen2 = _relay(parts, cls)
    assert out == STREAM and seen2 == seen == EVENTS[:3] and stats2.done


@pytest.mark.parametrize("cls", TWINS)
@pytest.mark.parametrize("how", ["transform", "strip_ids"])
def test_ids_are_stripped_and_usage_withheld_unless_asked(cls, how):
    kw = {"transform": strip_token_ids} if how == "transform" else {"strip_ids": True}
    out, _, seen = _relay([STREAM], cls, forward_usage=False, **kw)
    assert b'"usage"' not in out and b'"token_ids":null' in out and b"[5]" not in out
    assert seen == EVENTS[:3]  # the migration tracker still sees the ids the engine sent
    assert out.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("cls", TWINS)
def test_an_unterminated_last_event_is_dropped(cls):
    out, stats, _ = _relay([STREAM[:-2]], cls)
    assert not stats.done and not out.endswith(b"[DONE]\n\n")


def test_an_unchanged_chunk_is_passed_on_without_a_copy():
    if not RELAY_IN_C:
        pytest.skip("orchestrator._relaycore not built")
    chunk = EVENTS[0] + b"\n\n"
    assert _relay_one(Relay, chunk) is chunk


def _relay_one(cls, chunk):
    return cls(StreamStats(), True, lambda: None, lambda gap: None).feed(chunk)


# ---- the two twins against each other ------------------------------------------------------------------------------

_ATOMS = [
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"},"token_ids":[1,2]}]}',
    b'data: {"id":"c","choices":[{"index":0,"text":"y","token_ids":[3],"prompt_token_ids":[4,5]}]}',
    b'data: {"id":"c","choices":[{"index":0,"text":"z","token_ids":[6]}]}',
    b'data: {"id":"c","choices":[{"index":0,"text":"no ids"}]}',
    b'data: {"choices":[{"token_ids":[7,',  # an id list that never closes
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}',
    b'data: {"id":"c","choices": [],"usage":{"prompt_tokens":3}}',
    b'data: {"id":"c","choices":[],"usage":{broken',  # a usage chunk that is not JSON: usage stays as it was
    b'data: {"id":"c","choices":[],"usage":[1]}',  # usage of the wrong shape
    b"data: [DONE]",
    b": keep-alive comment",
    b"event: ping",
    b"data: not json at all",
    b"",  # an empty event
    b"\n",
    b'data: {"error":{"message":"boom"}}',
    b'data: {"choices":[{"text":"ends on an open list","token_ids":[',  # the needle at the very end
    b'data: {"id":"c","choices":[{"text":"\\n\\n token_ids\\":[ usage","token_ids":[8]}]}',  # lookalikes in a string
    b"\ndata: [DONE]",
]


def _random_stream(rng: random.Random) -> bytes:
    return b"".join(rng.choice(_ATOMS) + b"\n\n" for _ in range(rng.randint(1, 25))) + rng.choice([b"", b"data: {tail", b"\n"])


def _observed(cls, parts, **kw):
    stats, calls = StreamStats(), []
    gaps: list = []
    relay = cls(stats, kw.pop("forward_usage"), lambda: calls.append("first"), lambda g: gaps.append("gap"),
                on_content=lambda ev: calls.append(ev), **kw)
    out = []
    for p in parts:
        out.append(relay.feed(p))
        calls.append(("stats", stats.done, stats.content_events, stats.usage, stats.first_token_at is None))
    relay.flush() if hasattr(relay, "flush") else None
    return out, calls, gaps


@pytest.mark.skipif(not RELAY_IN_C, reason="orchestrator._relaycore not built")
@pytest.mark.parametrize("seed", range(200))
def test_the_c_step_matches_the_python_reference(seed):
    rng = random.Random(seed)
    data = _random_stream(rng)
    parts = _splits(data, rng) if len(data) > 2 and rng.random() < 0.8 else [data]
    kw = {"forward_usage": rng.random() < 0.5, "forward_done": rng.random() < 0.7, "strip_ids": rng.random() < 0.5}
    if rng.random() < 0.2:  # a continuation's rewriter: drops some events, rewrites others
        kw["transform"] = lambda ev: None if b"no ids" in ev else ev.upper()
    py, c = _observed(SseRelay, parts, **kw), _observed(Relay, parts, **kw)
    assert c == py


@pytest.mark.parametrize("cls", TWINS)
def test_gaps_are_counted_into_the_histograms_buckets(cls, monkeypatch):
    bounds = (0.01, 0.1, float("inf"))
    batches = []
    relay = cls(StreamStats(), True, lambda: None, lambda g: None, gap_bounds=bounds, gap_every=3,
                on_gaps=lambda counts, total, n: batches.append((list(counts), total, n)))
    content = EVENTS[0] + b"\n\n"
    for _ in range(6):  # 5 gaps: one batch of 3 on the way, the other 2 on flush
        relay.feed(content)
    assert len(batches) == 1 and batches[0][2] == 3 and sum(batches[0][0]) == 3 and batches[0][1] >= 0
    relay.flush()
    assert len(batches) == 2 and batches[1][2] == 2 and sum(batches[1][0]) == 2
    relay.flush()
    assert len(batches) == 2  # nothing left to hand on


@pytest.mark.parametrize("cls", TWINS)
def test_a_callbacks_error_reaches_the_caller(cls):
    def boom(ev):
        raise RuntimeError("tracker bug")
    relay = cls(StreamStats(), True, lambda: None, lambda g: None, on_content=boom)
    with pytest.raises(RuntimeError, match="tracker bug"):
        relay.feed(STREAM)
    with pytest.raises(ValueError):
        cls(StreamStats(), True, lambda: None, lambda g: None, gap_bounds=(1.0,))  # bounds without on_gaps




# ---- the read callback's whole step: pipe() and the client write ---------------------------------------------------


@pytest.mark.parametrize("cls", TWINS)
@pytest.mark.parametrize("seed", range(20))
def test_pipe_writes_what_feed_returns_when_not_empty(cls, seed):
    rng = random.Random(seed)
    data = _random_stream(rng)
    parts = _splits(data, rng) if len(data) > 2 else [data]
    reference = cls(StreamStats(), True, lambda: None, lambda g: None, strip_ids=True)
    fed = [o for o in map(reference.feed, parts) if o]
    written: list[bytes] = []
    relay = cls(StreamStats(), True, lambda: None, lambda g: None, strip_ids=True)
    for p in parts:
        assert relay.pipe(written.append, p) is None
    assert written == fed


@pytest.mark.parametrize("cls", TWINS)
def test_pipe_passes_the_writers_error_on(cls):
    def broken(_):
        raise OSError("gone")

    with pytest.raises(OSError):
        cls(StreamStats(), True, lambda: None, lambda g: None).pipe(broken, STREAM)


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return self.closing


class _Cycle:
    disconnected = False


def test_the_c_chunk_writer_writes_what_direct_body_writes():
    from orchestrator.direct_body import ChunkWriter, DirectBody

    if ChunkWriter is None:
        pytest.skip("orchestrator._relaycore not built")
    pieces = [b"x", b"", STREAM, b"\r\n", bytes(range(256)) * 300]
    got = {}
    for name in ("python", "c"):
        transport, cycle = _Transport(), _Cycle()
        body = DirectBody(cycle, transport)
        write = body.write if name == "python" else body.writer()
        assert (name == "c") == isinstance(write, ChunkWriter)
        for p in pieces:
            write(p)
        transport.closing = True
        write(b"after EOF")
        transport.closing, cycle.disconnected = False, True
        write(b"after the client left")
        got[name] = transport.out
    assert got["c"] == got["python"] and got["c"][0] == b"1\r\nx\r\n" and len(got["c"]) == 4
    with pytest.raises(TypeError):
        ChunkWriter(_Transport(), _Cycle())("text")
