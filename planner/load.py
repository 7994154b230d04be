"""Load mode: one replica up or down per tick from queue, KV-usage and observed-latency thresholds.

Dynamo's 'easy mode' (its load-based planner): scale up if ANY worker crosses an up-threshold,
down only if ALL are below the down-thresholds. Signals by role:
    prefill  waiting requests per worker; observed TTFT p90 vs target
    decode   KV usage and waiting requests per worker; observed ITL p90 vs target
    both     all of the above
Up:   any worker waiting >= queue_up, or (decode/both) any KV usage >= kv_up, or an observed p90
      over its target.                                                   -> +1
Down: every worker waiting <= queue_down and (decode/both) KV usage <= kv_down, and every observed
      p90 <= latency_down_ratio·target (or not measured).               -> −1
Otherwise 0. Pure function of the observation.
"""

from __future__ import annotations

from planner.config import LoadThresholds
from planner.types import PoolObservation

__all__ = ["load_step"]


def load_step(po: PoolObservation, ttft_ms: float | None, itl_ms: float | None, th: LoadThresholds,
              queue_signal: bool = True) -> tuple[int, str]:
    """queue_signal False: waiting requests never trigger 'up' (hybrid mode's prefill pools, where
    the SLA model sizes for some queueing on purpose and the TTFT p90 is the check)."""
    role = po.pool.role
    uses_prefill = role in ("prefill", "both")
    uses_decode = role in ("decode", "both")
    s = po.stats
    ttft_p90 = s.ttft_p90_ms if s and uses_prefill else None
    itl_p90 = s.itl_p90_ms if s and uses_decode else None
    q = max(po.worker_queue, default=0.0)
    kv = max(po.worker_kv, default=0.0) if uses_decode else 0.0
    if queue_signal and po.worker_queue and q >= th.queue_up:
        return 1, f"a worker has {q:.0f} waiting requests (>= {th.queue_up:g})"
    if uses_decode and po.worker_kv and kv >= th.kv_up:
        return 1, f"a worker's KV cache is {kv:.0%} full (>= {th.kv_up:.0%})"
    if ttft_ms and ttft_p90 is not None and ttft_p90 > ttft_ms:
        return 1, f"observed TTFT p90 {ttft_p90:.0f} ms > target {ttft_ms:.0f} ms"
    if itl_ms and itl_p90 is not None and itl_p90 > itl_ms:
        return 1, f"observed ITL p90 {itl_p90:.1f} ms > target {itl_ms:.1f} ms"
    quiet_q = all(v <= th.queue_down for v in po.worker_queue)
    quiet_kv = not uses_decode or all(v <= th.kv_down for v in po.worker_kv)
    fast = ((ttft_p90 is None or not ttft_ms or ttft_p90 <= th.latency_down_ratio * ttft_ms)
            and (itl_p90 is None or not itl_ms or itl_p90 <= th.latency_down_ratio * itl_ms))
    if po.worker_queue and quiet_q and quiet_kv and fast:
        return -1, f"all workers quiet (waiting <= {th.queue_down:g}" + (f", KV <= {th.kv_down:.0%}" if uses_decode else "") + ") and latency well under target"
    return 0, "load within thresholds"
