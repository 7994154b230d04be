"""Routing policies, scoring framework and load bookkeeping, driven with literals."""

from __future__ import annotations

from collections import Counter

import pytest

from router import Endpoint, EndpointLoad, LoadTracker, NoEndpointsError, RouteRequest, Router, build_policy
from router.plugins.load import LoadScorer


def eps(n: int) -> list[Endpoint]:
    return [Endpoint(worker_id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", model="m", block_size=16) for i in range(n)]


def req(i: int, isl: int = 32) -> RouteRequest:
    return RouteRequest(request_id=f"r{i}", model="m", token_ids=list(range(isl)))


def test_round_robin_cycles_in_id_order():
    r = Router("round-robin")
    picks = [r.route(req(i), eps(3)).best.worker_id for i in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_ranking_contains_every_endpoint_once():
    for name in ("round-robin", "random", "least-loaded"):
        d = Router(name).route(req(0), eps(4))
        assert sorted(e.worker_id for e in d.ranked) == ["w0", "w1", "w2", "w3"], name


def test_random_spreads():
    r = Router("random")
    counts = Counter(r.route(req(i), eps(4)).best.worker_id for i in range(400))
    for c in counts:
        r.on_complete(c)
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert min(counts.values()) > 50  # 100 expected each


def test_least_loaded_sees_its_own_inflight_requests():
    # no engine metrics at all: the router's own bookkeeping alone must spread concurrent requests
    r = Router("least-loaded")
    picks = [r.route(req(i), eps(4)).best.worker_id for i in range(8)]
    assert Counter(picks) == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}


def test_least_loaded_prefers_worker_after_completion():
    r = Router("least-loaded")
    first = [r.route(req(i), eps(2)).best.worker_id for i in range(2)]
    r.on_complete("r0")  # r0's worker is now idle
    assert r.route(req(9), eps(2)).best.worker_id == first[0]


def test_least_loaded_counts_engine_queue():
    e = eps(2)
    e[0].load = EndpointLoad(engine_waiting=10)
    assert Router("least-loaded").route(req(0), e).best.worker_id == "w1"


@pytest.mark.parametrize(
    "loads, expected",
    [
        ([0, 0], {"w0": 1.0, "w1": 1.0}),  # idle fleet: all equal
        ([2, 0], {"w0": 0.0, "w1": 1.0}),  # busiest scores 0
        ([4, 2], {"w0": 0.0, "w1": 0.5}),
    ],
)
def test_load_scorer_values(loads, expected):
    e = eps(2)
    for ep, n in zip(e, loads):
        ep.load = EndpointLoad(inflight_requests=n)
    assert LoadScorer().score(req(0), e) == expected


def test_no_endpoints_raises():
    with pytest.raises(NoEndpointsError):
        Router().route(req(0), [])


def test_unknown_policy_named_in_error():
    with pytest.raises(ValueError, match="bogus"):
        build_policy("bogus")


def test_tracker_first_token_and_complete():
    t = LoadTracker()
    t.on_routed("a", "w0", prompt_tokens=40, block_size=16)
    ld = t.load("w0")
    assert (ld.inflight_requests, ld.prefill_tokens, ld.active_blocks) == (1, 40, 3)  # ceil(40/16)=3
    t.on_first_token("a")
    t.on_first_token("a")  # idempotent
    assert (ld.inflight_requests, ld.prefill_tokens, ld.active_blocks) == (1, 0, 3)
    t.on_complete("a")
    t.on_complete("a")  # idempotent
    assert (ld.inflight_requests, ld.prefill_tokens, ld.active_blocks) == (0, 0, 0)


def test_tracker_expires_lost_requests():
    t = LoadTracker(ttl_s=10)
    t.on_routed("a", "w0", 16, 16, now=0.0)
    t.on_routed("b", "w0", 16, 16, now=5.0)
    assert t.expire(now=12.0) == 1
    assert t.load("w0").inflight_requests == 1


def test_failover_rebooks_load():
    r = Router("round-robin")
    rq = req(0)
    d = r.route(rq, eps(2))
    r.on_complete(rq.request_id)
    r.book(rq, d.ranked[1])
    assert r.loads.load(d.ranked[0].worker_id).inflight_requests == 0
    assert r.loads.load(d.ranked[1].worker_id).inflight_requests == 1


def test_remove_worker_forgets_load():
    r = Router("least-loaded")
    r.route(req(0), eps(1))
    r.remove_worker("w0")
    assert r.loads.load("w0").inflight_requests == 0


def test_kv_fast_path_ranks_and_scores_as_the_generic_path(impl):
    """Router.route scores and ranks the kv policy in one kernel pass; a policy that takes the generic path (a
    softmax picker at temperature 0 is the same argmax, with the same seed) gets the same rankings and scores."""
    import random

    from router import KvIndex
    from router.plugins import KvCostScorer, SoftmaxPicker
    from router.policies import Policy

    rng = random.Random(4)
    # prefill drain off: it advances on the wall clock, which the two routers read at different times
    fast = Router(build_policy("kv", overlap_weight=16.0, reuse_weight=8.0, request_weight=16.0, index=KvIndex(), seed=3),
                  LoadTracker(drain=False))
    slow = Router(Policy("kv", SoftmaxPicker(0.0, seed=3), [(KvCostScorer(16.0, 8.0, 16.0), 1.0)], KvIndex()),
                  LoadTracker(drain=False))
    for r in (fast, slow):  # the same cached prefix on two of the workers
        for w in ("w1", "w3"):
            r.kv_index.store(w, [1, 2, 3], None, list(range(48)), 16)
    for k in range(300):
        toks = list(range(48)) + [rng.randrange(1000) for _ in range(rng.randrange(0, 80))] if rng.random() < 0.5 else \
            [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 120))]
        got = []
        first, done = rng.random() < 0.5, rng.random() < 0.4
        for r in (fast, slow):
            eps = [Endpoint(worker_id=f"w{i}", url="u", model="m") for i in range(6)]
            d = r.route(RouteRequest(f"q{k}", "m", list(toks)), eps)
            assert (d._packed is not None) == (r is fast)  # which path each took
            got.append(([ep.worker_id for ep in d.ranked], d.scores, d.overlap_blocks))
            if first:
                r.on_first_token(f"q{k}")
            if done:
                r.on_complete(f"q{k}")
        assert got[0] == got[1]
