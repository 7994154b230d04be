"""Replay workloads: Mooncake traces, token layout, synthetic specs, the fleet bound."""

from __future__ import annotations

import json

import pytest

from orchestrator.replay.bound import fleet_bound
from orchestrator.replay.workload import TraceRequest, Workload, WorkloadError, load_mooncake, parse_synthetic, synthetic


def _trace(tmp_path, rows) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def test_mooncake_times_start_at_zero_and_scale(tmp_path):
    path = _trace(tmp_path, [
        {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 3000, "input_length": 100, "output_length": 0, "hash_ids": [1]},
        {"timestamp": 2000, "input_length": 10, "output_length": 3, "hash_ids": [9]},
    ])
    wl = load_mooncake(path, time_scale=2.0)
    assert [r.arrival for r in wl] == [0.0, 0.5, 1.0]  # sorted, (t - t0) / 1000 / 2
    assert [r.output_length for r in wl] == [5, 3, 1]  # output 0 -> at least one token
    assert len(load_mooncake(path, limit=2, skip=1)) == 2


def test_mooncake_delay_rows(tmp_path):
    path = _trace(tmp_path, [{"delay": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]},
                             {"delay": 250, "input_length": 5, "output_length": 1, "hash_ids": [2]}])
    assert [r.arrival for r in load_mooncake(path)] == [0.0, 0.25]


@pytest.mark.parametrize("row, msg", [
    ("not json", "not JSON"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', ">= 1"),
    ("[1, 2]", "JSON object"),
])
def test_bad_traces_are_clear_errors(tmp_path, row, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(row + "\n")
    with pytest.raises(WorkloadError, match=msg):
        load_mooncake(p)
    with pytest.raises(WorkloadError, match="not found"):
        load_mooncake(tmp_path / "missing.jsonl")


def test_tokens_share_exactly_the_leading_blocks_their_hash_ids_share():
    wl = Workload([], trace_block=8)
    a = wl.tokens(TraceRequest(0, 20, 1, [5, 6, 7]))
    b = wl.tokens(TraceRequest(0, 20, 1, [5, 6, 8]))
    c = wl.tokens(TraceRequest(0, 12, 1, [5, 9]))
    assert len(a) == len(b) == 20 and len(c) == 12
    assert a[:16] == b[:16] and a[16] != b[16]
    assert a[:8] == c[:8] and a[8] != c[8]
    big = wl.tokens(TraceRequest(0, 3, 1, [(1 << 35) + 3]))  # ids past 2^30 stay distinct and < 2^32
    assert big[:2] != wl.tokens(TraceRequest(0, 3, 1, [3]))[:2] and max(big) < 2**32
    short = wl.tokens(TraceRequest(0, 20, 1, [5]))  # too few ids: the rest is the request's own
    assert len(short) == 20 and short[:8] == a[:8]


def test_synthetic_specs_parse_with_defaults_and_refuse_unknowns():
    kind, p = parse_synthetic("poisson:rate=2.5,requests=10,isl=100")
    assert kind == "poisson" and p["rate"] == 2.5 and p["requests"] == 10 and p["osl"] == 256
    for bad, msg in (("nope", "unknown synthetic"), ("poisson:speed=3", "bad parameter"), ("poisson:rate=x", "number")):
        with pytest.raises(WorkloadError, match=msg):
            parse_synthetic(bad)


@pytest.mark.parametrize("spec", ["poisson:rate=20,requests=50", "shared-prefix:requests=40,prefixes=4,prefix_tokens=512,suffix_tokens=64",
                                  "sessions:rate=10,requests=60", "daily:minutes=3,peak=3,trough=1,bursts=1,burst_s=20",
                                  "walk:minutes=4,step_s=30,start=2,lo=1,hi=4,spikes=1"])
def test_synthetic_loads_are_seeded_sorted_and_consistent(spec):
    a, b = synthetic(spec, seed=3), synthetic(spec, seed=3)
    assert len(a) > 0 and [r.arrival for r in a] == [r.arrival for r in b]
    assert all(x.arrival <= y.arrival for x, y in zip(a.requests, a.requests[1:]))
    for r in a:
        assert r.input_length >= 1 and r.output_length >= 1
        assert len(r.hash_ids) * a.trace_block >= r.input_length  # every prompt token has content
    assert [r.arrival for r in synthetic(spec, seed=4)] != [r.arrival for r in a]


def test_sessions_resend_their_history():
    wl = synthetic("sessions:rate=5,requests=200,turns=5,groups=2", seed=1)
    by_session: dict[str, list] = {}
    for r in wl:
        by_session.setdefault(r.session, []).append(r)
    multi = [rs for rs in by_session.values() if len(rs) > 1]
    assert multi
    for rs in multi:
        for prev, nxt in zip(rs, rs[1:]):
            full = prev.input_length // wl.trace_block
            assert nxt.hash_ids[:full] == prev.hash_ids[:full] and nxt.input_length > prev.input_length


def test_fleet_bound_counts_what_a_pooled_optimal_cache_could_hit():
    # block 4 = trace block 8 / 2; three requests on one prefix, capacity enough for everything
    reqs = [TraceRequest(0, 16, 1, [1, 2]), TraceRequest(1, 16, 1, [1, 2]), TraceRequest(2, 9, 1, [1, 3])]
    wl = Workload(reqs, trace_block=8)
    b = fleet_bound(wl, 4, 100)
    # second: 4 blocks present, capped at (16-1)//4 = 3 -> 12 tokens; third: block 1's 2 sub-blocks -> 8, cap (9-1)//4 = 2
    assert b["hits"] == 12 + 8 and b["queries"] == 41 and b["oracle_hits"] == 20
    # two blocks of room, every computed block enters (demand paging), the one needed farthest is evicted:
    # the second request keeps 2 of its 4 blocks cached (8 tokens), the third finds none left
    tight = fleet_bound(wl, 4, 2)
    assert tight["hits"] == 8 and tight["oracle_hits"] == 20
    assert fleet_bound(wl, 3, 100) is None  # the block size must divide the trace block
