"""Hostile input, fuzzed: decoders only ever raise KvEventDecodeError; the index only ever rejects
(KvEventRejected), never crashes, and always equals a plain reference model of the documented rules."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import KvEventRejected, KvIndex, block_hashes
from router.event_stream import EventStream
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvEventDecodeError
from workers.sglang import kv_events as sglang
from workers.trtllm import kv_events as trtllm

from .conftest import assert_consistent

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True), st.text(max_size=5), st.binary(max_size=5))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=12), c, max_size=4)), max_leaves=12)
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
event_maps = st.fixed_dictionaries({"type": tags}, optional={
    "block_hashes": st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3) | values,
    "parent_block_hash": st.none() | st.integers(-(2**63), 2**64 - 1) | values,
    "token_ids": st.lists(st.integers(-2, 2**33), max_size=8) | values,
    "block_size": st.integers(-1, 4) | values,
    "medium": st.sampled_from([None, "GPU", "CPU_PINNED"]) | values,
})


@FUZZ
@given(st.one_of(st.binary(max_size=64), st.builds(lambda ev, rest: msgspec.msgpack.encode([1.0, ev, *rest]),
                                                    st.lists(event_maps | values, max_size=3), st.lists(values, max_size=2))))
def test_sglang_decoder_only_raises_decode_error(payload):
    try:
        sglang.decode_payload(payload)
    except KvEventDecodeError:
        pass


@FUZZ
@given(st.one_of(st.binary(max_size=64), st.lists(st.fixed_dictionaries({"event_id": values | st.integers(0, 9), "data": values}), max_size=3).map(msgspec.json.encode)))
def test_trtllm_decoder_never_raises(body):
    for item in trtllm.decode_events(body):
        assert isinstance(item, (KvEventBatch, KvEventDecodeError))


# ---- the index against a reference model -------------------------------------------------------

BS = 2
ids = st.integers(0, 6)
tokens = st.lists(st.integers(0, 3), min_size=0, max_size=6) | st.lists(st.sampled_from([-1, 2**32, 7]), min_size=2, max_size=2)
stored = st.builds(BlockStored, st.lists(ids, max_size=3), st.none() | ids, tokens, st.sampled_from([BS, BS, BS, 1, 0]),
                   st.sampled_from([None, None, "lora"]), st.sampled_from([None, "GPU", "GPU", "CPU"]))
events = st.one_of(stored, st.builds(BlockRemoved, st.lists(ids, max_size=3), st.sampled_from([None, "GPU", "CPU"])), st.just(AllBlocksCleared()))
ops = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.one_of(events, st.just("remove_worker"))), max_size=30)


class Reference:
    """The documented rules, written the plain way: per worker, engine id -> our hash."""

    def __init__(self) -> None:
        self.w: dict[str, dict[int, int]] = {}

    def apply(self, wid, ev) -> bool:
        if ev == "remove_worker":
            self.w.pop(wid, None)
            return True
        if isinstance(ev, AllBlocksCleared):
            self.w.setdefault(wid, {}).clear()
            return True
        if ev.medium not in (None, "GPU"):
            return True
        if isinstance(ev, BlockRemoved):
            for e in ev.block_hashes:
                self.w.get(wid, {}).pop(e, None)
            return True
        m = self.w.setdefault(wid, {})
        n = len(ev.block_hashes)
        if ev.block_size < 1 or len(ev.token_ids) != n * ev.block_size:
            return False
        if n and ev.block_size != BS:
            return False
        if ev.parent_block_hash is not None and n and ev.parent_block_hash not in m:
            return False
        if any(not 0 <= t < 2**32 for t in ev.token_ids):
            return False
        ours = block_hashes(ev.token_ids, ev.block_size, ev.lora_name, None if ev.parent_block_hash is None or not n else m[ev.parent_block_hash])
        m.update(zip(ev.block_hashes, ours))
        return True

    def matches(self, hashes):
        out = {}
        for wid, m in self.w.items():
            held = set(m.values())
            d = 0
            while d < len(hashes) and hashes[d] in held:
                d += 1
            if d:
                out[wid] = d
        return out


@FUZZ
@given(ops, st.lists(tokens, min_size=1, max_size=4))
def test_index_matches_the_reference_under_hostile_events(impl, script, queries):
    ix, ref = KvIndex(auto_approximate=False), Reference()
    for wid in "abc":
        ix.add_worker(wid, block_size=BS)
    for wid, ev in script:
        ok = ref.apply(wid, ev)
        if ev == "remove_worker":
            ix.remove_worker(wid)
            ix.add_worker(wid, block_size=BS)
            ref.w[wid] = {}
            continue
        try:
            ix.apply(wid, ev)
            assert ok, f"index accepted what the reference rejects: {ev}"
        except KvEventRejected:
            assert not ok, f"index rejected a valid event: {ev}"
        assert_consistent(ix)
    for q in queries:
        if all(0 <= t < 2**32 for t in q):
            h = block_hashes(q, BS)
            assert ix.find_matches(h) == ref.matches(h)
    for lora in (None, "lora"):
        h = block_hashes([0, 1, 2, 3, 0, 1], BS, lora)
        assert ix.find_matches(h) == ref.matches(h)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 12), st.booleans(), st.none() | st.lists(st.integers(0, 12), max_size=6)), max_size=25),
       st.booleans())
def test_event_stream_survives_any_sequence(seqs, replayable):
    ix = KvIndex()
    s = EventStream("w", ix, replayable)

    def batch(q):
        return KvEventBatch(q, 0.0, [BlockStored([q], None if q == 0 else q - 1, [q, q], BS)])

    for seq, decodable, answer in seqs:
        replay = s.on_live(seq, batch(seq) if decodable else None)
        if replay is not None:
            assert replay.start < replay.upto or replay.start == 0
            s.on_replay(replay, None if answer is None else [(q, batch(q)) for q in sorted(set(answer))], batch(seq))
        assert s.last is not None and s.last >= seq
        assert_consistent(ix)
