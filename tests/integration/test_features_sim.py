"""LoRA adapters, multimodal prefixes and sessions end to end: `kvyard up` over sim engines, KV events feeding the index.

The sim engines load adapters through vLLM's runtime API and key their blocks and events like vLLM 0.32 (adapter
name and path, image identifiers): the frontend's index, built only from those events, must then predict exactly
what the engines hit.
  1. An adapter loads on first use; its follow-ups go to that worker and hit its prefix; the same prompt on the
     other adapter hits nothing there, and the router's predicted overlap agrees with the engines' counters.
  2. The same image shares the prefix (predicted and hit), another image shares only the text before it.
  3. A session's turns stay on one worker; the dashboard data shows the pin, the adapters and the queues.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from orchestrator.testing import free_port, free_port_run
from tests.integration.up_admin import ADMIN_HEADERS, admin_env

pytestmark = pytest.mark.slow

MODEL = "kvyard-sim"
TEXT = "Describe the attached picture in detail: " + " ".join(f"aspect {j} matters." for j in range(60))


@pytest.fixture
async def stack(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    cfg = {"frontend": {"lora": {"adapters": [{"name": f"ad-{n}", "path": str(tmp_path / n), "base_model": MODEL} for n in "ab"]}},
           "engine_args": ["--enable-prompt-tokens-details"]}
    (tmp_path / "up.yaml").write_text(json.dumps(cfg))
    port, base = free_port(), free_port_run(8)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", "--workers", "2", "--port", str(port), "--grpc-port", "0",
                             "--base-port", str(base), "--speedup", "5", "--config", str(tmp_path / "up.yaml")],
                            stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT, cwd=tmp_path, env=admin_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    async with httpx.AsyncClient(timeout=60, headers=ADMIN_HEADERS) as client:
        while True:
            try:
                body = (await client.get(url + "/api/cluster")).json()
                if len([w for w in body["workers"] if w["state"] == "ready"]) == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("kvyard up did not start:\n" + (tmp_path / "up.log").read_text()[-3000:])
            await asyncio.sleep(0.3)
        yield client, url
    proc.send_signal(signal.SIGINT)
    proc.wait(60)


def overlap(metrics_text: str) -> float:
    m = re.search(r"^kvyard_router_overlap_blocks_total\{[^}]*\} ([0-9.e+]+)$", metrics_text, re.M)
    return float(m.group(1)) if m else 0.0


async def complete(client, url, model: str, prompt, session: str | None = None) -> tuple[str, int]:
    headers = {"x-session-id": session} if session else {}
    r = await client.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2}, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers["x-kvyard-worker"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def chat(client, url, parts) -> tuple[str, int, int]:
    r = await client.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return r.headers["x-kvyard-worker"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


async def routed_overlap(client, url) -> float:
    await asyncio.sleep(0)
    return overlap((await client.get(url + "/metrics")).text)


async def test_adapters_images_and_sessions_through_the_events(stack):
    client, url = stack
    prompt = list(range(1000, 1000 + 16 * 20 + 5))  # 20 full blocks
    worker, cached = await complete(client, url, "ad-a", prompt)
    assert cached == 0
    await asyncio.sleep(0.5)  # the engine's BlockStored reaches the index
    before = await routed_overlap(client, url)
    again, cached = await complete(client, url, "ad-a", prompt[:-1])
    assert again == worker and cached == 16 * 20  # the adapter's holder, and its own prefix
    assert await routed_overlap(client, url) - before == 20  # the router predicted exactly those 20 blocks
    cluster = (await client.get(url + "/api/cluster")).json()
    assert {w["worker_id"]: w["adapters"] for w in cluster["workers"]}[worker] == ["ad-a"]

    before = await routed_overlap(client, url)
    _, cached = await complete(client, url, "ad-b", prompt)
    assert cached == 0 and await routed_overlap(client, url) - before == 0  # other adapter: nothing shared, none predicted
    _, cached = await complete(client, url, MODEL, prompt)
    assert cached == 0  # nor with the base model

    img1 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}
    img2 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,REVG"}}
    w1, n, cached = await chat(client, url, [{"type": "text", "text": TEXT}, img1, {"type": "text", "text": "first"}])
    assert cached == 0 and n > 256
    await asyncio.sleep(0.5)
    before = await routed_overlap(client, url)
    w2, n2, cached2 = await chat(client, url, [{"type": "text", "text": TEXT}, img1, {"type": "text", "text": "second"}])
    predicted = await routed_overlap(client, url) - before
    assert w2 == w1 and cached2 >= (n2 // 16 - 1) * 16 and predicted * 16 == cached2  # the image's prefix, as predicted
    await asyncio.sleep(0.5)
    before = await routed_overlap(client, url)
    w3, n3, cached3 = await chat(client, url, [{"type": "text", "text": TEXT}, img2, {"type": "text", "text": "second"}])
    predicted = await routed_overlap(client, url) - before
    # another image: the text blocks before it at most, nothing of the image's 256 placeholder tokens or after them
    assert n3 == n2 and 0 < cached3 <= cached2 - 256
    assert w3 != w1 or predicted * 16 == cached3

    seen = {(await complete(client, url, MODEL, [7, 8, 9] * (10 + i), session="conv-42"))[0] for i in range(5)}
    assert len(seen) == 1
    cluster = (await client.get(url + "/api/cluster")).json()
    assert cluster["sessions"]["pinned"] == 1 and sum(w["sessions_pinned"] for w in cluster["workers"]) == 1
    assert set(cluster["admission"][MODEL]["queued"]) == {"high", "normal", "low"}
    models = {m["id"]: m["parent"] for m in (await client.get(url + "/v1/models")).json()["data"]}
    assert models == {MODEL: None, "ad-a": MODEL, "ad-b": MODEL}
