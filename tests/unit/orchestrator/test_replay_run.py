"""Replays end to end on small fleets: routing, KV events and their lag, P/D hand-off, rejection, scaling and
billing, the planner in the loop, the fleet search, and the `kvyard replay` command."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import main
from orchestrator.config import FrontendConfig
from orchestrator.replay import EngineSpec, Replay, ReplayConfig, TraceRequest, Workload, synthetic
from orchestrator.replay.planning import PlannerDriver
from orchestrator.replay.report import result_of
from orchestrator.replay.search import find_min_workers

ENGINE = EngineSpec(block_size=16, num_gpu_blocks=3000, max_model_len=16384)


def _cfg(policy: str = "kv", **kw) -> ReplayConfig:
    return ReplayConfig(engine=kw.pop("engine", ENGINE), frontend=FrontendConfig(grpc_port=0, router={"policy": policy}), **kw)


def _wl(reqs: list[tuple[float, int, int, list[int]]], block: int = 64) -> Workload:
    return Workload([TraceRequest(t, isl, osl, ids) for t, isl, osl, ids in reqs], trace_block=block)


def test_every_request_completes_with_sane_times():
    wl = synthetic("poisson:rate=4,requests=40,isl=800,osl=16", seed=2)
    r = Replay(_cfg("round-robin", workers=2), wl).run()
    assert [x.status for x in r.records] == ["ok"] * 40
    for x in r.records:
        assert 0 < x.ttft <= x.e2e and x.tokens == x.osl and x.first <= x.last == x.finish
    assert not r.live and r.end_time == max(x.finish for x in r.records)
    assert r.gpu_seconds() == pytest.approx(2 * r.end_time)


def test_round_robin_alternates_and_kv_follows_the_cached_prefix():
    shared = [1, 2, 3, 4, 5, 6]
    reqs = [(i * 2.0, 400, 4, shared + [100 + i]) for i in range(6)]  # spaced out: no load, only the cache matters
    rr = Replay(_cfg("round-robin", workers=3), _wl(reqs)).run()
    assert [x.worker for x in rr.records] == ["b00000", "b00001", "b00002"] * 2
    kv = Replay(_cfg("kv", workers=3), _wl(reqs)).run()
    assert len({x.worker for x in kv.records}) == 1  # all on the worker that holds the prefix
    assert all(x.cached == 384 for x in kv.records[1:])  # the 6 shared blocks of 64: 24 blocks of 16
    assert result_of(kv, "kv", bound=False)["summary"]["hit_rate"] > result_of(rr, "rr", bound=False)["summary"]["hit_rate"]


def test_kv_events_reach_the_index_after_the_lag():
    wl = _wl([(0.0, 1000, 2, list(range(16)))])
    seen = {}
    for lag_ms in (0.0, 500.0):
        r = Replay(_cfg("kv", workers=1, event_lag_ms=lag_ms), wl)
        for t in (0.3, 0.7):  # the prefill's events come at the end of its ~0.1 s step
            r.clock.at(t, lambda t=t, r=r, lag=lag_ms: seen.__setitem__((lag, t), len(r.index)))
        r.run()
    assert seen[(0.0, 0.3)] > 0 and seen[(0.0, 0.7)] > 0
    assert seen[(500.0, 0.3)] == 0 and seen[(500.0, 0.7)] == seen[(0.0, 0.7)]


def test_pd_handoff_prefills_remotely_then_decodes_after_the_transfer():
    wl = _wl([(0.0, 6000, 8, list(range(100)))])
    cfg = _cfg("kv", workers=0, prefill=1, decode=1)
    cfg.frontend.disagg.mode = "always"
    r = Replay(cfg, wl).run()
    rec = r.records[0]
    p, d = r.workers["p00000"], r.workers["d00001"]
    assert rec.status == "ok" and rec.prefill_worker == "p00000" and rec.worker == "d00001" and rec.disagg == "always"
    assert p.sched.prefix_queries == 6000 and not p.sched.held and d.sched.external_tokens == 6000 - 0
    transfer = r.transfer.seconds(6000)
    assert rec.ttft > transfer > 0.01  # 6000 tokens x 128 KiB / 25 GB/s ~ 31 ms, after the prefill
    agg = Replay(_cfg("kv", workers=1), wl).run().records[0]
    assert rec.ttft > agg.ttft  # the hand-off adds the transfer and a decode step


def test_a_request_larger_than_the_kv_cache_is_rejected_and_the_rest_served():
    eng = EngineSpec(block_size=16, num_gpu_blocks=200, max_model_len=8192)  # 199 x 16 = 3184 tokens of KV
    wl = _wl([(0.0, 500, 4, [1]), (0.1, 3100, 200, [2] * 49), (0.2, 400, 4, [3])])
    r = Replay(_cfg("round-robin", workers=1, engine=eng), wl).run()
    assert [x.status for x in r.records] == ["ok", "rejected", "ok"]
    assert r.records[1].disagg == "exceeds_kv_cache"


def test_scaling_bills_from_the_request_routes_after_startup_and_drains_before_leaving():
    wl = synthetic("poisson:rate=6,requests=120,isl=600,osl=30", seed=5)
    r = Replay(_cfg("round-robin", workers=1, startup_s=5.0), wl)
    added = []
    r.clock.at(2.0, lambda: added.append(r.scale("both", 3)))
    r.clock.at(12.0, lambda: r.scale("both", 1))
    r.run()
    assert added == [3]
    late = [w for w in r.workers.values() if w.billed_from == 2.0]
    assert len(late) == 2 and all(w.ready_at == 7.0 for w in late)
    assert {x.worker for x in r.records if x.arrival < 7.0} == {"b00000"}  # nobody else was routable yet
    assert {x.worker for x in r.records if 7.0 < x.arrival < 12.0} == {"b00000", "b00001", "b00002"}
    removed = [w for w in r.workers.values() if w.removed_at == 12.0]
    assert len(removed) == 2 and all(w.gone_at >= 12.0 for w in removed)
    for w in removed:  # nothing routed after the removal, and it left once its last request was done
        mine = [x for x in r.records if x.worker == w.wid]
        assert all(x.arrival < 12.0 for x in mine) and w.gone_at == max([12.0] + [x.finish for x in mine])
    billed = r.end_time + sum(w.gone_at - 2.0 for w in late)
    assert r.gpu_seconds() == pytest.approx(billed)
    assert [n for _, _, n in r.fleet_log] == [1, 2, 3, 2, 1]


def test_planner_scales_an_overloaded_pool_up():
    wl = synthetic("poisson:rate=8,duration=240,isl=3000,osl=100", seed=1)
    doc = {"planner": {"interval_s": 15, "mode": "hybrid", "max_step": 4, "scale_down_cooldown_s": 60, "scale_down_window_s": 60}}
    cfg = _cfg("kv", workers=1, startup_s=20.0, slo_ttft_p90_ms=800, slo_itl_p90_ms=40, planner=doc)
    r = Replay(cfg, wl)
    driver = PlannerDriver(r, doc)
    r.run()
    assert driver.decisions and driver.connector.log
    assert max(n for _, _, n in r.fleet_log) > 1
    res = result_of(r, "planner", bound=False)["summary"]
    assert res["minutes_total"] == 4 and 0 <= res["minutes_within_sla"] <= 4
    assert run_ticks(driver) >= 240 // 15 - 1


def run_ticks(driver: PlannerDriver) -> int:
    return driver.loop.core.tick


def test_find_min_workers_returns_the_smallest_fleet_that_meets_the_slo():
    wl = synthetic("poisson:rate=12,requests=150,isl=2000,osl=20", seed=3)
    cfg = _cfg("round-robin", workers=1, slo_ttft_p90_ms=400, slo_itl_p90_ms=100)
    res = find_min_workers(cfg, wl, max_workers=16)
    n = res["found"]["workers"]
    by_n = {p["workers"]: p["ok"] for p in res["probes"]}
    assert by_n[n] and (n == 1 or by_n.get(n - 1) is False)
    assert all(not ok for k, ok in by_n.items() if k < n)


def test_cli_replays_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["replay", "--synthetic", "poisson:rate=5,requests=30,isl=512,osl=10,block=64", "--workers", "2",
               "--policy", "kv,round-robin", "--block-size", "16", "--num-gpu-blocks", "2000", "--json", str(out),
               "--plot", str(tmp_path / "r.png"), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [run["policy"] for run in doc["runs"]] == ["kv", "round-robin"]
    assert doc["runs"][0]["summary"]["completed"] == 30 and doc["fleet_bound"]["hit_rate"] is not None
    assert (tmp_path / "r.png").stat().st_size > 0
    assert "round-robin" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--synthetic", "poisson:rate=oops"], "must be a number"),
    (["--trace", "/nonexistent.jsonl"], "not found"),
    (["--synthetic", "poisson", "--prefill", "2"], "P/D pools need both"),
    (["--synthetic", "poisson", "--policy", "fastest"], "unknown policy"),
])
def test_cli_bad_input_is_a_clear_error(argv, msg, capsys):
    assert main(["replay", *argv, "--no-progress"]) == 2
    assert msg in capsys.readouterr().err


def test_inline_steps_and_seeds_give_the_queue_order_exactly(monkeypatch):
    """A worker runs its next step itself when it ends before everything queued: the same results as popping it; and a
    replay is repeatable (the picker's tie-breaks are seeded)."""
    from orchestrator.replay.clock import VirtualClock

    wl = synthetic("sessions:rate=6,requests=150,groups=3,osl=40", seed=4)

    def run():
        r = Replay(_cfg("kv", workers=3), wl).run()
        return [(x.worker, x.first, x.finish, x.tokens, x.cached) for x in r.records]

    a, b = run(), run()
    monkeypatch.setattr(VirtualClock, "advance", lambda self, t: False)
    assert a == b == run()
