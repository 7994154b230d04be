"""Admission: a bounded queue per model; 503 + Retry-After when the fleet is saturated, 429 for a key over
its rate; max_tokens capped with a 400."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.errors import RateLimitError, ServiceUnavailableError
from orchestrator.resilience.admission import AdmissionController, worker_saturated
from workers.types import EngineMetrics

from orchestrator.testing import FaultEngine
from .test_migration import add, counter, frontend, over, winfo  # noqa: F401  (frontend, over: fixtures)


async def test_slots_queue_and_fifo_order():
    ctl = AdmissionController(max_inflight=2, max_queued=2, queue_timeout_s=5, retry_after_s=3)
    t1, t2 = await ctl.admit("m"), await ctl.admit("m")
    order = []

    async def wait(tag):
        t = await ctl.admit("m")
        order.append(tag)
        return t

    w1 = asyncio.create_task(wait(1))
    await asyncio.sleep(0)
    w2 = asyncio.create_task(wait(2))
    await asyncio.sleep(0.01)
    assert ctl.queued("m") == 2 and ctl.inflight("m") == 2
    with pytest.raises(ServiceUnavailableError) as e:  # queue full: at once
        await ctl.admit("m")
    assert e.value.retry_after == 3 and e.value.status == 503
    t1.release()
    t1.release()  # idempotent
    t3 = await w1
    assert order == [1] and ctl.inflight("m") == 2
    t2.release()
    t4 = await w2
    assert order == [1, 2] and t4.queued_s > 0
    t3.release(), t4.release()
    assert ctl.inflight("m") == 0 and ctl.queued("m") == 0
    await ctl.close()


async def test_queue_timeout_is_503_and_frees_its_place():
    rejected = []
    ctl = AdmissionController(max_inflight=1, max_queued=4, queue_timeout_s=0.1, on_reject=lambda m, r: rejected.append(r))
    t = await ctl.admit("m")
    with pytest.raises(ServiceUnavailableError):
        await ctl.admit("m")
    assert rejected == ["queue_timeout"] and ctl.queued("m") == 0
    t.release()
    (await ctl.admit("m")).release()
    await ctl.close()


async def test_cancelled_waiter_leaves_no_slot_behind():
    ctl = AdmissionController(max_inflight=1, max_queued=4, queue_timeout_s=5)
    t = await ctl.admit("m")
    w = asyncio.create_task(ctl.admit("m"))
    await asyncio.sleep(0.01)
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    t.release()
    assert ctl.inflight("m") == 0 and ctl.queued("m") == 0
    await ctl.close()


async def test_a_waiter_granted_and_cancelled_in_the_same_turn_hands_its_slot_back():
    """The grant sets the waiter's future; the client leaving cancels its task before it wakes: the slot it was given
    must go to the next waiter (or back), not leak."""
    ctl = AdmissionController(max_inflight=1, max_queued=4, queue_timeout_s=5)
    t = await ctl.admit("m")
    w = asyncio.create_task(ctl.admit("m"))
    w2 = asyncio.create_task(ctl.admit("m"))
    await asyncio.sleep(0.01)
    assert ctl.queued("m") == 2
    t.release()  # grants w's future ...
    w.cancel()   # ... and w's client leaves before w runs
    await asyncio.gather(w, return_exceptions=True)
    t2 = await asyncio.wait_for(w2, 1)  # the slot went on to the next waiter
    assert ctl.inflight("m") == 1
    t2.release()
    assert ctl.inflight("m") == 0 and ctl.queued("m") == 0
    await ctl.close()


async def test_saturation_holds_requests_until_it_clears():
    state = {"full": True}
    ctl = AdmissionController(max_queued=4, queue_timeout_s=5, saturated=lambda m: state["full"], recheck_s=0.02)
    w = asyncio.create_task(ctl.admit("m"))
    await asyncio.sleep(0.1)
    assert not w.done() and ctl.queued("m") == 1
    state["full"] = False  # the next scrape shows room: the poller admits it
    t = await asyncio.wait_for(w, 1)
    t.release()
    await ctl.close()


async def test_rate_limiter_hook_is_429():
    seen = []

    def limiter(key_id, model):
        seen.append((key_id, model))
        if key_id == "greedy":
            raise RateLimitError("key over its rate", retry_after=2)

    ctl = AdmissionController(rate_limiter=limiter)
    (await ctl.admit("m", "k1")).release()
    with pytest.raises(RateLimitError) as e:
        await ctl.admit("m", "greedy")
    assert e.value.status == 429 and seen == [("k1", "m"), ("greedy", "m")]
    assert ctl.inflight("m") == 0


def test_worker_saturated_needs_both_signals():
    assert worker_saturated(0.95, 2, 0.9, 1)
    assert not worker_saturated(0.95, 0, 0.9, 1)
    assert not worker_saturated(0.5, 9, 0.9, 1)
    assert not worker_saturated(None, 9, 0.9, 1)


# ---- through the frontend ------------------------------------------------------------------------------


@pytest.mark.parametrize("frontend", [{"admission": {"max_inflight_per_model": 1, "max_queued_per_model": 1, "timeout_s": 5}, "resilience": {"retry_after_s": 4}}], indirect=True)
async def test_frontend_sheds_beyond_the_queue_with_retry_after(frontend):
    client, disc = frontend
    with FaultEngine("a", plan=[{"stall_after": 1}]) as a:
        await add(disc, client, winfo("a", a.url))
        body = {"model": "m", "prompt": "x", "max_tokens": 3}
        slow = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": True}))  # holds the slot
        await asyncio.sleep(0.3)
        queued = asyncio.create_task(client.post("/v1/completions", json=body))  # waits in the queue
        await asyncio.sleep(0.2)
        r = await client.post("/v1/completions", json=body)  # queue full
        assert r.status_code == 503 and r.headers["retry-after"] == "4"
        assert r.json()["error"]["code"] == "overloaded"
        assert counter(client, "kvyard_admission_rejected_total", model="m", reason="queue_full") == 1
        assert counter(client, "kvyard_admission_queue", model="m") == 1
        slow.cancel()  # the client of the stalled stream leaves: its slot goes to the queued request
        await asyncio.gather(slow, return_exceptions=True)
        r = await asyncio.wait_for(queued, 5)
        assert r.status_code == 200


@pytest.mark.parametrize("frontend", [{"admission": {"timeout_s": 0.3, "saturation_kv_usage": 0.9, "saturation_waiting": 1}}], indirect=True)
async def test_saturated_fleet_queues_then_503(frontend):
    client, disc = frontend
    with FaultEngine("a") as a:
        await add(disc, client, winfo("a", a.url))
        pool = client.app.state.pool
        pool._scrape_one = _noop  # keep the metrics this test sets: no scrape (the pool's own loop's included) overwrites them
        await asyncio.gather(*(w.scrape_task for w in pool.workers.values() if w.scrape_task is not None), return_exceptions=True)
        pool.workers["a"].metrics = EngineMetrics(num_requests_waiting=3, kv_cache_usage=0.97)
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "retry-after" in r.headers
        assert counter(client, "kvyard_admission_rejected_total", model="m", reason="queue_timeout") == 1
        assert a.requests == []
        pool.workers["a"].metrics = EngineMetrics(num_requests_waiting=0, kv_cache_usage=0.97)
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200


async def _noop(*_args) -> None:
    return None


@pytest.mark.parametrize("frontend", [{"max_tokens_cap": 16}], indirect=True)
async def test_max_tokens_cap(frontend):
    client, disc = frontend
    with FaultEngine("a") as a:
        await add(disc, client, winfo("a", a.url))
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 17})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                            "max_completion_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})  # none asked: the cap is filled in
        assert r.status_code == 200 and a.requests[-1]["body"]["max_tokens"] == 16
        assert a.requests[0]["body"]["max_tokens"] == 16 and len(a.requests) == 1


def test_cli_flags_reach_the_config():
    from orchestrator.cli import build_parser, frontend_config

    ns = build_parser().parse_args(["frontend", "--max-migrations", "1", "--request-timeout", "60", "--max-inflight", "8",
                                     "--max-queued", "16", "--max-tokens-cap", "512"])
    cfg = frontend_config(ns)
    rc, ac = cfg.resilience, cfg.admission
    assert (rc.max_migrations, rc.request_timeout_s, ac.max_inflight_per_model, ac.max_queued_per_model, cfg.max_tokens_cap) == (1, 60, 8, 16, 512)
