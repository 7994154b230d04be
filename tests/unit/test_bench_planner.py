"""The planner benchmark's SLA judgement (benchmarks/planner_sim.py): per minute of first tokens, the same for both
replays."""

from __future__ import annotations

from benchmarks.planner_sim import sla_minutes


def test_minutes_judge_ttft_p90_and_token_weighted_itl_p90():
    reqs = [(5.0, 100.0, 10.0, 101)] * 9 + [(6.0, 5000.0, 10.0, 2)]  # minute 0: one slow first token in ten
    reqs += [(70.0, 100.0, 10.0, 11)] * 5 + [(71.0, 100.0, 40.0, 1001)]  # minute 1: one long, slow stream
    reqs += [(500.0, 100.0, 10.0, 5)]  # after the end: counts in the last minute
    rows = sla_minutes(reqs, 150.0, ttft_ms=1000.0, itl_ms=25.0)
    assert [r["minute"] for r in rows] == [0, 1, 2]
    assert rows[0]["ttft_p90_ms"] < 1000.0 and rows[0]["ok"]  # the p90 of ten (interpolated) stays under the one slow request
    assert rows[1]["itl_p90_ms"] == 40.0 and not rows[1]["ok"]  # 1000 of 1050 tokens came at 40 ms
    assert rows[2]["requests"] == 1 and rows[2]["ok"]
    assert sla_minutes([], 30.0, 1.0, 1.0) == [{"minute": 0, "requests": 0, "ttft_p90_ms": None, "itl_p90_ms": None, "ok": True}]


def test_a_minute_misses_on_ttft():
    rows = sla_minutes([(1.0, 3000.0, 5.0, 10)] * 3, 59.0, ttft_ms=1000.0, itl_ms=25.0)
    assert len(rows) == 1 and not rows[0]["ok"] and rows[0]["ttft_p90_ms"] == 3000.0


def test_sweep_settings_and_the_target_verdict():
    from benchmarks.planner_report import _meets
    from benchmarks.planner_sim import sweep_settings

    assert sweep_settings("demand_z=0,0.64,2.5") == [{"demand_z": 0.0}, {"demand_z": 0.64}, {"demand_z": 2.5}]
    assert sweep_settings("") == []
    dyn = {"minutes_met": 3, "gpu_seconds": 1000.0}
    assert _meets({"minutes_met": 3, "gpu_seconds": 900.0}, dyn)  # as many minutes at 0.9x
    assert not _meets({"minutes_met": 3, "gpu_seconds": 901.0}, dyn)
    assert not _meets({"minutes_met": 2, "gpu_seconds": 500.0}, dyn)
