"""KvEventIngestor over real ZMQ sockets (ipc) with a fake replay ROUTER, and TRT-LLM polling over a mock HTTP transport."""

from __future__ import annotations

import asyncio
import struct

import httpx
import pytest
import zmq
import zmq.asyncio

from router import KvIndex, block_hashes
from router.events import KvEventIngestor, event_format
from router.kv_events import BlockRemoved, BlockStored
from workers.sglang import kv_events as sglang
from workers.trtllm import kv_events as trtllm
from workers.types import WorkerInfo
from workers.vllm.kv_events import decode_payload, encode_batch

from .conftest import assert_consistent, frames


def info(wid: str, tmp_path, backend="vllm", replay=True, **kw) -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid, model="m", backend=backend, url=kw.pop("url", "http://127.0.0.1:9"), block_size=kw.pop("block_size", 32),
        kv_events_endpoint=f"ipc://{tmp_path}/{wid}.pub", kv_replay_endpoint=f"ipc://{tmp_path}/{wid}.rep" if replay else None,
        kv_events_topic="kv-events", **kw,
    )


async def until(cond, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


class FakeEngine:
    """A PUB socket and a ROUTER replay socket that answers from a buffer of (seq, payload)."""

    def __init__(self, ctx, wi: WorkerInfo, answer=True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(wi.kv_events_endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.requests: list[int] = []
        self.router = None
        self.task = None
        if wi.kv_replay_endpoint:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.bind(wi.kv_replay_endpoint)
            self.task = asyncio.get_running_loop().create_task(self._serve(answer))

    async def _serve(self, answer: bool) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            self.requests.append(struct.unpack(">Q", start)[0])
            if not answer:
                continue
            for seq, payload in self.buffer:
                if seq >= self.requests[-1]:
                    await self.router.send_multipart([ident, b"", b"kv-events", struct.pack(">Q", seq), payload])
            await self.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    async def publish(self, seq: int, payload: bytes, live: bool = True) -> None:
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"kv-events", struct.pack(">Q", seq), payload])

    def close(self) -> None:
        if self.task:
            self.task.cancel()
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def test_golden_vllm_stream_with_dropped_batches_is_replayed(impl, ctx, tmp_path, kv_golden):
    wi = info("v", tmp_path)
    eng = FakeEngine(ctx, wi)
    ix, ref = KvIndex(), KvIndex()
    ing = KvEventIngestor(ix, ctx=ctx)
    ing.sync([wi])
    await asyncio.sleep(0.2)
    msgs = [frames(m) for step in kv_golden["steps"] for m in step["messages"]]
    for i, (topic, seq, payload) in enumerate(msgs):
        await eng.publish(struct.unpack(">Q", seq)[0], payload, live=i not in (2, 3))  # two batches lost on the wire
        ref.apply_batch("v", decode_payload(payload).events)
    await until(lambda: ing.stats()["v"]["last_seq"] == len(msgs) - 1)
    assert eng.requests == [0, 2] and ing.stats()["v"]["purges"] == 0  # bootstrap from 0, then the gap
    for step in kv_golden["steps"]:
        h = block_hashes(step["prompt_token_ids"], 32)
        assert ix.find_matches(h) == ref.find_matches(h)
    assert_consistent(ix)
    await ing.close()
    eng.close()


async def test_a_new_frontend_rebuilds_from_the_engines_buffer_at_once(impl, ctx, tmp_path, kv_golden):
    """The engine is idle (no live event will come): the index is rebuilt by the start-up replay."""
    wi = info("v", tmp_path)
    eng = FakeEngine(ctx, wi)
    msgs = [frames(m) for step in kv_golden["steps"] for m in step["messages"]]
    for _topic, seq, payload in msgs:
        await eng.publish(struct.unpack(">Q", seq)[0], payload, live=False)  # published before we were there
    ix = KvIndex()
    ing = KvEventIngestor(ix, ctx=ctx)
    ing.sync([wi])
    await until(lambda: ing.stats()["v"]["last_seq"] == len(msgs) - 1)
    first = kv_golden["steps"][0]["prompt_token_ids"]
    assert ix.find_matches(block_hashes(first, 32)) == {"v": 2} and eng.requests == [0]
    await ing.close()
    eng.close()


async def test_replay_timeout_purges_and_malformed_frames_are_skipped(ctx, tmp_path, caplog):
    wi = info("w", tmp_path, block_size=2)
    eng = FakeEngine(ctx, wi, answer=False)
    ix = KvIndex()
    ing = KvEventIngestor(ix, ctx=ctx, replay_timeout_s=0.2, log_interval_s=0)
    ing.sync([wi])
    await asyncio.sleep(0.2)
    await eng.publish(0, encode_batch(1.0, [BlockStored([1], None, [5, 6], 2)]))
    await eng.pub.send_multipart([b"kv-events", b"\x00" * 8])  # 2 frames
    await eng.pub.send_multipart([b"kv-events", b"\x01", b"x"])  # bad sequence frame
    await eng.publish(1, b"\xc1 not msgpack")  # undecodable: counted, skipped
    await eng.publish(5, encode_batch(1.0, [BlockStored([9], None, [7, 8], 2)]))  # gap 2..4, replay never answers
    await until(lambda: ing.stats()["w"]["last_seq"] == 5)
    st = ing.stats()["w"]
    assert (st["undecodable"], st["replays"], st["purges"]) == (1, 1, 1)
    assert ix.find_matches(block_hashes([5, 6], 2)) == {} and ix.find_matches(block_hashes([7, 8], 2)) == {"w": 1}
    assert "timed out" in caplog.text and "undecodable" in caplog.text
    await ing.close()
    eng.close()


async def test_sglang_format_by_label(ctx, tmp_path):
    wi = info("s", tmp_path, backend="sim", replay=False, block_size=2, labels={"kv_events_format": "sglang"})
    assert event_format(wi) == "sglang" and event_format(info("x", tmp_path, backend="sim")) == "vllm"
    eng = FakeEngine(ctx, wi)
    ix = KvIndex()
    ing = KvEventIngestor(ix, ctx=ctx)
    ing.sync([wi])
    await asyncio.sleep(0.2)
    await eng.publish(0, sglang.encode_batch(1.0, [BlockStored([2**64 - 1, 2**63], None, [1, 2, 3, 4], 2)]))
    await eng.publish(1, sglang.encode_batch(1.0, [BlockRemoved([2**63])]))
    await until(lambda: ing.stats()["s"]["last_seq"] == 1)
    assert ix.find_matches(block_hashes([1, 2, 3, 4], 2)) == {"s": 1}
    await ing.close()
    eng.close()


async def test_trtllm_polling_and_gap_purge(tmp_path):
    toks = list(range(1, 9))
    pages = [
        trtllm.encode_events([(0, BlockStored([11, 12], None, toks[:4], 2))]),
        trtllm.encode_events([(1, BlockStored([13], 12, toks[4:6], 2))]),
        trtllm.encode_events([(7, BlockStored([21], None, toks[:2], 2))]),  # events 2..6 were lost: purge
    ]
    calls = []
    gap_may_come = asyncio.Event()  # the third page waits until the test has seen the first two applied

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        n = len(calls)
        if n >= 3:
            await gap_may_come.wait()
        return httpx.Response(200, content=pages[n - 1] if n <= len(pages) else b"[]")

    ix = KvIndex()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        ing = KvEventIngestor(ix, http=http, poll_interval_s=0.01)
        ing.sync([WorkerInfo(worker_id="t", model="m", backend="trtllm", url="http://127.0.0.1:9", block_size=2)])
        await until(lambda: ing.stats()["t"]["last_seq"] == 1)
        assert ix.find_matches(block_hashes(toks, 2)) == {"t": 3}
        gap_may_come.set()
        await until(lambda: ing.stats()["t"]["last_seq"] == 7)
        assert ix.find_matches(block_hashes(toks, 2)) == {"t": 1} and ing.stats()["t"]["purges"] == 1
        assert calls[0] == "/kv_cache_events"
        await ing.close()


async def test_sync_starts_stops_and_falls_back_to_approximate(ctx, tmp_path, caplog):
    ix = KvIndex()
    ing = KvEventIngestor(ix, ctx=ctx)
    a, b = info("a", tmp_path), info("b", tmp_path)
    silent = WorkerInfo(worker_id="c", model="m", backend="vllm", url="http://127.0.0.1:9")
    with caplog.at_level("WARNING"):
        ing.sync([a, b, silent])
    assert sorted(ing.sources) == ["a", "b"] and ix.is_approximate("c") and "PREDICTED" in caplog.text
    task_a = ing.sources["a"].task
    ing.sync([a, silent])  # b left
    assert sorted(ing.sources) == ["a"] and "b" not in ix.workers()
    ing.sync([info("a", tmp_path, replay=False), silent])  # a's feed changed: restarted
    await asyncio.sleep(0)
    assert task_a.cancelled() and ing.sources["a"].task is not task_a
    ing.sync([])
    assert ing.sources == {} and ix.workers() == []
    await ing.close()


async def test_bursts_and_lulls_are_all_read_from_the_socket_descriptor(ctx, tmp_path):
    """The live socket is read when the loop sees its descriptor readable, and ZeroMQ signals that descriptor on edges:
    batches that arrive while earlier ones are being applied, after a lull, or past `drain_max` (the ingestor
    yields to the loop, then goes on) must all be read, none twice."""
    wi = info("v", tmp_path, replay=False, block_size=4)
    pub = ctx.socket(zmq.PUB)
    pub.bind(wi.kv_events_endpoint)
    ix = KvIndex()
    ing = KvEventIngestor(ix, ctx=ctx, drain_max=7)
    ing.sync([wi])
    await asyncio.sleep(0.3)  # the subscription reaches the publisher
    seq = 0
    for burst in (1, 50, 3, 200, 1):
        for _ in range(burst):
            payload = encode_batch(0.0, [BlockStored([seq + 1], None, [seq, seq, seq, seq], 4)])
            await pub.send_multipart([b"kv-events", struct.pack(">Q", seq), payload])
            seq += 1
        await asyncio.sleep(0.05)  # a lull: the next burst wakes the reader again
    await until(lambda: ing.stats()["v"]["last_seq"] == seq - 1)
    stats = ing.stats()["v"]
    assert stats["batches"] == seq and stats["blocks_stored"] == seq and stats["rejected"] == 0
    assert all(ix.find_matches(block_hashes([i] * 4, 4)) == {"v": 1} for i in (0, 51, 254))
    await ing.close()
    pub.close(0)
