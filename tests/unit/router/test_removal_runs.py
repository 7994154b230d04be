"""Runs of removals merged by the codecs: vLLM publishes one BlockRemoved per evicted block (SGLang one per evicted
node), so a batch on a full cache holds long runs of them. The typed decoders (workers/vllm/kv_events.py,
workers/sglang/kv_events.py) hand on each run of one medium as one BlockRemoved that counts as the events it stands
for. What the index and the stream's counters end up with must not change: checked against the same events applied
one by one."""

from __future__ import annotations

import random

import pytest

from router.event_stream import EventStream
from router.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from router.kv_index import KvIndex
from workers.sglang import kv_events as sglang_codec
from workers.vllm import kv_events as vllm_codec

CODECS = {"vllm": vllm_codec, "sglang": sglang_codec}
BS = 4


def _batches(rng: random.Random, n: int) -> list[list]:
    """Batches as an engine on a full cache sends them: stores of chains, removals one block each (GPU, and now and
    then CPU ones of an offloading tier), now and then a clear."""
    out, live, next_hash = [], [], 1
    for _ in range(n):
        events: list = []
        for _ in range(rng.randint(0, 3)):
            k = rng.randint(1, 6)
            hashes = list(range(next_hash, next_hash + k))
            next_hash += k
            events.append(BlockStored(hashes, None, [rng.randrange(1000) for _ in range(k * BS)], BS, medium="GPU"))
            live += hashes
        for _ in range(rng.randint(0, 12)):
            if live and rng.random() < 0.9:
                h = live.pop(rng.randrange(len(live)))
            else:
                h = rng.randrange(1, next_hash + 5)  # evicted twice, or never stored here: ignored by the index
            events.insert(rng.randint(0, len(events)), BlockRemoved([h], rng.choice(["GPU", "GPU", "GPU", "CPU"])))
        if rng.random() < 0.03:
            events.append(AllBlocksCleared())
            live = []
        out.append(events)
    return out


def _state(index: KvIndex, stream: EventStream) -> tuple:
    w = index._workers["w"]
    return dict(w.blocks), w.events, stream.stats.events, stream.stats.blocks_removed, stream.stats.blocks_stored, \
        stream.stats.rejected


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("seed", range(25))
def test_merged_runs_leave_the_index_and_counters_as_events_one_by_one(codec, seed):
    mod = CODECS[codec]
    batches = _batches(random.Random(seed), 30)
    states = []
    for merged in (True, False):
        index = KvIndex()
        index.add_worker("w", block_size=BS)
        stream = EventStream("w", index, replayable=False)
        for seq, events in enumerate(batches):
            batch = mod.decode_payload(mod.encode_batch(float(seq), events), seq, packed_ids=True)
            if merged:
                assert sum(getattr(e, "events", 1) for e in batch.events) == len(events)
            else:  # the engine's events as they were sent, each on its own
                batch.events = _unmerged(batch.events, events)
            stream.on_live(seq, batch)
        states.append(_state(index, stream))
    assert states[0] == states[1]


def _unmerged(decoded: list, sent: list) -> list:
    """The decoded events with every merged removal split back into the one-block removals that were sent."""
    out = []
    for e in decoded:
        if isinstance(e, BlockRemoved) and e.events > 1:
            out += [BlockRemoved([h], e.medium) for h in e.block_hashes]
        else:
            out.append(e)
    assert len(out) == len(sent)
    return out


@pytest.mark.parametrize("codec", list(CODECS))
def test_a_run_is_one_event_per_medium_and_stops_at_other_events(codec):
    mod = CODECS[codec]
    sent = [BlockRemoved([1], "GPU"), BlockRemoved([2], "GPU"), BlockStored([9], None, [1, 2, 3, 4], BS, medium="GPU"),
            BlockRemoved([3], "GPU"), BlockRemoved([4], "CPU"), BlockRemoved([5, 6], "CPU"), AllBlocksCleared(),
            BlockRemoved([7], "GPU")]
    got = mod.decode_payload(mod.encode_batch(0.0, sent)).events
    removed = [(e.block_hashes, e.medium, e.events) for e in got if isinstance(e, BlockRemoved)]
    assert removed == [([1, 2], "GPU", 2), ([3], "GPU", 1), ([4, 5, 6], "CPU", 2), ([7], "GPU", 1)]
    assert [type(e).__name__ for e in got] == ["BlockRemoved", "BlockStored", "BlockRemoved", "BlockRemoved",
                                                "AllBlocksCleared", "BlockRemoved"]
