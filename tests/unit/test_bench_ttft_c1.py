"""benchmarks/ttft_c1.py's pure helpers: the per-turn added TTFT and the percentile it reports."""

from __future__ import annotations

from benchmarks.ttft_c1 import paired_added, pct


def test_added_is_per_turn_past_the_warmup_and_skips_failed_turns():
    direct = [9.0, 10.0, 10.0, None, 12.0]
    routed = [1.0, 11.5, None, 13.0, 12.5]
    assert paired_added(direct, routed, warmup=1) == [1.5, 0.5]  # turn 0 warm-up, turns 2 and 3 each missing one side
    assert paired_added(direct, routed, warmup=0) == [-8.0, 1.5, 0.5]


def test_pct_is_a_nearest_rank_percentile():
    assert pct([], 0.5) is None
    vals = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert pct(vals, 0.5) == 3.0 and pct(vals, 0.9) == 5.0 and pct(vals, 0.0) == 1.0
    assert pct(list(range(100)), 0.9) == 90
