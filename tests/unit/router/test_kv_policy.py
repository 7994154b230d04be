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
DYNAMO = {"overlap_weight": 1.0, "reuse_weight": 1.0, "request_weight": 0.0}  # Dynamo's cost; the served defaults are router/config.py's


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
    assert kv_logits(r, ep, w, 1.0, 0.0) == [pytest.approx(expected)]


def test_scores_are_normalised_negated_logits(impl):
    e = eps(4)
    for ep, (pf, ab) in zip(e, [(0, 0), (1600, 0), (0, 500), (3200, 100)]):
        ep.load = EndpointLoad(prefill_tokens=pf, active_blocks=ab)
    r = RouteRequest("r", "m", list(range(4096)), overlap_blocks={"w1": 100, "w3": 192}, hashed_block_size=BS)
    logits = kv_logits(r, e, 1.0, 1.0, 0.0)
    lo, hi = min(logits), max(logits)
    scores = KvCostScorer(1.0, 1.0, 0.0).score(r, e)
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
            ep.load = EndpointLoad(prefill_tokens=rng.randrange(0, 9000), active_blocks=rng.randrange(0, 900),
                                   inflight_requests=rng.randrange(0, 40))
            ep.block_size = rng.choice([16, 16, 32])
        ov = {ep.worker_id: rng.randrange(0, 300) for ep in e if rng.random() < 0.3}
        args = (e, ov, rng.randrange(0, 9000), 16, rng.choice([0.0, 1.0, 2.5]))
        assert kv_scores(*args) == py_kv_scores(*args)
        reuse = rng.choice([0.0, 1.0, 2.0, 3.5])
        assert kv_scores(*args, reuse) == py_kv_scores(*args, reuse)
        per_request = rng.choice([0.0, 1.0, 16.0, 7.25])
        assert kv_scores(*args, reuse, per_request) == py_kv_scores(*args, reuse, per_request)


@pytest.mark.parametrize("reuse, expected", [(1.0, "w1"), (2.0, "w0")])
def test_reuse_weight_values_a_cached_token_above_a_pending_one(impl, reuse, expected):
    """w0 holds 192 of the prompt's 256 blocks but has 4,000 prefill tokens pending; w1 is idle. Reuse 1 (Dynamo)
    trades 1:1 (3,072 cached < 4,000 pending: go to w1); reuse 2 credits 3,072 more against w0's queue (928 left)."""
    e = eps(2)
    e[0].load = EndpointLoad(prefill_tokens=4000, active_blocks=0)
    r = RouteRequest("r", "m", list(range(4096)), overlap_blocks={"w0": 192}, hashed_block_size=BS)
    scores = KvCostScorer(overlap_weight=4.0, reuse_weight=reuse, request_weight=0.0).score(r, e)
    assert max(scores, key=scores.get) == expected
    assert kv_logits(r, e, 4.0, reuse, 0.0)[0] == pytest.approx(4.0 * (4096 - 3072 + max(0, 4000 - (reuse - 1) * 3072)) / 16 + (256 - 192))
    assert build_policy("kv", reuse_weight=reuse).scorers[0][0].reuse_weight == reuse


def test_reuse_credit_stops_at_an_empty_prefill_queue(impl):
    """The credit offsets pending prefill only: against decode load (active blocks) a cached prefix weighs what it
    weighs at reuse 1, so a huge reuse weight cannot pin decode-heavy traffic to the holder."""
    e = eps(2)
    e[0].load = EndpointLoad(prefill_tokens=100, active_blocks=5000)
    r = RouteRequest("r", "m", list(range(4096)), overlap_blocks={"w0": 192}, hashed_block_size=BS)
    at = {reuse: kv_logits(r, e, 4.0, reuse, 0.0) for reuse in (1.0, 16.0, 1000.0)}
    assert at[16.0] == at[1000.0] == [pytest.approx(4.0 * 1024 / 16 + 64 + 5000), pytest.approx(4.0 * 4096 / 16 + 256)]
    scores = KvCostScorer(4.0, 1000.0, 0.0).score(r, e)
    assert max(scores, key=scores.get) == "w1"  # 5,000 active blocks outweigh the prefix, whatever the reuse weight


def test_request_weight_prices_each_request_in_flight(impl):
    """A long cached prefix with a short suffix (10 of 11 blocks cached) outweighs many short requests' blocks at
    overlap weight 16; a price per request in flight bounds how many the holder takes before a copy elsewhere pays."""
    e = eps(2)
    e[0].load = EndpointLoad(prefill_tokens=0, active_blocks=8 * 11, inflight_requests=8)
    r = RouteRequest("r", "m", list(range(176)), overlap_blocks={"w0": 10}, hashed_block_size=BS)
    assert kv_logits(r, e, 16.0, 8.0, 0.0) == [pytest.approx(16.0 * 16 / 16 + 1 + 88), pytest.approx(16.0 * 176 / 16 + 11)]
    assert max(KvCostScorer(16.0, 8.0, 0.0).score(r, e).items(), key=lambda kv: kv[1])[0] == "w0"  # 105 < 187: holder
    assert kv_logits(r, e, 16.0, 8.0, 16.0)[0] == pytest.approx(105 + 16 * 8)
    scores = KvCostScorer(16.0, 8.0, 16.0).score(r, e)
    assert max(scores, key=scores.get) == "w1"  # 233 > 187: eight requests in flight are worth the copy
    assert build_policy("kv", request_weight=16.0).scorers[0][0].request_weight == 16.0


def test_cached_prefix_wins_when_load_is_equal(impl):
    r = Router(build_policy("kv", **DYNAMO))
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
    r = Router(build_policy("kv", **DYNAMO))
    cache(r.kv_index, "w1", PREFIX)
    d = r.route(req(0), eps(2))
    ld = r.loads.load(d.best.worker_id)
    assert d.best.worker_id == "w1"
    assert (ld.prefill_tokens, ld.active_blocks, ld.inflight_requests) == (4096 - 3072, 256, 1)
    r.on_first_token("r0")
    r.on_complete("r0")
    assert (ld.prefill_tokens, ld.active_blocks, ld.inflight_requests) == (0, 0, 0)


def test_failover_books_the_next_endpoints_own_overlap(impl):
    r = Router(build_policy("kv", **DYNAMO))
    cache(r.kv_index, "w0", PREFIX)
    rq = req(0)
    d = r.route(rq, eps(2))
    r.on_complete(rq.request_id)
    r.book(rq, d.ranked[1])  # w1 holds nothing: the whole prompt is prefill there
    assert r.loads.load("w1").prefill_tokens == 4096


def test_affinity_survives_mild_imbalance(impl):
    """The prefix holder keeps the traffic while its extra load is below what the overlap saves."""
    r = Router(build_policy("kv", **DYNAMO))
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


def hot_prefix_picks(n: int = 64, **params) -> tuple[Router, Counter]:
    """One prefix, n concurrent requests (none completes), 8 event-fed workers, only w0 has the prefix cached."""
    r = Router(build_policy("kv", **{**DYNAMO, **params}))
    e = eps(8)
    for ep in e:
        r.kv_index.add_worker(ep.worker_id, block_size=BS)
    cache(r.kv_index, "w0", PREFIX)
    return r, Counter(r.route(req(i), e).best.worker_id for i in range(n))


def test_hot_prefix_spreads_instead_of_piling_onto_one_worker(impl):
    """Without pending predictions the index learns nothing more during the burst (no request's prefill has
    finished): w0 takes the most, but nobody sits idle and nobody takes a pile."""
    _, picks = hot_prefix_picks(pending_ttl_s=0)
    assert len(picks) == 8
    assert picks.most_common(1)[0][0] == "w0" and 64 / 8 < picks["w0"] <= 2 * 64 / 8


def test_hot_prefix_replicates_through_pending_predictions(impl):
    """With them (the default), a request sent away from the holder makes its worker a holder at once: the burst
    spreads evenly and every worker it reached holds the prefix, before any engine has said so."""
    r, picks = hot_prefix_picks()
    assert picks == {f"w{i}": 8 for i in range(8)}
    held = r.kv_index.find_matches(block_hashes(PREFIX, BS))
    assert all(held.get(w, 0) >= 192 for w in picks)
    assert r.kv_index.tree_sizes()["w0"] == 192 and sum(r.kv_index.tree_sizes().values()) == 192  # events: w0 only


def test_hot_prefix_at_the_frontends_weights(impl):
    """The served weights (router/config.py) value a cached block highly (overlap weight, reuse credit), so
    the holder keeps more of a burst; pending predictions make each worker a request is sent to a holder too, so
    the burst replicates the prefix instead of piling: nobody takes more than twice a fair share. Without the
    predictions the same weights pile much more onto w0 (the index never learns the other copies in time)."""
    from router.config import KV_DEFAULTS as cfg

    weights = {"overlap_weight": cfg.overlap_weight, "reuse_weight": cfg.reuse_weight, "request_weight": cfg.request_weight}
    r, picks = hot_prefix_picks(pending_ttl_s=cfg.pending_ttl_s, **weights)
    assert picks.most_common(1)[0][1] <= 2 * 64 / 8 and len(picks) >= 5, picks
    held = r.kv_index.find_matches(block_hashes(PREFIX, BS))
    assert sum(1 for w in picks if held.get(w, 0) >= 192) >= len(picks) - 1  # one may hold a lone diverted request's
    _, blind = hot_prefix_picks(pending_ttl_s=0, **weights)
    assert blind["w0"] > 2 * 64 / 8 >= picks["w0"], blind


def test_hot_prefix_replicates_in_approximate_mode(impl):
    """No KV events at all: predictions make the prefix 'cached' where it was sent, so a hot prefix
    fans out across workers and then stays sticky on each."""
    r = Router(build_policy("kv", **DYNAMO))
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
    r = Router(build_policy("kv", **DYNAMO))
    cache(r.kv_index, "w0", PREFIX, lora="sql")
    assert r.route(req(0), eps(2)).overlap_blocks == {}
    assert r.route(req(1, lora="sql"), eps(2)).overlap_blocks == {"w0": 192}
    mixed = eps(2)
    mixed[1].block_size = 32
    cache(r.kv_index, "w1", PREFIX, bs=32)
    rq = req(2)
    r.route(rq, mixed)  # hashed at w0's block size (16): w1's 32-token blocks cannot count
    assert KvCostScorer(1.0, 1.0, 0.0).score(rq, mixed)["w0"] >= 0 and rq.hashed_block_size == 16


def test_remove_worker_drops_its_index_entries(impl):
    r = Router(build_policy("kv", **DYNAMO))
    cache(r.kv_index, "w0", PREFIX)
    r.remove_worker("w0")
    assert r.kv_index.find_matches(block_hashes(PREFIX, BS)) == {}


def test_prefix_cached_tells_whether_more_of_a_prompt_could_match():
    index = KvIndex()
    router = Router(build_policy("kv", index=index))
    for w in ("w0", "w1"):
        index.add_worker(w, block_size=BS)
    cache(index, "w0", PREFIX[:1600])  # 100 blocks on w0
    assert router.prefix_cached(PREFIX[:1600], BS) and router.prefix_cached(PREFIX[:1610], BS)  # a partial block: not judged
    assert router.prefix_cached(PREFIX[:5], BS)  # no full block yet: nothing tells
    assert not router.prefix_cached(PREFIX[:1616], BS)  # block 101 is nowhere: nothing past it can match
    assert not router.prefix_cached(PREFIX[:1600], BS, lora_name="a")  # an adapter's blocks hash apart
    assert not Router(build_policy("kv", index=KvIndex())).prefix_cached(PREFIX[:32], BS)  # an empty index
    assert Router("round-robin").prefix_cached(PREFIX, BS)  # no index: it has no say
    req = RouteRequest("r", "m", token_ids=PREFIX[:160], prompt_tokens=3000)  # the first tokens of a lazy prompt
    router.route(req, eps(2))
    assert req.isl == 3000 and req.overlap_blocks == {"w0": 10}
    index.add_worker("w2", approximate=True)
    assert index.event_fed("w0") and not index.event_fed("w2") and not index.event_fed("nobody")
