"""Step-time model: how long one engine step (one forward pass) takes, from a measured profile.

Inputs per step: the prefill chunks `(p_i, n_i)` (tokens already computed before the chunk, incl.
prefix-cache hits, and tokens computed now) and the context lengths `c_j` of the decoding requests.

Prefill (profile: single-request TTFT(isl), measured by Dynamo's profiler with aiperf):
    T(x)  = piecewise-linear interpolation of TTFT over ISL, made monotone non-decreasing by
            isotonic regression (pool-adjacent-violators), extended to x = 0 and past the last point
            by the end segments' slopes;  T0 = max(T(0), 0) is the per-pass fixed cost.
    P     = [T0 if the step starts a request's prefill] + sum_i [T(p_i + n_i) - T(p_i)]
            (0 when the step has no prefill; a step with only continuation chunks pays no T0)
  so one prompt of L tokens costs exactly TTFT(L) whether or not it is chunked (the profile was
  measured on vLLM with chunked prefill, so chunking is already inside TTFT(L)); k prompts starting
  in one step share one T0; a prefix hit of h tokens saves T(h) - T0.

Decode (profile: ITL over points (kv_usage u, context length c), grouped in rows of equal c):
    u     = sum_j c_j / max_kv_tokens (the profile's KV capacity, not the sim's --num-gpu-blocks),
    c     = mean_j c_j,
    ITL(u, c) = within each of the two rows bracketing c, linear in u (clamped to the row's range:
            below it means fewer than one sequence at that context, above it is beyond what was
            measured), then linear in c between the two rows (clamped outside the rows' range).
    D     = ITL(u, c)                                    (0 when the step has no decode)

Prefill pricing "new-tokens" (`--prefill-pricing new-tokens`, Dynamo's mocker): P = T(sum_i n_i) for a step with
prefill, the new tokens alone, whatever is cached before them; a prefix hit then saves T(p + n) - T(n) instead of
T(p) - T0. Not the default: the profile measures a prompt from scratch, and computing n tokens after p cached ones
attends to all p + n (the marginal cost above). It exists to run kvyard on the mocker's terms in the side-by-side
benchmark (benchmarks/dynamo_compare.py --kvyard-engine mocker).

Step time = (P + D) / speedup, in milliseconds. This is the same split as Dynamo's mocker
(`prefill_ms + decode_ms`, /speedup) with its "interpolated" model, but with prefill charged per
chunk as a TTFT difference so chunking and prefix hits are priced by the profile itself.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from workers.sim.profiles import Profile

__all__ = ["TimingModel", "interp", "isotonic"]


def interp(x: float, xs: Sequence[float], ys: Sequence[float], extrapolate: bool = False) -> float:
    """Piecewise-linear y(x) through sorted xs; clamps at the ends unless `extrapolate`."""
    n = len(xs)
    if n == 1:
        return float(ys[0])
    i = bisect_right(xs, x)
    if i <= 0:
        if not extrapolate:
            return float(ys[0])
        i = 1
    elif i >= n:
        if not extrapolate:
            return float(ys[-1])
        i = n - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    if x1 == x0:
        return float(y1)
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _clamped(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """interp(x, xs, ys) without extrapolation (the decode rows' hot path: the same result, fewer branches)."""
    i = bisect_right(xs, x)
    if i <= 0:
        return float(ys[0])
    if i >= len(xs):
        return float(ys[-1])
    x0, x1 = xs[i - 1], xs[i]
    if x1 == x0:
        return float(ys[i])
    y0 = ys[i - 1]
    return y0 + (ys[i] - y0) * (x - x0) / (x1 - x0)


def isotonic(ys: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators), equal weights."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    out: list[float] = []
    for m, c in blocks:
        out.extend([m] * int(c))
    return out


class TimingModel:
    PRICINGS = ("profile", "new-tokens")

    def __init__(self, profile: Profile, speedup: float = 1.0, prefill_pricing: str = "profile") -> None:
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        if prefill_pricing not in self.PRICINGS:
            raise ValueError(f"prefill_pricing must be one of {self.PRICINGS}, not {prefill_pricing!r}")
        self.prefill_pricing = prefill_pricing
        self.profile = profile
        self.speedup = speedup
        self._isl = [float(v) for v in profile.prefill_isl]
        self._ttft = isotonic([float(v) for v in profile.prefill_ttft_ms])
        self.t0_ms = max(0.0, interp(0.0, self._isl, self._ttft, extrapolate=True))
        self.max_kv_tokens = profile.max_kv_tokens
        rows: dict[float, list[tuple[float, float]]] = {}
        for u, c, z in zip(profile.decode_kv_usage, profile.decode_context, profile.decode_itl_ms):
            rows.setdefault(float(c), []).append((float(u), float(z)))
        self._ctx = sorted(rows)
        self._rows = []
        for c in self._ctx:
            pts = sorted(rows[c])
            self._rows.append(([p[0] for p in pts], [p[1] for p in pts]))

    # ---- components, in profile milliseconds (not divided by speedup) --------------------------
    def ttft_ms(self, isl: float) -> float:
        """T(x): the monotone prefill curve, T(0) = T0."""
        if isl <= 0:
            return self.t0_ms
        return max(self.t0_ms, interp(float(isl), self._isl, self._ttft, extrapolate=True))

    def prefill_ms(self, chunks: Sequence[tuple[int, int]], starts_request: bool = True) -> float:
        """P for one step; `starts_request`: some chunk is a request's first since admission."""
        if not chunks:
            return 0.0
        if self.prefill_pricing == "new-tokens":
            return self.ttft_ms(sum(n for _, n in chunks))
        total = self.t0_ms if starts_request else 0.0
        for p, n in chunks:
            total += self.ttft_ms(p + n) - self.ttft_ms(p)
        return total

    def itl_ms(self, kv_usage: float, context: float) -> float:
        ctx = self._ctx
        j = bisect_right(ctx, context)
        if j <= 0:
            return _clamped(kv_usage, *self._rows[0])
        if j >= len(ctx):
            return _clamped(kv_usage, *self._rows[-1])
        c0, c1 = ctx[j - 1], ctx[j]
        z0 = _clamped(kv_usage, *self._rows[j - 1])
        z1 = _clamped(kv_usage, *self._rows[j])
        return z0 + (z1 - z0) * (context - c0) / (c1 - c0)

    def decode_ms(self, contexts: Sequence[int]) -> float:
        if not contexts:
            return 0.0
        total = float(sum(contexts))
        return self.itl_ms(total / self.max_kv_tokens, total / len(contexts))

    # ---- the step ------------------------------------------------------------------------------
    def step_ms(self, prefill_chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int], starts_request: bool = True) -> float:
        """Wall-clock milliseconds of one step after `speedup`."""
        return (self.prefill_ms(prefill_chunks, starts_request) + self.decode_ms(decode_contexts)) / self.speedup

    def plan_ms(self, plan, kv=None) -> float:
        """step_ms of a scheduler's StepPlan (the engine core's call; `kv` is not needed by this model)."""
        return (self.prefill_ms(plan.prefill_chunks, plan.starts_prefill) + self.decode_ms(plan.decode_contexts)) / self.speedup
