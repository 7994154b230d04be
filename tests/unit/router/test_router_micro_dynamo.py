"""router_micro's Dynamo side-by-side helpers: job file, Dynamo event JSON, overlap checks, ratios, report.

None of this needs Dynamo installed (the Dynamo script imports `dynamo._core` only inside main())."""

from __future__ import annotations

import json
import os
import random
import stat
import sys
from array import array

import pytest

from benchmarks import dynamo_radix_micro as dyn
from benchmarks import router_micro as rm
from router import KvIndex
from router.kv_events import BlockStored


def _events():
    rng = random.Random(3)
    toks = [rng.randrange(50_000) for _ in range(4 * 16)]
    return [("w0", BlockStored([0, 1], None, toks[:32], 16)), ("w63", BlockStored([2 * 10**9 + 7, 2**62], 1, toks[32:], 16))]


def test_job_round_trip(tmp_path):
    events = _events()
    setup = [("w5", [10**9, 10**9 + 1], None, list(range(32)))]
    prompts = {"miss": [[1, 2, 3]], "full": [[4, 5]]}
    expect = {"miss": [{}], "full": [{5: 256, 13: 256}]}
    path = rm.write_job(tmp_path / "job", events, setup, prompts, expect, queries=10, rounds=2, cpu=0)
    job = json.loads(path.read_text())
    assert job["prompts"] == prompts and job["queries"] == 10 and job["rounds"] == 2 and job["cpu"] == 0
    assert job["expect"] == {"miss": [{}], "full": [{"5": 256, "13": 256}]}  # JSON keys; the script turns them back
    got = dyn.read_events(path.parent / job["events_file"], job["block_size"])
    assert [(w, h, p, list(t)) for w, h, p, t in got] == [
        (0, [0, 1], None, events[0][1].token_ids), (63, [2 * 10**9 + 7, 2**62], 1, events[1][1].token_ids)]
    assert isinstance(got[0][3], array)
    (w, h, p, t), = dyn.read_events(path.parent / job["setup_file"], 16)
    assert (w, h, p, list(t)) == (5, [10**9, 10**9 + 1], None, list(range(32)))


def test_dynamo_event_json_shape():
    ev = json.loads(dyn.stored_event_json(7, None, [10, 11], [111, 2**64 - 1]))
    assert ev == {"event_id": 7, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 10, "tokens_hash": 111}, {"block_hash": 11, "tokens_hash": 2**64 - 1}]}}}
    assert json.loads(dyn.stored_event_json(8, 11, [12], [5]))["data"]["stored"]["parent_hash"] == 11
    assert json.loads(dyn.removed_event_json(9, [10, 11])) == {"event_id": 9, "data": {"removed": {"block_hashes": [10, 11]}}}


class _Scores:
    def __init__(self, scores):
        self.scores = scores


def test_overlap_checks():
    assert dyn.scores_by_worker(_Scores({(3, 0): 256, (3, 1): 10, (9, 0): 256})) == {3: 256, 9: 256}
    assert dyn.scores_by_worker(_Scores({4: 128})) == {4: 128}  # older releases: plain worker ids
    dyn.check_overlaps("full", [{3: 256}, {}], [{"3": 256}, {}])
    with pytest.raises(AssertionError, match="full prompt 0"):
        dyn.check_overlaps("full", [{3: 255}], [{"3": 256}])
    with pytest.raises(AssertionError, match="1 results for 2 prompts"):
        dyn.check_overlaps("miss", [{}], [{}, {}])


def test_expected_overlaps_from_kvyard_index():
    ix = KvIndex()
    for w in range(rm.WORKERS):
        ix.add_worker(f"w{w}", block_size=rm.BS)
    rng = random.Random(5)
    full = [rng.randrange(50_000) for _ in range(rm.PROMPT)]
    half = [rng.randrange(50_000) for _ in range(rm.PROMPT)]
    for w in range(8):
        ix.store(f"w{w * 8}", list(range(w * 1000, w * 1000 + 256)), None, full, rm.BS)
    for w in range(4):
        ix.store(f"w{w * 16 + 1}", list(range(10**6 + w * 1000, 10**6 + w * 1000 + 128)), None, half[:2048], rm.BS)
    miss = [rng.randrange(50_000, 60_000) for _ in range(rm.PROMPT)]
    kinds = {"miss": [array("I", miss)], "half": [array("I", half)], "full": [array("I", full)]}
    got = rm.expected_overlaps(ix, kinds)
    assert got == {"miss": [{}], "half": [{1: 128, 17: 128, 33: 128, 49: 128}], "full": [{w * 8: 256 for w in range(8)}]}
    with pytest.raises(AssertionError, match="full prompt 0"):
        rm.expected_overlaps(ix, {"full": [array("I", half)]})


def _s(p50, p99):
    return {"p50_us": p50, "p90_us": p50, "p99_us": p99, "mean_us": p50, "n": 10}


def _result(with_dynamo=True):
    r = {
        "what": "x", "target": dict(rm.TARGET), "recorded_at": "2026-01-01T00:00:00Z",
        "decision": {k: {"all": _s(40, 150), "quietest_round": _s(38, 140), "round_p50s_us": [40]} for k in rm.KINDS},
        "parts_half_prompt": {"hash_4096_tokens": _s(10, 20)},
        "match_by_kind": {k: {"find_matches": {"all": _s(5, 10)}, "hash_plus_find_matches": _s(15, 30)} for k in rm.KINDS},
        "ingest": {"store_blocks_per_s": 1_500_000, "remove_blocks_per_s": 2_000_000, "remove_blocks_per_s_leaf_first": 1_800_000,
                   "blocks": 1_000_000, "blocks_per_event": 16},
        "machine": {"cores": 2, "pinned_core": 0, "python": "3.11", "loadavg_before": [0.5, 0.6, 0.7], "loadavg_after": [0.8, 0.6, 0.7]},
    }
    if with_dynamo:
        r["dynamo"] = {
            "version": "1.6.1", "loadavg_before": [0.8, 0.6, 0.7], "loadavg_after": [0.9, 0.6, 0.7],
            "hash_4096_tokens": _s(40, 80),
            "find_matches": {k: {"all": _s(20, 40)} for k in rm.KINDS},
            "hash_plus_find_matches": {k: _s(60, 120) for k in rm.KINDS},
            "ingest": {"store_blocks_per_s": 500_000, "remove_blocks_per_s": 900_000, "events": 62_500, "blocks": 1_000_000,
                       "store_events_per_s": 31_250, "tokens_hash_and_json_us_per_event": 60.0},
            "call_floor": {"find_matches_empty": _s(10, 30), "hash_empty": _s(0.7, 1), "what": "text"},
            "overlaps_checked": {"miss": 64, "half": 64, "full": 64},
        }
    return r


def test_side_by_side_ratios():
    sbs = rm.side_by_side(_result())
    assert sbs["hash_4096_tokens"] == {"kvyard_p50_us": 10, "dynamo_p50_us": 40, "p50_ratio": 0.25,
                                       "kvyard_p99_us": 20, "dynamo_p99_us": 80, "p99_ratio": 0.25}
    assert set(sbs["find_matches"]) == set(rm.KINDS) and sbs["find_matches"]["full"]["p50_ratio"] == 0.25
    assert sbs["hash_plus_find_matches"]["half"]["p99_ratio"] == 0.25
    assert sbs["ingest_store_blocks_per_s"] == {"kvyard": 1_500_000, "dynamo": 500_000, "ratio": 3.0}
    assert sbs["ingest_remove_blocks_per_s"]["ratio"] == 2.0  # kvyard's leaf-first removals, Dynamo's order
    assert sbs["dynamo_call_floor_p50_us"] == {"find_matches_empty": 10, "hash_empty": 0.7}
    assert rm._ratio(1, 0) is None and rm._ratio(None, 2) is None


def test_render_md():
    r = _result()
    r["side_by_side"] = rm.side_by_side(r)
    md = rm.render_md(r, "python benchmarks/router_micro.py")
    assert "`python benchmarks/router_micro.py`" in md
    assert "0.5 / 0.6 / 0.7 before" in md and "Dynamo part: 0.8 / 0.6 / 0.7" in md
    assert "| hash 4,096 tokens (256 blocks) | 10.0 | 40.0 | 0.25 | 20.0 | 80.0 | 0.25 |" in md
    assert "| store, 16 blocks per event | 1,500,000 | 500,000 | 3.00 |" in md
    assert "| miss | 40.0 | 40.0 | 150.0 | 38.0 | met |" in md and "target ≥ 1,000,000: met" in md
    assert "background thread" in md and "p99 < 10 µs" in md and "**Load.**" not in md
    r["dynamo"]["loadavg_after"] = [1.5, 0.6, 0.7]
    assert "The 1-minute load average reached 1.5" in rm.render_md(r, "cmd")
    bare = _result(with_dynamo=False)
    bare["dynamo_skipped"] = "--no-dynamo"
    md = rm.render_md(bare, "cmd")
    assert "Dynamo not measured: --no-dynamo" in md and "Side by side" not in md


def test_parse_last_json():
    assert rm.parse_last_json('noise\n{"a": 1}\n\n') == {"a": 1}
    with pytest.raises(ValueError):
        rm.parse_last_json("only noise\n")


def test_run_dynamo_plumbing(tmp_path, monkeypatch):
    """run_dynamo runs `<python> dynamo_radix_micro.py <job>` (pinned) and keeps the last JSON line of its output."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint('log line')\n"
                    "print(json.dumps({'argv': sys.argv[1:]}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else -1
    out = rm.run_dynamo(fake, tmp_path / "job.json", cpu)
    assert out["argv"] == [str(rm.DYNAMO_SCRIPT), str(tmp_path / "job.json")]
    assert "command" in out and "wall_s" in out
    bad = tmp_path / "bad"
    bad.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('boom')\nsys.exit(3)\n")
    bad.chmod(bad.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="exited 3"):
        rm.run_dynamo(bad, tmp_path / "job.json", -1)
