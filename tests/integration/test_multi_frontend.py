"""Several frontends over the same Redis-discovered workers converge to the same KV index.

Three `kvyard worker` processes (sim engines) and two `kvyard frontend` processes
(policy kv) share one Redis discovery prefix. Traffic goes through frontend A only; frontend B learns
the cache contents from the workers' KV events alone, so:

  - both report the same indexed blocks per worker (GET /api/cluster, kv.indexed_blocks), and
  - B routes every follow-up of a prefix to the worker A placed it on (B never saw those prompts).

Then B is killed (SIGKILL: no goodbye) and a new frontend starts in its place: on connecting it replays
each worker's event buffer from the start, so within seconds of seeing the workers its index equals A's
again and its route decisions agree with A's.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from orchestrator.testing.procs import KvyardCluster, full_blocks

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MODEL = "simmodel"
WORKERS = 3
PREFIXES = 6
REBUILD_S = 5.0  # a restarted frontend's index must match within this long of seeing the workers


@pytest.fixture
async def cluster(redis_url, tmp_path):
    c = KvyardCluster(redis_url, tmp_path, MODEL, prefix=f"kvyard-mf-{uuid.uuid4().hex[:8]}", max_model_len=4096)
    yield c
    c.stop()


async def wait_ready(cluster: KvyardCluster, frontend: str) -> str:
    """The frontend's URL once it sees every worker ready (2 busy cores: a worker once took > 90 s to join)."""
    await cluster.wait_ready(frontend, WORKERS, timeout=180)
    return cluster.url(frontend)


def prompt(i: int, q: int) -> str:
    return f"Manual {i}: " + " ".join(f"step {i}.{j} turns valve {j % 7}." for j in range(250)) + f" Question {q}?"


async def indexed(http: httpx.AsyncClient, url: str) -> dict[str, int]:
    return (await http.get(url + "/api/cluster")).json()["kv"]["indexed_blocks"]


async def route(http: httpx.AsyncClient, url: str, i: int, q: int) -> str:
    r = await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt(i, q), "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.headers["x-kvyard-worker"]


async def converged(http: httpx.AsyncClient, a: str, b: str, timeout: float, need: dict[str, int]) -> tuple[dict[str, int], float]:
    """Wait until a and b index the same blocks per worker, at least `need` on each; returns it and the wait.
    Equal counts alone are met by the first of several event batches, before the others arrive."""
    t0 = time.monotonic()
    while True:
        ia, ib = await indexed(http, a), await indexed(http, b)
        if ia == ib and all(ia.get(w, 0) >= n for w, n in need.items()):
            return ia, time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, f"indexes after {timeout:.1f} s: A {ia} vs B {ib}, need {need}"
        await asyncio.sleep(0.05)


async def test_frontends_converge_and_a_restarted_one_rebuilds(cluster: KvyardCluster) -> None:
    for i in range(WORKERS):
        cluster.add_worker(f"w{i}", speedup=20)
    cluster.add_frontend("fa")
    cluster.add_frontend("fb")
    async with httpx.AsyncClient(timeout=60) as http:
        a = await wait_ready(cluster, "fa")
        b = await wait_ready(cluster, "fb")

        # Traffic through A only; first sight of each prefix, concurrently so the load term spreads them.
        holder = dict(enumerate(await asyncio.gather(*(route(http, a, i, 0) for i in range(PREFIXES)))))
        assert len(set(holder.values())) >= 2, holder
        need = full_blocks((w, prompt(i, 0)) for i, w in holder.items())  # every prefix indexed on its holder, in both
        await converged(http, a, b, timeout=10, need=need)

        # B never saw these prompts: its decisions come from the workers' events alone, and agree with A's.
        for i in range(PREFIXES):
            assert await route(http, b, i, 1) == holder[i], f"B routed prefix {i} away from {holder[i]}"
        await converged(http, a, b, timeout=10, need=need)

        # Kill B without a goodbye; a new frontend replays the workers' event buffers and catches up.
        cluster.frontends["fb"].kill()
        started = time.monotonic()
        cluster.add_frontend("fc")
        c = await wait_ready(cluster, "fc")
        _, took = await converged(http, a, c, timeout=REBUILD_S, need=need)
        since_start = time.monotonic() - started
        for i in range(PREFIXES):
            assert await route(http, c, i, 2) == holder[i], f"restarted frontend routed prefix {i} away from {holder[i]}"
        for i in range(PREFIXES):
            assert await route(http, a, i, 3) == holder[i]
        print(f"restarted frontend: index equal to A's {took:.2f} s after it saw the workers, {since_start:.1f} s after its process started")
