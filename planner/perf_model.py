"""Performance model of one replica from a Dynamo-profiler NPZ profile (the same files the sim uses).

Prefill (prefill.npz: `prefill_isl`, `prefill_ttft` ms, one request at a time):
    T(x) = piecewise-linear TTFT over ISL, made non-decreasing (pool-adjacent-violators), extended
           past the last point by the last segment's slope; prefill throughput = x / T(x).
Decode (decode.npz: `x_kv_usage`, `y_context_length`, `z_itl` ms, `max_kv_tokens`):
    ITL(u, c) = linear in KV usage u within the two measured rows bracketing context c (clamped to
                each row's range), then linear in c between them (clamped outside).
    best_batch(c, itl) = the largest B <= min(max_kv_tokens / c, max_num_seqs) with
                ITL(B·c / max_kv_tokens, c) <= itl, by binary search (Dynamo's B*); 0 if even B = 1
                is too slow.
Profiles load through workers.sim.profiles.load_profile (bundled names or a directory).
"""

from __future__ import annotations

import math
from bisect import bisect_right

from planner.config import PlannerConfigError

__all__ = ["PerfModel", "load_perf_model"]


def _pav(ys: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def _interp(x: float, xs: list[float], ys: list[float], extrapolate: bool = False) -> float:
    if len(xs) == 1:
        return ys[0]
    i = bisect_right(xs, x)
    if i <= 0 or i >= len(xs):
        if not extrapolate:
            return ys[0] if i <= 0 else ys[-1]
        i = 1 if i <= 0 else len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class PerfModel:
    def __init__(self, name: str, prefill_isl: list[float], prefill_ttft_ms: list[float],
                 decode_points: list[tuple[float, float, float]], max_kv_tokens: int, gpus: int = 1,
                 max_num_seqs: int = 256) -> None:
        if not prefill_isl or not decode_points or max_kv_tokens <= 0:
            raise PlannerConfigError(f"profile {name!r} is empty or has no KV capacity")
        order = sorted(range(len(prefill_isl)), key=lambda i: prefill_isl[i])
        self.name = name
        self.gpus = gpus
        self.max_num_seqs = max_num_seqs
        self.max_kv_tokens = int(max_kv_tokens)
        self._isl = [float(prefill_isl[i]) for i in order]
        self._ttft = _pav([float(prefill_ttft_ms[i]) for i in order])
        rows: dict[float, list[tuple[float, float]]] = {}
        for u, c, z in decode_points:
            if all(math.isfinite(v) for v in (u, c, z)):
                rows.setdefault(float(c), []).append((float(u), float(z)))
        self._ctx = sorted(rows)
        self._rows = [([u for u, _ in sorted(rows[c])], [z for _, z in sorted(rows[c])]) for c in self._ctx]

    @classmethod
    def from_profile(cls, profile, max_num_seqs: int = 256) -> PerfModel:
        pts = list(zip(profile.decode_kv_usage.tolist(), profile.decode_context.tolist(), profile.decode_itl_ms.tolist()))
        return cls(profile.name, profile.prefill_isl.tolist(), profile.prefill_ttft_ms.tolist(), pts,
                   profile.max_kv_tokens, gpus=profile.tp, max_num_seqs=max_num_seqs)

    # ---- prefill -------------------------------------------------------------------------------
    def prefill_ms(self, isl: float) -> float:
        """T(isl): single-request prefill time in ms (>= the first measured point's time at isl ~ 0)."""
        t = _interp(max(float(isl), 0.0), self._isl, self._ttft, extrapolate=True)
        return max(t, min(self._ttft[0], 1.0))

    def prefill_tokens_per_s(self, isl: float) -> float:
        isl = max(float(isl), 1.0)
        return isl / (self.prefill_ms(isl) / 1000.0)

    # ---- decode --------------------------------------------------------------------------------
    def itl_ms(self, kv_usage: float, context: float) -> float:
        j = bisect_right(self._ctx, context)
        if j <= 0:
            return _interp(kv_usage, *self._rows[0])
        if j >= len(self._ctx):
            return _interp(kv_usage, *self._rows[-1])
        c0, c1 = self._ctx[j - 1], self._ctx[j]
        z0, z1 = _interp(kv_usage, *self._rows[j - 1]), _interp(kv_usage, *self._rows[j])
        return z0 + (z1 - z0) * (context - c0) / (c1 - c0)

    def batch_itl_ms(self, batch: float, context: float) -> float:
        return self.itl_ms(batch * context / self.max_kv_tokens, context)

    def max_batch(self, context: float) -> int:
        return max(0, min(int(self.max_kv_tokens // max(context, 1.0)), self.max_num_seqs))

    def best_batch(self, context: float, itl_ms: float) -> int:
        """Dynamo's B*: the largest batch whose ITL stays within itl_ms (0 if none does)."""
        lo, hi = 0, self.max_batch(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.batch_itl_ms(mid, context) <= itl_ms:
                lo = mid
            else:
                hi = mid - 1
        return lo


def load_perf_model(name_or_path: str, max_num_seqs: int = 256) -> PerfModel:
    """A bundled profile name (see workers.sim.profiles) or a directory with prefill.npz + decode.npz."""
    from workers.sim.profiles import load_profile

    try:
        return PerfModel.from_profile(load_profile(name_or_path), max_num_seqs=max_num_seqs)
    except (ValueError, OSError, KeyError) as exc:
        raise PlannerConfigError(f"cannot load performance profile {name_or_path!r}: {exc}") from exc
