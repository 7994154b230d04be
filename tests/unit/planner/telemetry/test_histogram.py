"""Histogram: fixed edges, merge by addition, quantiles within a bucket's width."""

from __future__ import annotations

import random

import pytest

from planner.telemetry.histogram import ITL_EDGES_MS, TTFT_EDGES_MS, Histogram, log_edges


def test_edges_are_log_spaced_and_cover_the_range():
    assert TTFT_EDGES_MS[0] == 1.0 and TTFT_EDGES_MS[-1] >= 120_000
    assert ITL_EDGES_MS[0] == 0.25 and ITL_EDGES_MS[-1] >= 5_000
    ratios = {round(b / a, 3) for a, b in zip(TTFT_EDGES_MS, TTFT_EDGES_MS[1:])}
    assert ratios <= {1.149, 1.15, 1.151}


@pytest.mark.parametrize("values,q,expected", [
    ([100.0] * 10, 0.9, 100.0),              # all in one bucket: answer inside it
    (list(range(1, 101)), 0.5, 50.0),         # uniform 1..100: median ~50
    (list(range(1, 101)), 0.9, 90.0),         # p90 ~90
    (list(range(1, 101)), 0.99, 99.0),        # p99 ~99
    ([5.0] * 90 + [500.0] * 10, 0.9, 5.0),    # the 90th value is still a 5
    ([5.0] * 89 + [500.0] * 11, 0.9, 500.0),  # one more slow one moves p90 to the slow mode
])
def test_quantiles_within_bucket_width(values, q, expected):
    h = Histogram(TTFT_EDGES_MS)
    for v in values:
        h.observe(v)
    assert h.quantile(q) == pytest.approx(expected, rel=0.16)


def test_empty_and_overflow():
    h = Histogram(log_edges(1, 10))
    assert h.quantile(0.9) is None and h.mean is None
    h.observe(1e9)
    assert h.quantile(0.5) == h.edges[-1]
    h.observe(float("nan"))  # ignored
    assert h.total == 1


def test_merge_equals_observing_everything():
    rng = random.Random(7)
    vals = [rng.lognormvariate(4, 1) for _ in range(2000)]
    whole, a, b = (Histogram(TTFT_EDGES_MS) for _ in range(3))
    for i, v in enumerate(vals):
        whole.observe(v)
        (a if i % 2 else b).observe(v)
    a.merge(b)
    assert a.counts == whole.counts and a.total == whole.total and a.sum == pytest.approx(whole.sum)
    assert a.quantile(0.9) == whole.quantile(0.9)


def test_weighted_observation():
    h = Histogram(ITL_EDGES_MS)
    h.observe(10.0, weight=99)
    h.observe(100.0)
    assert h.total == 100 and h.quantile(0.5) == pytest.approx(10.0, rel=0.16)


def test_merge_refuses_other_edges():
    with pytest.raises(ValueError):
        Histogram(TTFT_EDGES_MS).merge(Histogram(ITL_EDGES_MS))
