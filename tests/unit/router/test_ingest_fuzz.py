"""The ingestion path, fuzzed end to end (ZMQ message frames -> decoder -> EventStream -> KvIndex).

test_kv_fuzz.py and workers/vllm/test_vllm_kv_fuzz.py fuzz the decoders alone; this drives a worker's
event source (`_Source._on_frames` for the ZMQ formats, `feed` for TRT-LLM's polled JSON) with a
mix of valid batches, random payloads, corrupted valid payloads, wrong frame counts and bad sequence
frames. Whatever arrives: nothing raises, the index keeps its invariants, and the next valid batch
after the storm is applied (the index is not wedged or corrupted).
"""

from __future__ import annotations

import asyncio
import struct

import msgspec
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import KvIndex, block_hashes
from router.events import KvEventIngestor, _Source
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvEventDecodeError
from workers.sglang import kv_events as sglang
from workers.trtllm import kv_events as trtllm
from workers.types import WorkerInfo
from workers.vllm import kv_events as vllm

from .conftest import assert_consistent

BS = 2
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ENCODERS = {"vllm": vllm.encode_batch, "sglang": sglang.encode_batch}
_CTX = zmq.asyncio.Context()  # one for all examples: a context per example costs more than the test

engine_ids = st.integers(0, 6)
token_lists = st.lists(st.integers(0, 5), min_size=BS, max_size=3 * BS).map(lambda t: t[: len(t) - len(t) % BS])
events = st.one_of(
    st.builds(lambda hs, parent, toks: BlockStored(hs[: len(toks) // BS], parent, toks, BS), st.lists(engine_ids, min_size=3, max_size=3),
              st.none() | engine_ids, token_lists),
    st.builds(BlockRemoved, st.lists(engine_ids, max_size=3)),
    st.just(AllBlocksCleared()),
)
junk = st.binary(max_size=80)


@st.composite
def messages(draw, fmt: str):
    """(frames) for a ZMQ source: mostly well-formed, sequence mostly increasing, with every kind of damage."""
    out, seq = [], 0
    for _ in range(draw(st.integers(1, 25))):
        seq += draw(st.sampled_from([1, 1, 1, 1, 0, 2, -3]))
        seq = max(seq, 0)
        payload = ENCODERS[fmt](1.0, draw(st.lists(events, max_size=3)))
        kind = draw(st.sampled_from(["ok", "ok", "ok", "junk", "cut", "noise", "frames", "seq"]))
        if kind == "junk":
            payload = draw(junk)
        elif kind == "cut":
            payload = payload[: draw(st.integers(0, max(len(payload) - 1, 0)))]
        elif kind == "noise":
            payload = payload + draw(st.binary(min_size=1, max_size=8))
        seq_frame = struct.pack(">Q", seq) if kind != "seq" else draw(st.binary(max_size=12))
        frames = [b"kv-events", seq_frame, payload]
        if kind == "frames":
            frames = draw(st.lists(st.binary(max_size=16), max_size=5).filter(lambda f: len(f) != 3))
        out.append(frames)
    return out, seq


def _source(fmt: str, replay: bool) -> tuple[KvEventIngestor, _Source]:
    ix = KvIndex()
    ing = KvEventIngestor(ix, replay_timeout_s=0.01, log_interval_s=3600, ctx=_CTX)
    info = WorkerInfo(worker_id="w", model="m", backend=fmt, url="http://127.0.0.1:9", block_size=BS,
                      kv_events_endpoint="ipc:///nonexistent/kvyard-fuzz.pub",
                      kv_replay_endpoint="ipc:///nonexistent/kvyard-fuzz.rep" if replay else None, kv_events_topic="kv-events",
                      labels={"kv_events_format": fmt})
    ix.add_worker("w", block_size=BS)
    return ing, _Source(ing, info, fmt)


def _assert_still_indexes(ix: KvIndex, feed) -> None:
    """After the storm: a clear and one valid block must land, findable by the router's own hash."""
    toks = [3, 4]
    feed([AllBlocksCleared(), BlockStored([424242], None, toks, BS)])
    assert ix.find_matches(block_hashes(toks, BS)).get("w") == 1
    assert_consistent(ix)


def _run_zmq(fmt: str, msgs, last: int, replay: bool) -> None:
    async def go():
        ing, src = _source(fmt, replay)
        try:
            for frames in msgs:
                await src._on_frames(frames)  # must never raise, whatever the frames
                assert_consistent(ing.index)
            nxt = last + 1  # may be "back in time" after a random sequence frame: then it reads as an engine restart
            payload = ENCODERS[fmt](2.0, [AllBlocksCleared(), BlockStored([424242], None, [3, 4], BS)])
            await src._on_frames([b"kv-events", struct.pack(">Q", nxt), payload])
            assert ing.index.find_matches(block_hashes([3, 4], BS)).get("w") == 1
            assert_consistent(ing.index)
        finally:
            await ing.close()

    asyncio.run(go())


@FUZZ
@given(data=st.data(), replay=st.booleans())
def test_vllm_source_survives_any_frames(data, replay):
    msgs, last = data.draw(messages("vllm"))
    _run_zmq("vllm", msgs, last, replay)


@FUZZ
@given(data=st.data(), replay=st.booleans())
def test_sglang_source_survives_any_frames(data, replay):
    msgs, last = data.draw(messages("sglang"))
    _run_zmq("sglang", msgs, last, replay)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64) | st.text(max_size=6),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3), max_leaves=10)


@FUZZ
@given(bodies=st.lists(st.one_of(
    junk,
    st.lists(st.tuples(st.integers(0, 30), events), max_size=4).map(lambda bs: trtllm.encode_events(bs)),
    st.lists(st.fixed_dictionaries({"event_id": st.integers(0, 30) | json_values, "data": json_values}), max_size=3).map(msgspec.json.encode),
), max_size=10))
def test_trtllm_polled_bodies_survive(bodies):
    async def go():
        ing, src = _source("trtllm", replay=False)
        try:
            last = -1
            for body in bodies:
                for item in trtllm.decode_events(body):  # the polling loop's body, minus HTTP
                    if isinstance(item, KvEventDecodeError):
                        src.complain(f"skipped an undecodable KV event: {item}")
                    else:
                        assert isinstance(item, KvEventBatch)
                        src.feed(item.seq, item)
                        last = max(last, item.seq)
                    assert_consistent(ing.index)
            nxt = max(last + 1, (src.stream.last_live or 0) + 1)
            _assert_still_indexes(ing.index, lambda evs: src.feed(nxt, KvEventBatch(seq=nxt, ts=0.0, events=evs)))
        finally:
            await ing.close()

    asyncio.run(go())
