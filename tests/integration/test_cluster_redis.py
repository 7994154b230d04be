"""A real cluster on real Redis: `kvyard worker` processes (sim engines) and a `kvyard frontend` process.

Discovery, lease expiry after SIGKILL, draining on SIGTERM without losing the in-flight request,
streaming through the official OpenAI client, and client cancellation reaching the engine.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.testing.procs import KvyardCluster
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MODEL = "simmodel"


class Cluster(KvyardCluster):
    """Sim workers (lease 1.5 s, 30 s drain) and one least-loaded frontend "fe" over the test's Redis."""

    def __init__(self, redis_url: str, tmp: Path) -> None:
        super().__init__(redis_url, tmp, MODEL, prefix=f"kvyard-it-{uuid.uuid4().hex[:8]}", lease_ttl_s=1.5,
                         drain_timeout_s=30, max_model_len=4096)

    @property
    def base(self) -> str:
        return self.url("fe")

    def start_worker(self, name: str, speedup: float = 1.0) -> None:
        self.add_worker(name, speedup)

    def start_frontend(self) -> None:
        self.add_frontend("fe", policy="least-loaded")

    async def wait_workers(self, n: int, timeout: float = 60.0) -> dict:
        """Exactly n workers, all ready; a worker the test stopped is not started again."""
        return await self.wait_ready("fe", n, timeout, exact=True, respawn=False)


@pytest.fixture
async def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop()


def client(c: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.base + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_discovery_and_openai_client(cluster):
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    cluster.start_frontend()
    await cluster.wait_workers(2)
    oa = client(cluster)
    models = await oa.models.list()
    assert [m.id for m in models.data] == [MODEL]
    chat = await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    comp = await oa.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert comp.usage.completion_tokens == 5
    chunks = [c async for c in await oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True, stream_options={"include_usage": True})]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    pieces = [c.choices[0].text async for c in await oa.completions.create(model=MODEL, prompt="hi", max_tokens=6, stream=True)]
    assert len(pieces) == 6 and "".join(pieces)
    with pytest.raises(openai.NotFoundError):
        await oa.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        await oa.completions.create(model=MODEL, prompt="x", max_tokens=10**7)


async def test_lease_expiry_after_sigkill(cluster):
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    cluster.start_frontend()
    await cluster.wait_workers(2)
    cluster.workers["w1"].proc.kill()  # SIGKILL of the worker alone: no deregistration, only the lease can tell
    t0 = time.monotonic()
    await cluster.wait_workers(1, timeout=10)
    assert time.monotonic() - t0 < 5  # lease 1.5 s + one frontend refresh
    oa = client(cluster)
    for _ in range(4):
        r = await oa.completions.create(model=MODEL, prompt="still here", max_tokens=3)
        assert r.usage.completion_tokens == 3
    # the engine child did not outlive its worker
    with pytest.raises(httpx.HTTPError):
        await asyncio.sleep(1.0)
        httpx.get(f"http://127.0.0.1:{cluster.engine_ports['w1']}/health", timeout=1)


async def test_drain_on_sigterm_finishes_inflight(cluster):
    cluster.start_worker("w1", speedup=0.5)
    cluster.start_frontend()
    await cluster.wait_workers(1)
    oa = client(cluster)
    stream = await oa.completions.create(model=MODEL, prompt="a long answer please", max_tokens=300, stream=True,
                                         stream_options={"include_usage": True})
    first = await stream.__anext__()
    assert first.choices[0].text is not None
    cluster.start_worker("w2")
    await cluster.wait_workers(2)
    cluster.workers["w1"].proc.send_signal(signal.SIGTERM)
    # while w1 drains, new requests still succeed (on w2)
    await asyncio.sleep(2.0)
    r = await oa.completions.create(model=MODEL, prompt="new one", max_tokens=3)
    assert r.usage.completion_tokens == 3
    rest = [c async for c in stream]
    assert rest[-1].usage.completion_tokens == 300  # nothing lost
    assert cluster.workers["w1"].proc.wait(30) == 0
    await cluster.wait_workers(1)


async def test_client_disconnect_aborts_engine_request(cluster):
    cluster.start_worker("w1", speedup=0.2)
    cluster.start_frontend()
    await cluster.wait_workers(1)
    engine = f"http://127.0.0.1:{cluster.engine_ports['w1']}"
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", cluster.base + "/v1/completions",
                            json={"model": MODEL, "prompt": "go on forever", "max_tokens": 2000, "stream": True}) as resp:
            assert resp.status_code == 200
            # Read through an iterator held open: breaking out of `async for ... in resp.aiter_raw()` lets the
            # generator be finalized at the next await, which closes the connection (httpcore's stream aclose),
            # so the client "left" before the check below, and on a loaded box the abort won the race.
            chunks = resp.aiter_raw()
            seen = [await anext(chunks) for _ in range(3)]
            # the gauge is sampled by the engine's loop: allow it a moment (longer on a loaded box: once, during the
            # full suite, 5 s were not enough)
            deadline = time.monotonic() + 15
            running = parse_vllm_metrics((await c.get(engine + "/metrics")).text).num_requests_running
            while running != 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                running = parse_vllm_metrics((await c.get(engine + "/metrics")).text).num_requests_running
            if running != 1:
                gauges = [ln for ln in (await c.get(engine + "/metrics")).text.splitlines() if "num_requests" in ln]
                pytest.fail(f"the engine shows {running} requests running while the stream is open; stream so far "
                            f"{b''.join(seen)[:300]!r}; engine gauges {gauges}; frontend /api/cluster "
                            f"{(await c.get(cluster.base + '/api/cluster')).text[:1500]}")
            await chunks.aclose()  # leave: the connection closes with the stream's context
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if parse_vllm_metrics((await c.get(engine + "/metrics")).text).num_requests_running == 0:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("engine still runs the request after the client went away")
