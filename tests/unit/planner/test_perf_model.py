"""PerfModel: interpolation, monotone prefill, B* binary search; the bundled profiles load."""

from __future__ import annotations

import pytest

from planner.config import PlannerConfigError
from planner.perf_model import PerfModel, load_perf_model


@pytest.mark.parametrize("isl,ms", [
    (0, 10.0),        # first point
    (500, 15.0),      # linear between 0 and 1000
    (9000, 100.0),    # a point
    (30000, 310.0),   # past the end: the last slope (0.01 ms/token)
])
def test_prefill_interpolation(perf, isl, ms):
    assert perf.prefill_ms(isl) == pytest.approx(ms)


def test_prefill_is_made_monotone():
    m = PerfModel("bumpy", [100, 200, 300, 400], [10, 50, 30, 60], [(0.0, 100.0, 5.0), (1.0, 100.0, 10.0)], 1000)
    ys = [m.prefill_ms(x) for x in (100, 200, 300, 400)]
    assert ys == sorted(ys) and ys[1] == pytest.approx(40.0)  # 50 and 30 pooled


@pytest.mark.parametrize("u,ctx,ms", [
    (0.0, 1000, 5.0), (0.5, 1000, 15.0), (1.0, 5000, 25.0),
    (2.0, 1000, 25.0),   # beyond the measured usage: clamped
    (0.5, 50000, 15.0),  # beyond the measured contexts: clamped to the last row
])
def test_itl_bilinear(perf, u, ctx, ms):
    assert perf.itl_ms(u, ctx) == pytest.approx(ms)


@pytest.mark.parametrize("ctx,itl,batch", [
    (1000, 15.0, 50),    # 5 + 20·B·1000/100000 <= 15  ->  B <= 50
    (1000, 25.0, 100),   # the whole KV cache: 100 sequences of 1000
    (10000, 25.0, 10),   # KV-capacity bound: 100000/10000
    (1000, 4.0, 0),      # even one sequence is slower than the target
])
def test_best_batch(perf, ctx, itl, batch):
    assert perf.best_batch(ctx, itl) == batch


def test_max_num_seqs_caps_the_batch():
    m = PerfModel("cap", [0, 1], [1, 2], [(0.0, 10.0, 1.0), (1.0, 10.0, 2.0)], 100_000, max_num_seqs=8)
    assert m.best_batch(10, 100.0) == 8


@pytest.mark.parametrize("name,gpus", [("h200-llama3.1-8b", 1), ("h100-llama3.3-70b-tp4", 4)])
def test_bundled_profiles_load(name, gpus):
    m = load_perf_model(name)
    assert m.gpus == gpus and m.max_kv_tokens > 0
    assert m.prefill_ms(4000) > m.prefill_ms(1000) > 0
    assert 0 < m.best_batch(4000, 30.0) <= 256


def test_unknown_profile_is_our_error():
    with pytest.raises(PlannerConfigError, match="cannot load performance profile"):
        load_perf_model("/nonexistent/profile")
