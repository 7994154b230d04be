"""Dynamo's mocker step timing (its "interpolated" model), so kvyard's sim can run on the mocker's terms.

Input: a mocker-format NPZ (what Dynamo's `planner_profiler_perf_data_converter` writes from a profiler
directory): `prefill_isl`, `prefill_ttft_ms` (1-D), `decode_active_kv_tokens`, `decode_context_length` (1-D
axes) and `decode_itl` (2-D, one row per active-KV value). The formulas are the mocker's (Dynamo 1.6.x,
`lib/mocker/src/common/perf_model.rs` and the vLLM scheduler core's pass):

    prefill_ms = max(0, P(b · (⌊Σ(p+n)/b⌋ − ⌊Σp/b⌋)))    over the b prefill chunks (p cached/computed before,
                                                           n new) of the step; 0 when b = 0 or no new tokens
    decode_ms  = max(1, D(active_kv, ⌊Σc/k⌋))              over the k requests that sample a token this step
                                                           (decodes, and prefills whose last chunk ran), with
                                                           c their context lengths and active_kv = blocks in use
                                                           × block size; 0 when k = 0
    step_ms    = (prefill_ms + decode_ms) / speedup

P is linear interpolation with linear extrapolation past both ends; D is bilinear interpolation on the grid,
extrapolated from the edge cells. kvyard's own model (workers/sim/timing.py) prices prefill from the profile's
TTFT curve per chunk and decode from its (KV usage, context) rows; this one exists for side-by-side
agreement with Dynamo's replay (docs/replay.md), not as a better model.
"""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path

import numpy as np

from workers.sim.timing import interp

__all__ = ["MOCKER_KEYS", "MockerTiming", "is_mocker_npz"]

MOCKER_KEYS = ("prefill_isl", "prefill_ttft_ms", "decode_active_kv_tokens", "decode_context_length", "decode_itl")


def is_mocker_npz(path: str | Path) -> bool:
    """A file holding the mocker's five arrays."""
    p = Path(path)
    if not p.is_file() or p.suffix != ".npz":
        return False
    with np.load(p) as npz:
        return all(k in npz.files for k in MOCKER_KEYS)


class MockerTiming:
    def __init__(self, path: str | Path, speedup: float = 1.0) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        with np.load(Path(path)) as npz:
            missing = [k for k in MOCKER_KEYS if k not in npz.files]
            if missing:
                raise ValueError(f"{path}: not a mocker perf-data NPZ (missing {', '.join(missing)})")
            self._isl = [float(v) for v in np.asarray(npz["prefill_isl"], dtype=float).ravel()]
            self._ttft = [float(v) for v in np.asarray(npz["prefill_ttft_ms"], dtype=float).ravel()]
            self._kv = [float(v) for v in np.asarray(npz["decode_active_kv_tokens"], dtype=float).ravel()]
            self._ctx = [float(v) for v in np.asarray(npz["decode_context_length"], dtype=float).ravel()]
            itl = np.asarray(npz["decode_itl"], dtype=float)
        if len(self._isl) != len(self._ttft) or len(self._isl) < 2:
            raise ValueError(f"{path}: prefill_isl and prefill_ttft_ms must be equal-length, >= 2 points")
        if itl.shape != (len(self._kv), len(self._ctx)) or min(itl.shape) < 2:
            raise ValueError(f"{path}: decode_itl must be (len(active_kv), len(context)) >= 2x2, is {itl.shape}")
        self._itl = itl.tolist()
        self._last_x, self._last_y = len(self._kv) - 2, len(self._ctx) - 2
        self.path = str(path)
        self.speedup = speedup
        self.prefill_pricing = "mocker"

    def prefill_ms(self, batch_count: int, total_isl: int, total_prefix: int) -> float:
        if batch_count == 0:
            return 0.0
        new = total_isl // batch_count - total_prefix // batch_count
        if new <= 0:
            return 0.0
        return max(0.0, interp(float(batch_count * new), self._isl, self._ttft, extrapolate=True))

    def decode_ms(self, active_kv_tokens: float, context_length: float) -> float:
        xs, ys, z = self._kv, self._ctx, self._itl
        i = bisect_right(xs, active_kv_tokens) - 1  # the grid cell used for x (an edge cell outside: extrapolation)
        i = 0 if i < 0 else (self._last_x if i > self._last_x else i)
        j = bisect_right(ys, context_length) - 1
        j = 0 if j < 0 else (self._last_y if j > self._last_y else j)
        x0, y0 = xs[i], ys[j]
        tx = (active_kv_tokens - x0) / (xs[i + 1] - x0)
        ty = (context_length - y0) / (ys[j + 1] - y0)
        zi, zi1 = z[i], z[i + 1]
        z0 = zi[j] + (zi1[j] - zi[j]) * tx
        z1 = zi[j + 1] + (zi1[j + 1] - zi[j + 1]) * tx
        v = z0 + (z1 - z0) * ty
        return v if v > 1.0 else 1.0

    def plan_ms(self, plan, kv) -> float:
        """A scheduler StepPlan's step time on the engine's KV manager `kv` (blocks in use after scheduling)."""
        chunks = plan.prefill_chunks
        if not chunks:  # decode only: the common step
            ctxs = plan.decode_contexts
            active = (kv.num_gpu_blocks - 1 - kv.num_free_blocks) * kv.block_size
            return self.decode_ms(float(active), float(sum(ctxs) // len(ctxs))) / self.speedup if ctxs else 0.0
        pre = 0.0
        if chunks:
            total_isl = total_prefix = 0
            for p, n in chunks:
                total_isl += p + n
                total_prefix += p
            pre = self.prefill_ms(len(chunks), total_isl, total_prefix)
        ctxs = plan.decode_contexts
        k = len(ctxs) + plan.prefills_done
        dec = 0.0
        if k:
            active = (kv.num_gpu_blocks - 1 - kv.num_free_blocks) * kv.block_size
            dec = self.decode_ms(float(active), float((sum(ctxs) + plan.prefills_done_tokens) // k))
        return (pre + dec) / self.speedup
