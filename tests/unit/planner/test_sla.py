"""SLA sizing on the toy perf model (conftest): prefill queueing tail, decode B*, aggregated."""

from __future__ import annotations

import math

import pytest

from planner.sla import aggregated_replicas, decode_replicas, erlang_c, prefill_replicas, ttft_tail
from planner.types import Demand


@pytest.mark.parametrize("n,a,c", [
    (1, 0.5, 0.5),        # M/M/1: P(wait) = ρ
    (2, 1.0, 1 / 3),      # textbook value
    (3, 3.0, 1.0),        # saturated
    (10, 5.0, 0.0361),    # Erlang C(10, 5)
])
def test_erlang_c(n, a, c):
    assert erlang_c(n, a) == pytest.approx(c, abs=1e-3)


def test_ttft_tail_mm1_closed_form():
    # M/M/1 sojourn time is Exp(μ − λ): P(T > t) = e^{−(μ−λ)t}
    import math

    assert ttft_tail(1, rate=5.0, s=0.1, t=0.3) == pytest.approx(math.exp(-(10 - 5) * 0.3), rel=1e-6)


@pytest.mark.parametrize("rate,isl,hit,ttft,expected", [
    (0.0, 1000, 0.0, 500, 0),     # no demand
    (5.0, 9000, 0.0, 500, 1),     # s = 100 ms, a = 0.5: one replica meets p90 500 ms (P = e^{-5·0.5}·... )
    (50.0, 9000, 0.0, 500, 6),    # a = 5: the 0.9 utilisation cap decides (tail 2.7% at 6)
    (50.0, 9000, 0.5, 500, 4),    # a 50% prefix hit halves the prompt (s = 55 ms)
    (50.0, 9000, 0.0, 150, 9),    # a tight target (1.5× service) needs more
    (100.0, 9000, 0.0, 1000, 12), # larger pools run busier (pooling): a = 10 -> 12
])
def test_prefill_replicas(perf, rate, isl, hit, ttft, expected):
    n, why = prefill_replicas(perf, Demand(rate, isl, 100, hit), ttft)
    assert n == expected, why


def test_prefill_infeasible_target_says_so(perf):
    n, why = prefill_replicas(perf, Demand(20.0, 9000, 100, 0.0), ttft_ms=120)  # p90 of Exp(100 ms) is 230 ms
    assert "out of reach" in why and n >= 3


@pytest.mark.parametrize("rate,isl,osl,itl,tps,expected", [
    (0.0, 1000, 100, 15, None, 0),
    (1.0, 950, 100, 15, None, 1),      # ctx 1000, B* 50; L = 1·100·0.015 = 1.5 seqs
    (100.0, 950, 100, 15, None, 4),    # L = 150 seqs; p90 cap x_max(50) = 41.6 -> 4
    (100.0, 950, 100, 25, None, 3),    # B* 100 at ITL 25 ms: L = 250 seqs, p90 cap x_max 87.4 -> 3
    (1.0, 950, 100, 15, 20000, 6),     # tokens/s target: 50/15 ms = 3333 tok/s per replica -> 6
])
def test_decode_replicas(perf, rate, isl, osl, itl, tps, expected):
    n, why = decode_replicas(perf, Demand(rate, isl, osl, 0.0), itl, tps)
    assert n == expected, why


def test_decode_unreachable_itl(perf):
    n, why = decode_replicas(perf, Demand(10.0, 950, 100, 0.0), itl_ms=4.0)
    assert "out of reach" in why and n >= 1


def test_aggregated_shares_each_replicas_time_between_the_phases(perf):
    """A replica that prefills a share ρ of its time decodes in the rest: its sequences' gap is ITL_dec(B)/(1 − ρ). The
    count is the smallest n where that fits the ITL target at the p90 batch; one fewer does not."""
    d = Demand(50.0, 9000, 100, 0.0)
    pn, _ = prefill_replicas(perf, d, 1e9, max_util=0.9)
    n, why = aggregated_replicas(perf, d, 500, 25, max_util=0.9)
    assert n > pn and "replicas busy" in why and "decode share" in why
    a = 50.0 * perf.prefill_ms(9000) / 1000.0

    def fits(k: int) -> bool:
        rho = a / k
        b = perf.best_batch(9050, 25 * (1 - rho))
        if b == 0:
            return False
        seqs = 50.0 * 100 * perf.batch_itl_ms(b, 9050) / (1 - rho) / 1000.0
        return seqs / k <= ((-1.2816 + math.sqrt(1.2816**2 + 4 * b)) / 2) ** 2

    assert fits(n) and not fits(n - 1)
    # more prefill work on the same decode demand costs decode capacity too, not only prefill busy time
    n2, _ = aggregated_replicas(perf, Demand(50.0, 18000, 100, 0.0), 500, 25, max_util=0.9)
    assert n2 > n
