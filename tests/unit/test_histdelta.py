"""benchmarks/histdelta.py: histogram differences between two scrapes, quantiles interpolated per bucket."""

from benchmarks.histdelta import hist_delta

BEFORE = """# TYPE t histogram
t_bucket{le="0.1",m="a"} 2
t_bucket{le="1.0",m="a"} 2
t_bucket{le="+Inf",m="a"} 2
t_sum{m="a"} 0.1
t_count{m="a"} 2
"""
AFTER = """# TYPE t histogram
t_bucket{le="0.1",m="a"} 2
t_bucket{le="1.0",m="a"} 12
t_bucket{le="+Inf",m="a"} 12
t_sum{m="a"} 5.1
t_count{m="a"} 12
t_bucket{le="0.1",m="b"} 0
t_bucket{le="1.0",m="b"} 0
t_bucket{le="+Inf",m="b"} 2
t_sum{m="b"} 6.0
t_count{m="b"} 2
"""


def test_delta_counts_only_what_happened_between_the_scrapes() -> None:
    d = hist_delta(BEFORE, AFTER, "t")
    assert d["n"] == 12  # 10 new in (0.1, 1.0] for a, 2 new past 1.0 for b
    assert d["mean"] == round(11.0 / 12, 4)
    assert d["p50"] == round(0.1 + 0.9 * (6 / 10), 4)  # rank 6 of the 10 in the (0.1, 1] bucket
    assert d["p99"] == 1.0  # in the +Inf bucket: only its lower bound is known


def test_no_observations_gives_none() -> None:
    d = hist_delta(AFTER, AFTER, "t")
    assert d == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_missing_histogram_is_empty() -> None:
    assert hist_delta("", "", "nope")["n"] == 0
