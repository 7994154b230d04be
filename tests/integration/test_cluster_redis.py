"""A real cluster on real Redis: `kvyard worker` processes (sim engines) and a `kvyard frontend` process.

Discovery, lease expiry after SIGKILL, draining on SIGTERM without losing the in-flight request,
streaming through the official OpenAI client, and client cancellation reaching the engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.unit.orchestrator.fake_engine import free_port
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MODEL = "simmodel"


class Cluster:
    def __init__(self, redis_url: str, tmp: Path) -> None:
        self.redis_url = redis_url
        self.tmp = tmp
        self.prefix = f"kvyard-it-{uuid.uuid4().hex[:8]}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.engine_ports: dict[str, int] = {}
        self.fport = free_port()
        self.url = f"http://127.0.0.1:{self.fport}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "orchestrator", "--log-level", "info", *args], stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def start_worker(self, name: str, speedup: float = 1.0) -> None:
        port = free_port()
        self.engine_ports[name] = port
        self._spawn(name, ["worker", "--backend", "sim", "--model", "h200-llama3.1-8b", "--served-model-name", MODEL,
                           "--port", str(port), "--kv-events-port", str(free_port()), "--redis-url", self.redis_url,
                           "--discovery-prefix", self.prefix, "--lease-ttl", "1.5", "--drain-timeout", "30",
                           "--max-model-len", "4096", "--", "--speedup", str(speedup)])

    def start_frontend(self) -> None:
        self._spawn("frontend", ["frontend", "--port", str(self.fport), "--redis-url", self.redis_url,
                                 "--discovery-prefix", self.prefix, "--policy", "least-loaded"])

    async def wait_workers(self, n: int, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as c:
            while time.monotonic() < deadline:
                try:
                    body = (await c.get(self.url + "/api/cluster")).json()
                    ready = [w for w in body["workers"] if w["state"] == "ready"]
                    if len(body["workers"]) == n and len(ready) == n:
                        return body
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.tmp.glob("*.log"))
        raise AssertionError(f"cluster did not reach {n} ready workers\n{logs}")

    def worker_of(self, worker_id: str) -> str:
        # worker ids are sim-<hex>; map by engine port through /api/cluster is not exposed, so use the log
        for name in self.engine_ports:
            if worker_id in (self.tmp / f"{name}.log").read_text():
                return name
        raise KeyError(worker_id)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
async def cluster(redis_url, tmp_path):
    c = Cluster(redis_url, tmp_path)
    yield c
    c.stop()


def client(c: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=60)


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
    cluster.procs["w1"].kill()  # no deregistration: only the lease can tell
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
    cluster.procs["w1"].send_signal(signal.SIGTERM)
    # while w1 drains, new requests still succeed (on w2)
    await asyncio.sleep(2.0)
    r = await oa.completions.create(model=MODEL, prompt="new one", max_tokens=3)
    assert r.usage.completion_tokens == 3
    rest = [c async for c in stream]
    assert rest[-1].usage.completion_tokens == 300  # nothing lost
    assert cluster.procs["w1"].wait(30) == 0
    await cluster.wait_workers(1)


async def test_client_disconnect_aborts_engine_request(cluster):
    cluster.start_worker("w1", speedup=0.2)
    cluster.start_frontend()
    await cluster.wait_workers(1)
    engine = f"http://127.0.0.1:{cluster.engine_ports['w1']}"
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", cluster.url + "/v1/completions",
                            json={"model": MODEL, "prompt": "go on forever", "max_tokens": 2000, "stream": True}) as resp:
            n = 0
            async for _ in resp.aiter_raw():
                n += 1
                if n >= 3:
                    break
            deadline = time.monotonic() + 5  # the gauge is sampled by the engine's loop: allow it a moment
            running = parse_vllm_metrics((await c.get(engine + "/metrics")).text).num_requests_running
            while running != 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                running = parse_vllm_metrics((await c.get(engine + "/metrics")).text).num_requests_running
            assert running == 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if parse_vllm_metrics((await c.get(engine + "/metrics")).text).num_requests_running == 0:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("engine still runs the request after the client went away")
