"""Circuit breakers, jittered retries and deadlines: no hang, a failing worker is taken out and brought back."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from orchestrator.resilience.breaker import BreakerBoard, BreakerState, backoff_s

from orchestrator.testing import FaultEngine
from .test_migration import add, counter, frontend, over, sse, winfo  # noqa: F401  (frontend, over: fixtures)


# ---- breaker state machine ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_breaker_transitions():
    clock, healthy, changes = Clock(), {"ok": False}, []

    async def probe(wid: str) -> bool:
        return healthy["ok"]

    b = BreakerBoard(failure_threshold=3, open_s=5.0, max_open_s=12.0, probe=probe,
                     on_change=lambda w, s: changes.append((w, s)), clock=clock)
    b.failure("w", "x")
    b.failure("w", "x")
    assert b.allows("w")
    b.success("w")  # resets the consecutive count
    b.failure("w", "x")
    b.failure("w", "x")
    assert b.allows("w")
    b.failure("w", "x")
    assert b.state("w") == BreakerState.OPEN and not b.allows("w")
    assert b.retry_after_s() == pytest.approx(5.0)
    await b.probe_due()  # cooldown not over: no probe
    assert changes == [("w", BreakerState.OPEN)]
    clock.t += 5.0
    await b.probe_due()  # probe fails: open again, cooldown doubled
    assert changes[-2:] == [("w", BreakerState.HALF_OPEN), ("w", BreakerState.OPEN)]
    assert b.retry_after_s() == pytest.approx(10.0)
    clock.t += 10.0
    await b.probe_due()
    assert b.retry_after_s() == pytest.approx(12.0)  # capped at max_open_s
    clock.t += 12.0
    healthy["ok"] = True
    await b.probe_due()
    assert b.state("w") == BreakerState.CLOSED and b.allows("w")
    assert changes[-1] == ("w", BreakerState.CLOSED)
    b.prune(set())
    assert b.snapshot() == {}


async def test_probe_that_raises_is_a_failed_probe():
    clock = Clock()

    async def probe(wid: str) -> bool:
        raise RuntimeError("boom")

    b = BreakerBoard(failure_threshold=1, open_s=1.0, probe=probe, clock=clock)
    b.failure("w")
    clock.t += 1.0
    await b.probe_due()
    assert b.state("w") == BreakerState.OPEN


def test_backoff_full_jitter_bounds():
    rng = random.Random(1)
    for attempt in range(1, 8):
        ceiling = min(1.0, 0.05 * 2 ** (attempt - 1))
        xs = [backoff_s(attempt, 0.05, 1.0, rng) for _ in range(400)]
        assert all(0.0 <= x <= ceiling for x in xs)
        assert max(xs) > 0.8 * ceiling and min(xs) < 0.2 * ceiling  # spread over the whole range: jittered
    assert backoff_s(0, 0.05, 1.0) == 0.0
    assert backoff_s(3, 0.0, 1.0) == 0.0


# ---- through the frontend ------------------------------------------------------------------------------


@pytest.mark.parametrize("frontend", [{"resilience": {"breaker_failure_threshold": 2, "breaker_open_s": 0.3, "breaker_max_open_s": 0.6}}], indirect=True)
async def test_failing_worker_opened_skipped_and_brought_back(frontend):
    client, disc = frontend
    with FaultEngine("a") as a, FaultEngine("b") as b:
        a.fail_status = 500
        a.health = 503
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        # every request succeeds (retried on b); a's breaker opens after its 2nd failure. The picker breaks
        # ties at random, so send until a has been tried twice (all 40 missing it: chance 2**-39)
        for _ in range(40):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
            if len(a.requests) >= 2:
                break
        service = client.app.state.service
        assert len(a.requests) == 2 and service.breakers.state("a") != BreakerState.CLOSED
        for _ in range(6):  # open (or half-open, probing /health): skipped by routing
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
        assert len(a.requests) == 2
        assert counter(client, "kvyard_breaker_state", worker="a") >= 1
        # health checks fail while it is down, then pass once it recovers: the breaker closes
        for _ in range(100):
            await asyncio.sleep(0.1)
            if a.health_checks >= 1:
                break
        assert a.health_checks >= 1 and service.breakers.state("a") != BreakerState.CLOSED
        a.fail_status, a.health = None, 200
        for _ in range(150):
            await asyncio.sleep(0.1)
            if service.breakers.state("a") == BreakerState.CLOSED:
                break
        assert service.breakers.state("a") == BreakerState.CLOSED
        assert counter(client, "kvyard_breaker_transitions_total", worker="a", state="closed") == 1
        before = len(a.requests)
        # idle, equally scored workers: the picker breaks the tie at random, so 16 sequential requests all
        # missing a (chance 2**-16) would mean it is still excluded
        for _ in range(16):
            await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert len(a.requests) > before  # routed to again


@pytest.mark.parametrize("frontend", [{"resilience": {"breaker_failure_threshold": 1, "breaker_open_s": 30}}], indirect=True)
async def test_all_breakers_open_is_503_with_retry_after(frontend):
    client, disc = frontend
    with FaultEngine("a") as a:
        a.fail_status = 502
        await add(disc, client, winfo("a", a.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and "health checks" in r.json()["error"]["message"]
        assert 25 <= int(r.headers["retry-after"]) <= 30
        assert len(a.requests) == 1


@pytest.mark.parametrize("frontend", [{"resilience": {"stream_headers_timeout_s": 0.5, "first_byte_timeout_s": 0.5}}], indirect=True)
@pytest.mark.parametrize("stream", [True, False])
async def test_hung_engine_is_abandoned_and_the_request_served_elsewhere(frontend, stream):
    client, disc = frontend
    with FaultEngine("a", plan=[{"hang": True}]) as a, FaultEngine("b", plan=a.plan) as b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3, "stream": stream})
        took = time.perf_counter() - t0
        assert r.status_code == 200 and took < 3.0
        if stream:
            assert sse(r.text)[-1] == "[DONE]" and "error" not in r.text
        assert len(a.requests) + len(b.requests) == 2
        assert counter(client, "kvyard_engine_retries_total", model="m") == 1


@pytest.mark.parametrize("frontend", [{"resilience": {"stream_idle_timeout_s": 0.5}}], indirect=True)
async def test_engine_stalling_mid_stream_is_migrated(frontend):
    client, disc = frontend
    with FaultEngine("a", plan=[{"stall_after": 2}]) as a, FaultEngine("b", plan=a.plan) as b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 5, "stream": True})
        assert time.perf_counter() - t0 < 3.0
        events = sse(r.text)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
        assert "".join(e["choices"][0]["text"] for e in events[:-1]).count(" ") == 5
        assert counter(client, "kvyard_migrations_total", model="m", outcome="migrated") == 1


@pytest.mark.parametrize("frontend", [{"resilience": {"request_timeout_s": 0.6, "stream_headers_timeout_s": 5, "first_byte_timeout_s": 5}}], indirect=True)
async def test_total_deadline_ends_a_hung_request_cleanly(frontend):
    client, disc = frontend
    with FaultEngine("a") as a:
        a.hang = True
        await add(disc, client, winfo("a", a.url))
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        assert time.perf_counter() - t0 < 3.0
        assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "deadline" in r.json()["error"]["message"]
        assert counter(client, "kvyard_request_deadline_exceeded_total", model="m") == 1


@pytest.mark.parametrize("frontend", [{"resilience": {"first_byte_timeout_s": 0.5}}], indirect=True)
async def test_unary_broken_mid_body_is_resent(frontend):
    client, disc = frontend
    with FaultEngine("a") as a, FaultEngine("b") as b:
        await add(disc, client, winfo("a", a.url), winfo("b", b.url))
        service = client.app.state.service
        calls = {"n": 0}
        real = service.client.start_post

        def flaky(*args, **kwargs):
            sent = real(*args, **kwargs)

            async def answered():
                resp = await sent
                calls["n"] += 1
                if calls["n"] == 1:  # the first answer's body breaks while being read
                    from orchestrator.engine_client import EngineStreamError

                    async def broken():
                        raise EngineStreamError("ClientPayloadError: reset")
                    resp.aread = broken
                return resp
            return asyncio.ensure_future(answered())

        service.client.start_post = flaky
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert calls["n"] == 2
        assert counter(client, "kvyard_engine_retries_total", model="m") == 1
        assert client.app.state.router.loads.load("a").inflight_requests == 0
        assert client.app.state.router.loads.load("b").inflight_requests == 0
