"""Scheduler: token budget, chunked prefill, max seqs, prefix hits, preemption, stop checks."""

from __future__ import annotations

import pytest

from workers.sim.kv_manager import KvBlockManager
from workers.sim.scheduler import RequestStatus, Scheduler, SimRequest

BS = 4


def make(num_blocks: int = 64, **kw) -> Scheduler:
    return Scheduler(KvBlockManager(num_blocks, BS), **{"max_model_len": 64, **kw})


def req(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 0, **kw) -> SimRequest:
    return SimRequest(rid, list(range(base, base + n_prompt)), max_tokens, token_source=lambda k: 1000 + k, **kw)


def run_step(s: Scheduler):
    plan = s.schedule()
    return plan, s.update_from_output(plan)


@pytest.mark.parametrize(
    "prompts,budget,expected",
    [
        ([10, 10], 64, [("a", 10), ("b", 10)]),  # both fit
        ([10, 10], 15, [("a", 10), ("b", 5)]),  # b chunked by the budget
        ([40], 16, [("a", 16)]),  # a single long prompt is chunked
    ],
)
def test_first_step_budget_and_chunking(prompts, budget, expected):
    s = make(max_num_batched_tokens=budget)
    for rid, n in zip("abc", prompts):
        s.add_request(req(rid, n, base=100 * len(s.requests)))
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == expected
    assert plan.num_tokens <= budget


def test_chunked_prefill_completes_then_decodes_one_token_per_step():
    s = make(max_num_batched_tokens=16)
    s.add_request(req("a", 40, max_tokens=3))
    chunks, starts = [], []
    while True:
        plan, res = run_step(s)
        chunks.append(plan.prefill_chunks or plan.decode_contexts)
        starts.append(plan.starts_prefill)
        if res.outputs:
            break
    assert chunks == [[(0, 16)], [(16, 16)], [(32, 8)]]
    assert [p for p in starts] == [True, False, False]
    plan, res = run_step(s)
    assert plan.decode_contexts == [41] and plan.prefill_chunks == [] and res.outputs[0][1] == [1001]


def test_running_requests_get_the_budget_before_waiting_ones():
    s = make(max_num_batched_tokens=12)
    s.add_request(req("a", 8, max_tokens=10))
    run_step(s)  # a prefilled, now decoding
    s.add_request(req("b", 20, base=500))
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1), ("b", 11)]


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, 4, base=100 * i))
    plan = s.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["a", "b"] and len(s.waiting) == 1


def test_prefix_hit_skips_computed_tokens_and_counts_queries_and_hits():
    s = make()
    s.add_request(req("a", 12, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 14, max_tokens=1))  # same first 12 tokens
    plan = s.schedule()
    assert plan.prefill_chunks == [(12, 2)]
    assert (s.prefix_queries, s.prefix_hits) == (26, 12)
    assert s.requests["b"].num_cached_tokens == 12


def test_finish_on_max_tokens_frees_blocks():
    s = make()
    s.add_request(req("a", 6, max_tokens=2))
    _, r1 = run_step(s)
    _, r2 = run_step(s)
    a = r2.finished[0]
    assert a.output_token_ids == [1000, 1001] and a.finish_reason == "length" and a.status is RequestStatus.FINISHED
    assert s.kv.usage == 0.0 and not s.has_work


def test_max_model_len_and_stop_token_ids():
    s = make(max_model_len=8)
    s.add_request(req("a", 6, max_tokens=10))
    s.add_request(SimRequest("b", [50, 51], 10, token_source=lambda k: 7 if k == 1 else 3, stop_token_ids=frozenset({7})))
    done = {}
    while s.has_work:
        _, res = run_step(s)
        done.update({r.request_id: r for r in res.finished})
    assert done["a"].finish_reason == "length" and len(done["a"].all_token_ids) == 8
    assert (done["b"].finish_reason, done["b"].stop_reason, done["b"].output_token_ids) == ("stop", 7, [3, 7])


def test_min_tokens_suppresses_stop_token():
    s = make()
    s.add_request(SimRequest("a", [1, 2], 5, token_source=lambda k: 7, stop_token_ids=frozenset({7}), min_tokens=3))
    while s.has_work:
        _, res = run_step(s)
    assert res.finished[0].output_token_ids == [7, 7, 7]


def test_preemption_recompute_lifo_victim():
    # 7 usable blocks of 4 tokens; two requests of 12 prompt tokens (3 blocks each) decoding
    s = make(num_blocks=8, max_num_batched_tokens=64)
    s.add_request(req("a", 12, max_tokens=20))
    s.add_request(req("b", 12, max_tokens=20, base=100))
    run_step(s)  # prefill both: 6 blocks; each has 13 tokens -> next decode needs a 4th block each
    plan, _ = run_step(s)  # a gets block 7; b cannot -> b (the last running) is preempted
    assert [r.request_id for r in plan.preempted] == ["b"]
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert s.num_preemptions == 1 and [r.request_id for r, _ in plan.scheduled] == ["a"]


def test_abort_frees_blocks_and_skips_output():
    s = make()
    s.add_request(req("a", 8, max_tokens=5))
    plan = s.schedule()
    s.abort("a")
    res = s.update_from_output(plan)
    assert res.outputs == [] and s.kv.usage == 0.0 and not s.has_work
    assert s.abort("a") is None


def test_decode_blocks_are_hashed_and_stored():
    s = make()
    s.add_request(req("a", 6, max_tokens=6))
    while s.has_work:
        run_step(s)
    evs = s.kv.take_events()
    # 6 prompt + 5 computed outputs = 11 computed tokens -> 2 full blocks (the last sampled token is never computed)
    assert [t for e in evs for t in e.token_ids] == [0, 1, 2, 3, 4, 5, 1000, 1001]
    assert [len(e.block_hashes) for e in evs] == [1, 1]


def test_admission_requires_the_whole_prompt_to_fit():
    # 7 usable blocks; a 20-token prompt (5 blocks) runs; a 16-token prompt (4 blocks) would fit its
    # first 8-token chunk (2 blocks) but not its whole sequence -> not admitted (reserve_full_isl)
    s = make(num_blocks=8, max_num_batched_tokens=28)
    s.add_request(req("a", 20, max_tokens=2))
    s.add_request(req("b", 16, max_tokens=2, base=100))
    plan = s.schedule()
    assert [r.request_id for r, _ in plan.scheduled] == ["a"] and s.waiting[0].request_id == "b"
