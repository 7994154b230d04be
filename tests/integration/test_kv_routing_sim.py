"""KV-aware routing end to end: `kvyard up` with sim workers, KV events feeding the index.

Requests that share a long prefix land on the worker that cached it (the engine's own
prefix-cache counters confirm the hits), and a hot prefix still spreads once that worker is busy.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from orchestrator.testing import free_port, free_port_run
from tests.integration.up_admin import ADMIN_HEADERS, admin_env
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = pytest.mark.slow


@pytest.fixture
async def stack(tmp_path):
    port, base = free_port(), free_port_run(8)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", "--workers", "4", "--port", str(port), "--grpc-port", "0",
                             "--base-port", str(base), "--policy", "kv", "--speedup", "2", "--max-model-len", "32768"],
                            stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT, cwd=tmp_path, env=admin_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    async with httpx.AsyncClient(timeout=60, headers=ADMIN_HEADERS) as client:
        while time.monotonic() < deadline:
            try:
                body = (await client.get(url + "/api/cluster")).json()
                if len(body["workers"]) == 4:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.3)
        else:
            proc.kill()
            pytest.fail("kvyard up did not start:\n" + (tmp_path / "up.log").read_text()[-3000:])
        # the URLs the workers registered: an engine whose base port + i was taken meanwhile (an ephemeral port of
        # another connection) listens on the next free one (orchestrator/launcher.py engine_port)
        yield client, url, sorted(w["url"] for w in body["workers"])
    proc.send_signal(signal.SIGINT)
    proc.wait(60)


def prefix(i: int) -> str:
    return f"Document {i}: " + " ".join(f"fact{i}-{j} is recorded here." for j in range(300))  # ~2k tokens


async def hits(client, engines) -> float:
    total = 0.0
    for e in engines:
        total += parse_vllm_metrics((await client.get(e + "/metrics")).text).prefix_cache_hits
    return total


async def test_shared_prefix_goes_where_it_is_cached(stack):
    client, url, engines = stack
    chosen = {}
    for i in range(4):
        r = await client.post(url + "/v1/completions", json={"model": "kvyard-sim", "prompt": prefix(i) + " Q0", "max_tokens": 2})
        assert r.status_code == 200, r.text
        chosen[i] = r.headers["x-kvyard-worker"]
    await asyncio.sleep(0.5)  # KV events reach the index
    before = await hits(client, engines)
    for q in range(1, 4):
        for i in range(4):
            r = await client.post(url + "/v1/completions", json={"model": "kvyard-sim", "prompt": prefix(i) + f" Q{q}", "max_tokens": 2})
            assert r.headers["x-kvyard-worker"] == chosen[i], f"prefix {i} moved away from its cache"
    gained = await hits(client, engines) - before
    assert gained >= 12 * 1900  # each follow-up reused (almost) its whole ~2k-token prefix
    text = (await client.get(url + "/metrics")).text
    assert "kvyard_router_kv_hit_rate_bucket" in text
    chosen_blocks, best_blocks = router_blocks(text)
    assert chosen_blocks == best_blocks >= 12 * 1900 // 16  # every follow-up went to the best holder: no affinity given up
    events = (await client.get(url + "/api/cluster")).json()["kv"]["events"]
    assert sum(s["blocks_stored"] for s in events.values()) >= 4 * 1900 // 16


def router_blocks(metrics_text: str) -> tuple[float, float]:
    """(blocks predicted cached on the chosen workers, on the best-holding workers), summed over models."""
    m = {name: 0.0 for name in ("overlap", "best_overlap")}
    for line in metrics_text.splitlines():
        for name in m:
            if line.startswith(f"kvyard_router_{name}_blocks_total{{"):
                m[name] += float(line.rsplit(" ", 1)[1])
    return m["overlap"], m["best_overlap"]


async def test_hot_prefix_spreads_under_load(stack):
    client, url, _ = stack
    body = {"model": "kvyard-sim", "prompt": prefix(99), "max_tokens": 400}
    r = await client.post(url + "/v1/completions", json={**body, "max_tokens": 1})
    assert r.status_code == 200
    await asyncio.sleep(0.5)
    rs = await asyncio.gather(*(client.post(url + "/v1/completions", json={**body, "prompt": prefix(99) + f" v{k}"}) for k in range(24)))
    counts = Counter(r.headers["x-kvyard-worker"] for r in rs)
    assert all(r.status_code == 200 for r in rs)
    assert len(counts) >= 2, counts  # not everything on the one worker holding the prefix
    chosen_blocks, best_blocks = router_blocks((await client.get(url + "/metrics")).text)
    assert best_blocks > chosen_blocks  # the spread shows as affinity given up for load


def metric_sum(metrics_text: str, name: str, labels: str | None = None) -> float:
    """The sum of a metric's samples (`labels`: only the sample with exactly these labels; "" for an unlabelled one)."""
    start = name + "{" if labels is None else (f"{name}{{{labels}}} " if labels else name + " ")
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics_text.splitlines() if ln.startswith(start))


async def test_a_lazily_tokenized_prompt_is_counted_as_the_engine_counted_it(stack):
    """A long new prompt is tokenized only as far as routing needs (orchestrator/prepare.py): its count in the
    frontend's metrics is the engine's, not the estimate it routed with."""
    client, url, _ = stack
    before = metric_sum((await client.get(url + "/metrics")).text, "kvyard_input_sequence_tokens_sum")
    counted = 0
    for i, stream in enumerate((False, True, False)):
        body = {"model": "kvyard-sim", "prompt": prefix(500 + i) + "\nNaïve café, 中文 😀.", "max_tokens": 3}
        if stream:
            async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                usage = [ln for ln in [x async for x in r.aiter_lines()] if '"usage"' in ln and '"prompt_tokens"' in ln]
            counted += httpx.Response(200, content=usage[-1][6:]).json()["usage"]["prompt_tokens"]
        else:
            r = await client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            counted += r.json()["usage"]["prompt_tokens"]
    assert counted > 3 * 1900
    after = metric_sum((await client.get(url + "/metrics")).text, "kvyard_input_sequence_tokens_sum")
    assert after - before == counted


async def test_a_long_prompt_left_untokenized_is_learned_from_the_engine(stack):
    """A new long chat is tokenized only as far as routing needs; the engine (the sim in vLLM's flavor) sends the
    whole prompt's ids back on its first chunk, and the frontend learns the rest's chunks from them when the text
    comes again (orchestrator/token_cache.py, `offer`, `learn`): the next turn tokenizes only its new part."""
    client, url, _ = stack

    async def chunks() -> dict[str, float]:
        text = (await client.get(url + "/metrics")).text
        got = {s: metric_sum(text, "kvyard_prompt_chunks_total", f'source="{s}"') for s in ("cached", "tokenized", "learned")}
        return got | {"refused": metric_sum(text, "kvyard_prompt_learn_refused_total", "")}

    async def chat(messages) -> None:
        body = {"model": "kvyard-sim", "messages": messages, "max_tokens": 3, "stream": True}
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert [x async for x in r.aiter_lines() if x][-1] == "data: [DONE]"

    before = await chunks()
    turn = [{"role": "user", "content": prefix(700) + "\nSummarize the facts above, please."}]
    await chat(turn)
    now = await chunks()
    first = {k: now[k] - before[k] for k in now}
    assert first["tokenized"] <= 3 and first["learned"] == 0, first  # its start only; the engine's ids kept
    turn2 = turn + [{"role": "assistant", "content": "They are recorded."}, {"role": "user", "content": "And fact700-7?"}]
    await chat(turn2)
    second = {k: v - now[k] for k, v in (await chunks()).items()}
    # the history's chunks are learned from the first answer's ids; only the chunk where the new turn starts is
    # tokenized
    assert second["learned"] >= 5 and second["tokenized"] <= 2 and second["refused"] == 0, second


async def test_a_prompt_denser_than_its_start_gets_the_frontends_own_context_error(stack):
    """A long prompt that fits by its estimate (its tokenized start's density) is not counted exactly before it is
    sent (orchestrator/prepare.py, ESTIMATE_MARGIN); a hostile one, dense past its start, is refused by the engine,
    and the frontend then counts it and answers with its own context-length error, as when it counted first."""
    client, url, _ = stack
    rng = __import__("random").Random(5)
    start = " ".join(rng.choice(["plain", "words", "first", "then", "more"]) for _ in range(400))
    content = start + "\n" + "".join(rng.choice("中文字词😀") for _ in range(45000))  # ~45k tokens past 32,768
    routed = metric_sum((await client.get(url + "/metrics")).text, "kvyard_router_decisions_total")
    for stream in (False, True):
        body = {"model": "kvyard-sim", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "stream": stream}
        r = await client.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
        assert "maximum context length is 32768 tokens" in err["message"] and "your prompt has" in err["message"], err
    # the first was sent on its estimate and refused by the engine; its recheck cached the whole prompt's chunks, so
    # the second was counted exactly before it was sent, and refused by the frontend
    assert metric_sum((await client.get(url + "/metrics")).text, "kvyard_router_decisions_total") == routed + 1
