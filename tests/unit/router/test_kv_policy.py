"""The kv policy: exact cost, tie-breaking, softmax, hot-prefix spreading, affinity under mild imbalance."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from router import Endpoint, EndpointLoad, KvIndex, RouteRequest, Router, block_hashes, build_policy
from router.plugins import KvCostScorer, SoftmaxPicker
from router.plugins.kv import kv_logits

BS = 16


def eps(n: int, bs: int = BS) -> list[Endpoint]:
    return [Endpoint(worker_id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", model="m", block_size=bs) for i in range(n)]


PREFIX = list(range(1000, 1000 + 3072))  # 192 blocks: a long shared system prompt


def req(i: int, prefix=PREFIX, tail: int = 1024, lora=None) -> RouteRequest:
    rng = random.Random(i)
    return RouteRequest(request_id=f"r{i}", model="m", token_ids=prefix + [rng.randrange(50_000) for _ in range(tail)], lora_name=lora)


def cache(index: KvIndex, wid: str, tokens: list[int], bs: int = BS, lora=None) -> None:
    """Index `tokens`' full blocks on `wid` as one BlockStored event would."""
    n = len(tokens) // bs
    base = hash(wid) & 0xFFFFFFFF
    index.store(wid, [base * 100_000 + i for i in range(n)], None, tokens[: n * bs], bs, lora)


@pytest.mark.parametrize(
    "isl, overlap, pf, ab, w, expected",
    [
        # logit = w·(isl − ov·B + pf)/B + (ceil(isl/B) − ov + ab)
        (4096, 0, 0, 0, 1.0, 256 + 256),
        (4096, 192, 0, 0, 1.0, 64 + 64),
        (4096, 192, 1600, 300, 1.0, (4096 - 3072 + 1600) / 16 + (256 - 192 + 300)),
        (4100, 0, 0, 0, 1.0, 4100 / 16 + 257),  # a partial last block counts as a block to hold
        (4096, 192, 0, 0, 0.0, 64),  # overlap_weight 0: decode blocks only (as Dynamo's decode routing)
        (4096, 192, 0, 0, 2.5, 2.5 * 64 + 64),
    ],
)
def test_logit_is_dynamos_formula(isl, overlap, pf, ab, w, expected):
    r = RouteRequest("r", "m", list(range(isl)), overlap_blocks={"w0": overlap}, hashed_block_size=BS)
    ep = eps(1)
    ep[0].load = EndpointLoad(prefill_tokens=pf, active_blocks=ab)
    assert kv_logits(r, ep, w) == [pytest.approx(expected)]


def test_scores_are_normalised_negated_logits(impl):
    e = eps(4)
    for ep, (pf, ab) in zip(e, [(0, 0), (1600, 0), (0, 500), (3200, 100)]):
        ep.load = EndpointLoad(prefill_tokens=pf, active_blocks=ab)
    r = RouteRequest("r", "m", list(range(4096)), overlap_blocks={"w1": 100, "w3": 192}, hashed_block_size=BS)
    logits = kv_logits(r, e)
    lo, hi = min(logits), max(logits)
    scores = KvCostScorer().score(r, e)
    assert list(scores) == ["w0", "w1", "w2", "w3"]
    assert scores == {ep.worker_id: pytest.approx((hi - x) / (hi - lo)) for ep, x in zip(e, logits)}
    assert max(scores.values()) == 1.0 and min(scores.values()) == 0.0


def test_c_and_python_scores_are_bit_identical():
    from router._kernels import IMPLEMENTATION, kv_scores, py_kv_scores

    if IMPLEMENTATION != "c":
        pytest.skip("router._kvcore is not built")
    rng = random.Random(7)
    for _ in range(200):
        e = eps(rng.randrange(1, 80), bs=rng.choice([16, 32]))
        for ep in e:
            ep.load = EndpointLoad(prefill_tokens=rng.randrange(0, 9000), active_blocks=rng.randrange(0, 900))
            ep.block_size = rng.choice([16, 16, 32])
        ov = {ep.worker_id: rng.randrange(0, 300) for ep in e if rng.random() < 0.3}
        args = (e, ov, rng.randrange(0, 9000), 16, rng.choice([0.0, 1.0, 2.5]))
        assert kv_scores(*args) == py_kv_scores(*args)
        reuse = rng.choice([0.0, 1.0, 2.0, 3.5])
        assert kv_scores(*args, reuse) == py_kv_scores(*args, reuse)


@pytest.mark.parametrize("reuse, expected", [(1.0, "w1"), (2.0, "w0")])
def test_reuse_weight_values_a_cached_token_above_a_pending_one(impl, reuse, expected):
    """w0 holds 192 of the prompt's 256 blocks but has 4,000 prefill tokens pending; w1 is idle. Reuse 1 (Dynamo)
    trades 1:1 (3,072 cached < 4,000 pending: go to w1); reuse 2 credits 3,072 more against w0's queue (928 left)."""
    e = eps(2)
    e[0].load = EndpointLoad(prefill_tokens=4000, active_blocks=0)
    r = RouteRequest("r", "m", list(range(4096)), overlap_blocks={"w0": 192}, hashed_block_size=BS)
    scores = KvCostScorer(overlap_weight=4.0, reuse_weight=reuse).score(r, e)
    assert max(scores, key=scores.get) == expected
    assert kv_logits(r, e, 4.0, reuse)[0] == pytest.approx(4.0 * (4096 - 3072 + max(0, 4000 - (reuse - 1) * 3072)) / 16 + (256 - 192))
    assert build_policy("kv", reuse_weight=reuse).scorers[0][0].reuse_weight == reuse


def test_reuse_credit_stops_at_an_empty_prefill_queue(impl):
    """The credit offsets pending prefill only: against decode load (active blocks) a cached prefix weighs what it
    weighs at reuse 1, so a huge reuse weight cannot pin decode-heavy traffic to the holder."""
    e = eps(2)
    e[0].load = EndpointLoad(prefill_tokens=100, active_blocks=5000)
    r = RouteRequest("r", "m", list(range(4096)), overlap_blocks={"w0": 192}, hashed_block_size=BS)
    at = {reuse: kv_logits(r, e, 4.0, reuse) for reuse in (1.0, 16.0, 1000.0)}
    assert at[16.0] == at[1000.0] == [pytest.approx(4.0 * 1024 / 16 + 64 + 5000), pytest.approx(4.0 * 4096 / 16 + 256)]
    scores = KvCostScorer(4.0, 1000.0).score(r, e)
    assert max(scores, key=scores.get) == "w1"  # 5,000 active blocks outweigh the prefix, whatever the reuse weight


def test_cached_prefix_wins_when_load_is_equal(impl):
    r = Router("kv")
    cache(r.kv_index, "w5", PREFIX)
    d = r.route(req(0), eps(8))
    assert d.best.worker_id == "w5" and d.overlap_of(d.best) == 192 and d.overlap_blocks == {"w5": 192}


def test_ties_are_broken_uniformly_at_random(impl):
    r = Router(build_policy("kv", seed=1))
    counts = Counter()
    for i in range(800):
        counts[r.route(req(i, prefix=[]), eps(4)).best.worker_id] += 1
        r.on_complete(f"r{i}")  # keep every worker idle: all four always tie
    assert set(counts) == {"w0", "w1", "w2", "w3"} and min(counts.values()) > 150  # 200 expected each


def test_softmax_temperature_samples_by_score():
    scores = {"w0": 1.0, "w1": 0.5, "w2": 0.0}
    e = eps(3)
    picker = SoftmaxPicker(temperature=0.5, seed=3)
    counts = Counter(picker.rank(scores, e)[0].worker_id for _ in range(6000))
    z = sum(math.exp(s / 0.5) for s in scores.values())
    for wid, s in scores.items():
        assert counts[wid] / 6000 == pytest.approx(math.exp(s / 0.5) / z, abs=0.03)
    assert [ep.worker_id for ep in SoftmaxPicker(0.0).rank(scores, e)] == ["w0", "w1", "w2"]  # T = 0 is argmax
    ranked = picker.rank(scores, e)
    assert sorted(ep.worker_id for ep in ranked) == ["w0", "w1", "w2"]


def test_kv_policy_parameters():
    assert isinstance(build_policy("kv", temperature=0.3).picker, SoftmaxPicker)
    shared = KvIndex()
    assert build_policy("kv", index=shared).index is shared and Router(build_policy("kv", index=shared)).kv_index is shared
    with pytest.raises(ValueError, match="kv"):
        build_policy("kv", bogus=1)
    assert Router("round-robin").kv_index is None


def test_booking_charges_only_uncached_prefill_but_all_blocks(impl):
    r = Router("kv")
    cache(r.kv_index, "w1", PREFIX)
    d = r.route(req(0), eps(2))
    ld = r.loads.load(d.best.worker_id)
    assert d.best.worker_id == "w1"
    assert (ld.prefill_tokens, ld.active_blocks, ld.inflight_requests) == (4096 - 3072, 256, 1)
    r.on_first_token("r0")
    r.on_complete("r0")
    assert (ld.prefill_tokens, ld.active_blocks, ld.inflight_requests) == (0, 0, 0)


def test_failover_books_the_next_endpoints_own_overlap(impl):
    r = Router("kv")
    cache(r.kv_index, "w0", PREFIX)
    rq = req(0)
    d = r.route(rq, eps(2))
    r.on_complete(rq.request_id)
    r.book(rq, d.ranked[1])  # w1 holds nothing: the whole prompt is prefill there
    assert r.loads.load("w1").prefill_tokens == 4096


def test_affinity_survives_mild_imbalance(impl):
    """The prefix holder keeps the traffic while its extra load is below what the overlap saves."""
    r = Router("kv")
    cache(r.kv_index, "w3", PREFIX)
    e = eps(8)
    for i, ep in enumerate(e):  # every worker busy with 2 running requests; w3 with 3, one still in prefill
        for j in range(3 if ep.worker_id == "w3" else 2):
            r.loads.on_routed(f"bg{i}-{j}", ep.worker_id, 2048, BS)
            if j < 2:
                r.loads.on_first_token(f"bg{i}-{j}")
    picks = Counter()
    for i in range(20):
        picks[r.route(req(i), e).best.worker_id] += 1
        r.on_first_token(f"r{i}")
        r.on_complete(f"r{i}")
    assert picks == {"w3": 20}


def test_hot_prefix_spreads_instead_of_piling_onto_one_worker(impl):
    """One prefix, 64 concurrent requests, 8 workers, only w0 has the prefix cached (and the index
    learns nothing more): w0 takes the most, but nobody sits idle and nobody takes a pile."""
    r = Router("kv")
    e = eps(8)
    for ep in e:
        r.kv_index.add_worker(ep.worker_id, block_size=BS)  # all event-fed: no predictions
    cache(r.kv_index, "w0", PREFIX)
    picks = Counter(r.route(req(i), e).best.worker_id for i in range(64))  # none completes
    assert len(picks) == 8
    assert picks.most_common(1)[0][0] == "w0" and 64 / 8 < picks["w0"] <= 2 * 64 / 8


def test_hot_prefix_still_spreads_at_the_frontends_reuse_weight(impl):
    """The frontend's kv_reuse_weight (16) values a cached token 16 pending ones: on the same worst case (the index
    never learns the other copies) the holder takes more (36 of 64 at overlap weight 8, 29 at 4, 17 at reuse 1: each
    request's 1,024 uncached tokens queue as prefill there, which the credit offsets), but the load term still
    reaches every worker and the holder stays under 60% (at overlap weight 16: 46 of 64, which this would refuse)."""
    from orchestrator.config import FrontendConfig

    cfg = FrontendConfig()

    def hot_prefix_picks(overlap_weight: float) -> Counter:
        r = Router(build_policy("kv", overlap_weight=overlap_weight, reuse_weight=cfg.kv_reuse_weight))
        e = eps(8)
        for ep in e:
            r.kv_index.add_worker(ep.worker_id, block_size=BS)
        cache(r.kv_index, "w0", PREFIX)
        return Counter(r.route(req(i), e).best.worker_id for i in range(64))

    picks = hot_prefix_picks(cfg.kv_overlap_weight)
    assert len(picks) == 8 and picks.most_common(1)[0][0] == "w0"
    assert 2 * 64 / 8 < picks["w0"] <= 0.6 * 64
    # why the default is not 16 (which hits 1.2 points more of the trace's bound): the holder would take over 60%
    assert hot_prefix_picks(16.0)["w0"] > 0.6 * 64


def test_hot_prefix_replicates_in_approximate_mode(impl):
    """No KV events at all: predictions make the prefix 'cached' where it was sent, so a hot prefix
    fans out across workers and then stays sticky on each."""
    r = Router("kv")
    e = eps(8)
    picks = Counter()
    for i in range(200):  # closed loop: 32 in flight
        picks[r.route(req(i), e).best.worker_id] += 1
        if i >= 32:
            r.on_first_token(f"r{i - 32}")
            r.on_complete(f"r{i - 32}")
    assert len(picks) == 8 and max(picks.values()) <= 2 * 200 / 8
    assert all(r.kv_index.find_matches(block_hashes(PREFIX, BS)).get(ep.worker_id, 0) == 192 for ep in e)


def test_lora_and_block_size_must_match_to_count(impl):
    r = Router("kv")
    cache(r.kv_index, "w0", PREFIX, lora="sql")
    assert r.route(req(0), eps(2)).overlap_blocks == {}
    assert r.route(req(1, lora="sql"), eps(2)).overlap_blocks == {"w0": 192}
    mixed = eps(2)
    mixed[1].block_size = 32
    cache(r.kv_index, "w1", PREFIX, bs=32)
    rq = req(2)
    r.route(rq, mixed)  # hashed at w0's block size (16): w1's 32-token blocks cannot count
    assert KvCostScorer().score(rq, mixed)["w0"] >= 0 and rq.hashed_block_size == 16


def test_remove_worker_drops_its_index_entries(impl):
    r = Router("kv")
    cache(r.kv_index, "w0", PREFIX)
    r.remove_worker("w0")
    assert r.kv_index.find_matches(block_hashes(PREFIX, BS)) == {}
