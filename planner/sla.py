"""SLA sizing: replicas a pool needs for a predicted demand, from the perf model (Dynamo §4 baseline).

Prefill (per request: eff_isl = isl·(1 − min(kv_hit, 0.95)), service s = T(eff_isl)):
    offered load a = rate·s (busy replicas). Dynamo sizes ceil(a); we size for the TTFT p90 target T
    with an M/M/n queue (JSQ routing ~ one shared queue; exponential service stands in for the spread
    of prompt lengths):  C = ErlangC(n, a),  θ = n/s − rate,  μ = 1/s,
        P(TTFT > T) = (1 − C)·e^{−μT} + C·(θ·e^{−μT} − μ·e^{−θT})/(θ − μ)
    Prompt lengths spread more (or less) than an exponential: with CV² of the prompt lengths c²,
    the queueing part is stretched by Allen–Cunneen's M/G/n factor, θ -> θ·2/(1 + c²).
    n = the smallest n >= a/max_util with P(TTFT > T) <= 0.1. If even an idle replica misses T
    (the service alone is too slow) the target is infeasible: n is sized so C(n, a) <= 0.1 and the
    reason says so.
Decode (ctx = isl + osl/2, B* = best_batch(ctx, ITL target), Dynamo's binary search):
    concurrent sequences L = rate·osl·ITL(B*) (Little's law); sequences per replica x fluctuate
    like a Poisson count, so x is capped where its p90 fits: x + 1.28·√x <= B*, i.e.
    x_max = ((−1.28 + √(1.28² + 4B*))/2)²;  n = ceil(L / x_max).
    A tokens/s target adds n >= tokens_per_s / (B*/ITL(B*)).
Aggregated (role both): one replica's time is shared between the phases. With n replicas each prefills a share
    ρ = a/n of its time, so its running sequences get a mean inter-token gap of ITL_dec(B)/(1 − ρ); decode's batch
    B* is searched within the target's decode share, ITL target·(1 − ρ). n = the smallest n >= a/max_util where
    L/n (L from Little's law at that gap) fits the p90 batch cap and the TTFT tail fits as for prefill.
"""

from __future__ import annotations

import math

from planner.perf_model import PerfModel
from planner.types import Demand

__all__ = ["erlang_c", "ttft_tail", "prefill_replicas", "decode_replicas", "aggregated_replicas"]

_Z90 = 1.2816
_TAIL = 0.1  # p90


def erlang_c(n: int, a: float) -> float:
    """Probability of waiting in an M/M/n queue with offered load a (1.0 when a >= n)."""
    if n <= 0 or a >= n:
        return 1.0
    b = 1.0
    for k in range(1, n + 1):
        b = a * b / (k + a * b)
    return n * b / (n - a * (1 - b))


def ttft_tail(n: int, rate: float, s: float, t: float, cv2: float = 1.0) -> float:
    """P(TTFT > t) for n replicas, arrival rate `rate`/s, mean service s seconds (M/M/n sojourn,
    the wait stretched by (1 + cv2)/2 for service-time spread cv2)."""
    a = rate * s
    if a >= n:
        return 1.0
    mu, theta = 1.0 / s, (n / s - rate) * 2.0 / (1.0 + max(cv2, 0.0))
    c = erlang_c(n, a)
    direct = math.exp(-mu * t)
    if abs(theta - mu) < 1e-12:
        queued = (1 + mu * t) * math.exp(-mu * t)
    else:
        queued = (theta * math.exp(-mu * t) - mu * math.exp(-theta * t)) / (theta - mu)
    return (1 - c) * direct + c * queued


def _eff_isl(d: Demand) -> float:
    return d.isl * (1 - min(max(d.kv_hit_rate, 0.0), 0.95))


def prefill_replicas(perf: PerfModel, d: Demand, ttft_ms: float, max_util: float = 0.9) -> tuple[int, str]:
    if d.request_rate <= 0:
        return 0, "no demand"
    s = perf.prefill_ms(_eff_isl(d)) / 1000.0
    a = d.request_rate * s
    n = max(1, math.ceil(a / max_util))
    t = ttft_ms / 1000.0
    cv2 = d.isl_cv2
    feasible = ttft_tail(10_000, d.request_rate, s, t, cv2) <= _TAIL if a < 10_000 else False
    while n < 100_000:
        if feasible and ttft_tail(n, d.request_rate, s, t, cv2) <= _TAIL:
            return n, f"prefill {s * 1000:.0f} ms/request (eff ISL {_eff_isl(d):.0f}), load {a:.2f} replicas busy, ISL CV² {cv2:.1f}, TTFT p90 <= {ttft_ms:.0f} ms"
        if not feasible and erlang_c(n, a) <= _TAIL:
            return n, (f"TTFT p90 {ttft_ms:.0f} ms is out of reach (prefill alone {s * 1000:.0f} ms at eff ISL "
                       f"{_eff_isl(d):.0f}); sized for little queueing at load {a:.2f}")
        n += 1
    return n, "capped"


def _decode_slots(perf: PerfModel, d: Demand, itl_ms: float) -> tuple[float, float, int, float, str]:
    """(concurrent sequences L, per-replica cap x_max, B*, ITL(B*), note)."""
    ctx = d.isl + d.osl / 2
    b = perf.best_batch(ctx, itl_ms)
    note = ""
    if b == 0:
        b, note = 1, f"; ITL {itl_ms:.1f} ms is out of reach at context {ctx:.0f} (one sequence takes {perf.batch_itl_ms(1, ctx):.1f} ms)"
    itl = perf.batch_itl_ms(b, ctx)
    seqs = d.request_rate * d.osl * itl / 1000.0
    x_max = max(((-_Z90 + math.sqrt(_Z90**2 + 4 * b)) / 2) ** 2, 0.25)
    return seqs, x_max, b, itl, note


def decode_replicas(perf: PerfModel, d: Demand, itl_ms: float, tokens_per_s: float | None = None) -> tuple[int, str]:
    if d.request_rate <= 0 and not tokens_per_s:
        return 0, "no demand"
    seqs, x_max, b, itl, note = _decode_slots(perf, d, itl_ms)
    n = math.ceil(seqs / x_max - 1e-9)
    why = f"{seqs:.1f} sequences in flight, B*={b} at ITL {itl:.1f} ms (<= {x_max:.1f}/replica for p90){note}"
    if tokens_per_s:
        per = b / itl * 1000.0
        need = math.ceil(tokens_per_s / per - 1e-9)
        if need > n:
            n, why = need, f"{tokens_per_s:.0f} tokens/s target at {per:.0f} tokens/s/replica; " + why
    return n, why


def aggregated_replicas(perf: PerfModel, d: Demand, ttft_ms: float, itl_ms: float, max_util: float = 0.9,
                        tokens_per_s: float | None = None) -> tuple[int, str]:
    """One replica serves both phases and its time is shared: with n replicas each spends a share ρ = a/n of its time
    prefilling (a = rate·s busy replicas), so a running sequence's mean inter-token gap is ITL_dec(B)/(1 − ρ). The
    smallest n that keeps that within the ITL target at the p90 batch, and the TTFT tail within its target."""
    if d.request_rate <= 0 and not tokens_per_s:
        return 0, "no demand"
    s = perf.prefill_ms(_eff_isl(d)) / 1000.0
    a = d.request_rate * s
    ctx = d.isl + d.osl / 2
    t = ttft_ms / 1000.0
    ttft_ok = a < 10_000 and ttft_tail(10_000, d.request_rate, s, t, d.isl_cv2) <= _TAIL
    n = max(1, math.ceil(a / max_util - 1e-9))
    while n < 100_000:
        rho = a / n
        budget = itl_ms * (1.0 - rho)  # decode's share of the target
        b = perf.best_batch(ctx, budget)
        if b > 0:
            itl = perf.batch_itl_ms(b, ctx) / (1.0 - rho)
            seqs = d.request_rate * d.osl * itl / 1000.0
            x_max = max(((-_Z90 + math.sqrt(_Z90**2 + 4 * b)) / 2) ** 2, 0.25)
            decode_ok = seqs / n <= x_max
            prefill_ok = ttft_tail(n, d.request_rate, s, t, d.isl_cv2) <= _TAIL if ttft_ok else erlang_c(n, a) <= _TAIL
            if decode_ok and prefill_ok:
                why = (f"prefill {a:.2f} replicas busy ({rho:.0%} of each), {seqs:.1f} sequences in flight at ITL {itl:.1f} ms "
                       f"(B*={b} in the decode share, <= {x_max:.1f}/replica for p90)")
                if not ttft_ok:
                    why += f"; TTFT p90 {ttft_ms:.0f} ms is out of reach (prefill alone {s * 1000:.0f} ms)"
                break
        elif rho == 0.0 or perf.best_batch(ctx, itl_ms) == 0:  # even an idle replica misses the ITL target
            seqs, x_max, b, itl, note = _decode_slots(perf, d, itl_ms)
            n = max(n, math.ceil(a / max_util + seqs / x_max - 1e-9))
            why = f"prefill busy {a:.2f} + decode {seqs / x_max:.2f} replicas (B*={b}, ITL {itl:.1f} ms){note}"
            break
        n += 1
    else:
        why = "capped"
    if tokens_per_s:
        b0 = max(perf.best_batch(ctx, itl_ms), 1)
        need = math.ceil(tokens_per_s / (b0 / perf.batch_itl_ms(b0, ctx) * 1000.0) - 1e-9)
        if need > n:
            n, why = need, f"tokens/s target {tokens_per_s:.0f}; " + why
    return n, why
