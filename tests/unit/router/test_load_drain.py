"""Prefill drain (router/load.py): booked prefill drains FCFS at each worker's measured prefill rate."""

from __future__ import annotations

import random

import pytest

from router.load import LoadTracker


def pf(t: LoadTracker, wid: str = "w0") -> float:
    return t.load(wid).prefill_tokens


def test_without_a_sample_nothing_drains():
    t = LoadTracker(drain=True)
    t.on_routed("a", "w0", 1000, 16, now=0.0)
    t.advance(now=5.0)
    assert pf(t) == 1000  # no measured rate yet: the booked figure, as without drain


def test_rate_is_learned_from_first_tokens_and_drains_front_first():
    t = LoadTracker(drain=True)
    t.on_routed("a", "w0", 1000, 16, now=0.0)
    t.on_first_token("a", now=0.5)  # 1000 tokens in 0.5 s: 2000 tok/s
    assert t.prefill_rate("w0") == pytest.approx(2000)
    assert pf(t) == 0
    t.on_routed("b", "w0", 3000, 16, now=1.0)
    t.on_routed("c", "w0", 500, 16, now=1.0)
    t.advance(now=2.0)  # 2000 tokens served: all from b (first come, first served)
    assert pf(t) == pytest.approx(1500)
    assert t._active["b"].remaining == pytest.approx(1000) and t._active["c"].remaining == 500
    t.advance(now=2.6)  # 1200 more: the rest of b, 200 of c
    assert pf(t) == pytest.approx(300)
    t.advance(now=10.0)  # never below zero: the estimate waits for the first token
    assert pf(t) == 0
    assert t._active["c"].prefill_tokens == 500  # still booked (released by its first token or completion)


def test_a_first_token_ends_the_prefill_of_everything_routed_before_it():
    t = LoadTracker(drain=True)
    for rid in "abc":
        t.on_routed(rid, "w0", 100, 16, now=0.0)
    t.on_first_token("b", now=0.1)  # FCFS: a is done too
    assert pf(t) == 100  # only c is left
    assert t.prefill_rate("w0") == pytest.approx(2000)  # a and b: 200 tokens in 0.1 s
    t.on_first_token("a", now=0.2)  # late: already counted, changes nothing
    assert pf(t) == 100 and t.prefill_rate("w0") == pytest.approx(2000)
    t.on_first_token("c", now=0.3)
    assert pf(t) == 0


def test_idle_time_is_not_counted_as_serving():
    t = LoadTracker(drain=True)
    t.on_routed("a", "w0", 1000, 16, now=0.0)
    t.on_first_token("a", now=1.0)
    t.on_routed("b", "w0", 1000, 16, now=50.0)  # the worker sat idle 49 s
    t.on_first_token("b", now=51.0)
    assert t.prefill_rate("w0") == pytest.approx(1000)


def test_completion_before_the_first_token_releases_what_is_left():
    t = LoadTracker(drain=True)
    t.on_routed("a", "w0", 1000, 16, now=0.0)
    t.on_first_token("a", now=1.0)  # 1000 tok/s
    t.on_routed("b", "w0", 1000, 16, now=2.0)
    t.on_routed("c", "w0", 1000, 16, now=2.0)
    t.advance(now=2.4)
    assert pf(t) == pytest.approx(1600)
    t.on_complete("b")  # cancelled mid-prefill: its 600 left go, c stays whole
    assert pf(t) == pytest.approx(1000)
    t.on_complete("c")
    t.on_complete("a")
    assert pf(t) == 0 and t.load("w0").inflight_requests == 0 and not t._drains["w0"].queue


def test_fully_cached_prompts_do_not_join_the_queue():
    t = LoadTracker(drain=True)
    t.on_routed("a", "w0", 64, 16, now=0.0, cached_tokens=64)
    assert not t._drains.get("w0") or not t._drains["w0"].queue
    t.on_first_token("a", now=0.1)
    assert pf(t) == 0


def test_remove_worker_forgets_its_queue():
    t = LoadTracker(drain=True)
    t.on_routed("a", "w0", 100, 16, now=0.0)
    t.remove_worker("w0")
    assert "w0" not in t._drains
    t.on_first_token("a", now=1.0)  # a callback after removal is harmless
    t.on_complete("a")


def test_drain_off_is_the_booked_figure():
    t = LoadTracker(drain=False)
    t.on_routed("a", "w0", 1000, 16, now=0.0)
    t.on_first_token("a", now=0.5)
    t.on_routed("b", "w0", 1000, 16, now=1.0)
    t.advance(now=5.0)
    assert pf(t) == 1000 and t.prefill_rate("w0") is None


def test_random_callbacks_keep_the_books_exact():
    """Any order of routes, advances, first tokens and completions: the load never goes negative, never
    exceeds what is booked, and is exactly zero once everything completed."""
    rng = random.Random(3)
    t = LoadTracker(drain=True)
    now, live, n = 0.0, [], 0
    for _ in range(3000):
        now += rng.random() * 0.01
        op = rng.random()
        if op < 0.35 or not live:
            rid = f"r{n}"
            n += 1
            t.on_routed(rid, f"w{rng.randrange(3)}", rng.randrange(1, 5000), 16, now=now, cached_tokens=rng.choice((0, 0, 64)))
            live.append(rid)
        elif op < 0.6:
            t.on_first_token(rng.choice(live), now=now)
        elif op < 0.8:
            rid = live.pop(rng.randrange(len(live)))
            t.on_complete(rid)
        else:
            t.advance(now=now)
        for w in ("w0", "w1", "w2"):
            booked = sum(a.prefill_tokens for a in t._active.values() if a.worker_id == w)
            assert -1e-6 <= pf(t, w) <= booked + 1e-6
    for rid in live:
        t.on_complete(rid)
    for w in ("w0", "w1", "w2"):
        assert pf(t, w) == 0 and t.load(w).inflight_requests == 0 and t.load(w).active_blocks == 0


def test_prompts_estimated_done_are_not_walked_again():
    """advance() moves what it drains out of the queue it walks; their first tokens still settle them in order."""
    t = LoadTracker(drain=True)
    t.on_routed("warm", "w0", 1000, 16, now=0.0)
    t.on_first_token("warm", now=0.001)  # 1M tok/s
    for i in range(500):
        t.on_routed(f"r{i}", "w0", 100, 16, now=1.0)  # identical fields: each must still be told apart
    t.advance(now=1.0 + 0.02495)  # ~24,950 tokens: 249 prompts done, the 250th half
    dr = t._drains["w0"]
    assert (len(dr.drained), len(dr.queue)) == (249, 251) and pf(t) == pytest.approx(25_050, abs=1)
    t.on_first_token("r300", now=1.1)  # FCFS: r0..r300 are done, whether estimated so or not
    assert (len(dr.drained), len(dr.queue)) == (0, 199) and pf(t) == pytest.approx(19_900)
    assert t._active["r300"].prefill_tokens == 0 and t._active["r301"].prefill_tokens == 100
