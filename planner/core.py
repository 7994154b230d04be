"""The planner state machine: `on_tick(now, observation) -> Decision`. Zero I/O (no asyncio, Redis,
HTTP or files): the loop feeds it observations and applies what it returns.

Per managed pool (every pool listed in the targets), each tick:
  1. hold      telemetry store unreachable, or no fresh data for the pool (none in the window, or
               the newest bucket older than stale_after_s): keep the current count (only min/max
               are still enforced).
  2. predict   feed the window's demand (arrival rate, else finish rate; mean ISL, OSL, KV hit rate)
               to one predictor per quantity. The rate is forecast 1 + lookahead_s/interval_s ticks ahead
               (with peak_trend, a recent window floors it only where it stood out of the trend by more than
               its own Poisson sampling error, 1.28/√N for N arrivals); ISL, OSL and hit rate are means of the
               request mix and are taken at their filtered level, not run ahead (a trend fitted to their
               sampling noise, extrapolated, sizes for that noise). The prompt-length spread CV² is taken as
               last observed. The rate is then sized with headroom: × min(1 + demand_z·√(MS − noise), max_headroom),
               MS the mean square of the relative one-tick forecast errors of the pool's work
               (prompt tokens/s for prefill, rate·osl·context for decode; EWMA, weight 0.2) and
               noise the window's own sampling error of that work, (1 + CV²)/N for N requests
               (net_of_sampling_noise; the queueing model already covers that randomness).
  3. size      sla:    replicas from the perf model for the predicted demand (sla.py);
               load:   current ± 1 from queue/KV/latency thresholds (load.py);
               hybrid: sla replicas + a load correction k >= 0 (k += 1 on a load 'up' the SLA
                       count did not already cover, but not within lookahead_s of the pool's last
                       scale-up: the replicas asked for are still starting and the signal is the fleet
                       without them; k −= 1 on a 'down' at most once per scale_down_cooldown_s) — the
                       SLA count is a floor. A pool that prefills (prefill or aggregated) does not take
                       its queue as an 'up' signal here (the SLA count plans for queueing up to the TTFT
                       target; its observed TTFT p90 is), unless hybrid_prefill_queue.
  4. guard     clamp to [min_replicas, max_replicas]; move at most max_step per tick; scale down
               only to the highest count wanted within scale_down_window_s (HPA-style
               stabilization) and not within scale_down_cooldown_s of the pool's last change.
  Then across pools: if Σ desired·gpus_per_replica > gpu_budget, every pool keeps min_replicas and
  the rest of the budget is shared in proportion to what each pool wanted above its minimum.
Every PoolDecision carries a reason. In advisory mode decisions are returned but marked advisory
(the loop records and does not apply them) and the cooldown clock does not move.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from planner.config import PlannerConfig
from planner.load import load_step
from planner.perf_model import PerfModel
from planner.predictors import Predictor, make_predictor
from planner.sla import aggregated_replicas, decode_replicas, prefill_replicas
from planner.types import Decision, Demand, Observation, PoolDecision, PoolObservation
from planner.telemetry.schema import PoolKey
from planner.telemetry.targets import PoolTarget

__all__ = ["PlannerCore"]

_QUANTITIES = ("request_rate", "isl", "osl", "kv_hit_rate")


class PlannerCore:
    def __init__(self, cfg: PlannerConfig, perf_models: Mapping[str, PerfModel] | None = None,
                 default_perf: PerfModel | None = None) -> None:
        self.cfg = cfg
        self.perf_models = dict(perf_models or {})
        self.default_perf = default_perf
        self.tick = 0
        self._predictors: dict[tuple[PoolKey, str], Predictor] = {}
        self._last_change: dict[PoolKey, float] = {}
        self._last_up: dict[PoolKey, float] = {}
        self._correction: dict[PoolKey, int] = {}
        self._wanted: dict[PoolKey, deque[tuple[float, int]]] = {}
        self._correction_at: dict[PoolKey, float] = {}
        self._cv2: dict[PoolKey, float] = {}
        self._last_rate_pred: dict[PoolKey, float] = {}
        self._rate_err2: dict[PoolKey, float] = {}

    # ---- the tick ------------------------------------------------------------------------------
    def on_tick(self, now: float, obs: Observation) -> Decision:
        self.tick += 1
        if obs.targets is None:
            return Decision(self.tick, now, [], self.cfg.advisory, None, "hold: no targets have been set")
        targets = obs.targets.targets
        out: list[PoolDecision] = []
        for pt in targets.pools:
            key = PoolKey(pt.model, pt.role.value)
            po = obs.pools.get(key) or PoolObservation(key, replicas=0)
            if not obs.telemetry_ok:
                out.append(self._hold(po, pt, "telemetry store unreachable" + (f" ({obs.note})" if obs.note else "")))
            else:
                out.append(self._plan(now, po, pt))
        self._apply_budget(out, targets.pools, targets.gpu_budget)
        if not self.cfg.advisory:
            for d in out:
                if d.changed:
                    self._last_change[d.pool] = now
                if d.desired > d.current:
                    self._last_up[d.pool] = now
        changed = [d for d in out if d.changed]
        summary = "; ".join(f"{d.pool} {d.current}->{d.desired}" for d in changed) or "no change"
        return Decision(self.tick, now, out, self.cfg.advisory, obs.targets.version, summary)

    # ---- one pool ------------------------------------------------------------------------------
    @staticmethod
    def _clamp(n: int, pt: PoolTarget) -> int:
        return max(pt.min_replicas, min(pt.max_replicas, n))

    def _hold(self, po: PoolObservation, pt: PoolTarget, why: str) -> PoolDecision:
        n = self._clamp(po.replicas, pt)
        if n != po.replicas:
            bound = "min_replicas" if n > po.replicas else "max_replicas"
            return PoolDecision(po.pool, po.replicas, n, f"{bound} is {n} (otherwise holding: {why})", held=True)
        return PoolDecision(po.pool, po.replicas, n, f"hold: {why}", held=True)

    def _demand(self, po: PoolObservation) -> Demand | None:
        s = po.stats
        assert s is not None
        rate = s.arrival_rate if s.arrival_rate > 0 else s.request_rate
        now_vals = {"request_rate": rate, "isl": s.avg_isl, "osl": s.avg_osl, "kv_hit_rate": s.kv_hit_rate}
        steps = 1.0 + self.cfg.lookahead_s / self.cfg.interval_s
        work = self._work(po.pool, rate, s.avg_isl, s.avg_osl)
        prev = self._last_rate_pred.get(po.pool)
        if prev is not None and work is not None and max(prev, work) > 0:  # how wrong was last tick's forecast?
            rel = (work - prev) / max(prev, work)
            old = self._rate_err2.get(po.pool)
            self._rate_err2[po.pool] = rel * rel if old is None else 0.8 * old + 0.2 * rel * rel
        n_obs = s.arrival_rate * s.window_s if s.arrival_rate > 0 else float(s.requests)
        rate_noise = 1.0 / math.sqrt(n_obs) if n_obs >= 1 else None  # Poisson: N arrivals are known to ±√N
        out = {}
        for q in _QUANTITIES:
            p = self._predictors.get((po.pool, q))
            if p is None:
                p = self._predictors[(po.pool, q)] = self._make_predictor(q)
            if now_vals[q] is not None:
                p.observe(now_vals[q], rate_noise if q == "request_rate" else None)
            # the rate is a load and is forecast over the horizon; ISL, OSL and hit rate are means of the request mix,
            # taken at their filtered level: a trend fitted to a window's sampling noise, run `steps` ticks ahead,
            # would size for that noise
            out[q] = p.predict(steps if q == "request_rate" else 0.0)
        nxt = self._work(po.pool, *(self._predictors[(po.pool, q)].predict(1.0) for q in ("request_rate", "isl", "osl")))
        if nxt is not None:
            self._last_rate_pred[po.pool] = nxt
        if out["kv_hit_rate"] is None:
            out["kv_hit_rate"] = 0.0
        if out["request_rate"] is None or (out["request_rate"] > 0 and (out["isl"] is None or out["osl"] is None)):
            return None
        if s.isl_cv2 is not None:
            self._cv2[po.pool] = s.isl_cv2
        err2 = self._rate_err2.get(po.pool, 0.0)
        if self.cfg.net_of_sampling_noise:
            err2 = max(0.0, err2 - self._sampling_noise2(po))
        headroom = min(1.0 + self.cfg.demand_z * math.sqrt(err2), self.cfg.max_headroom)
        return Demand(out["request_rate"] * headroom, out["isl"] or 0.0, out["osl"] or 0.0, min(max(out["kv_hit_rate"], 0.0), 1.0),
                      self._cv2.get(po.pool, 1.0))

    def _make_predictor(self, quantity: str) -> Predictor:
        """The configured predictor for the request rate; ISL, OSL and KV hit rate are means, not
        loads, so a peak-taking ensemble (which would also over-state the hit rate and so under-size
        prefill) forecasts them with its trend part alone."""
        name = self.cfg.predictor
        if quantity != "request_rate" and name == "peak_trend":
            name = "kalman"
        return make_predictor(name, self.cfg.peak_window if name == "peak_trend" else self.cfg.predictor_window)

    @staticmethod
    def _sampling_noise2(po: PoolObservation) -> float:
        """Squared relative sampling error of one window's work measurement: its N requests give the
        rate to 1/N (Poisson) and the mean prompt (prefill) or output x context (decode) to ~c²/N, with
        c² the prompt lengths' CV² (taken as 1 for decode's output lengths). The forecast cannot
        follow this noise and the queueing model already covers arrivals' randomness, so it is not
        sized for twice."""
        s = po.stats
        n = s.arrival_rate * s.window_s if s.arrival_rate > 0 else float(s.requests)
        if n < 1:
            return 0.0
        cv2 = s.isl_cv2 if (po.pool.role == "prefill" and s.isl_cv2 is not None) else 1.0
        return (1.0 + cv2) / n

    @staticmethod
    def _work(pool: PoolKey, rate: float | None, isl: float | None, osl: float | None) -> float | None:
        """The demand the forecast error is measured on: prompt tokens/s for prefill, KV-token
        occupancy (rate · osl · context) for decode and aggregated pools."""
        if rate is None or isl is None or (osl is None and pool.role != "prefill"):
            return None
        return rate * isl if pool.role == "prefill" else rate * osl * (isl + osl / 2)

    def _sla(self, po: PoolObservation, pt: PoolTarget, d: Demand) -> tuple[int, str] | None:
        perf = self.perf_models.get(pt.model, self.default_perf)
        if perf is None:
            return None
        ttft = pt.ttft_p90_ms or self.cfg.default_ttft_ms
        itl = pt.itl_p90_ms or self.cfg.default_itl_ms
        if po.pool.role == "prefill":
            return prefill_replicas(perf, d, ttft, self.cfg.max_prefill_utilization)
        if po.pool.role == "decode":
            return decode_replicas(perf, d, itl, pt.tokens_per_s)
        return aggregated_replicas(perf, d, ttft, itl, self.cfg.max_prefill_utilization, pt.tokens_per_s)

    def _plan(self, now: float, po: PoolObservation, pt: PoolTarget) -> PoolDecision:
        cfg = self.cfg
        if po.stats is None or po.data_age_s is None:
            return self._hold(po, pt, f"no telemetry for {po.pool} in the last {cfg.window:.0f} s")
        if po.data_age_s > cfg.stale_after_s:
            return self._hold(po, pt, f"telemetry for {po.pool} is {po.data_age_s:.0f} s old (stale after {cfg.stale_after_s:.0f} s)")
        demand = self._demand(po)
        if demand is None:
            return self._hold(po, pt, "no finished requests yet to size from")
        ttft = pt.ttft_p90_ms or cfg.default_ttft_ms
        itl = pt.itl_p90_ms or cfg.default_itl_ms
        sla_n: int | None = None
        if cfg.mode in ("sla", "hybrid"):
            sized = self._sla(po, pt, demand)
            if sized is None:
                return self._hold(po, pt, f"no performance profile for model {pt.model!r}")
            sla_n, why = sized
        if cfg.mode == "sla":
            raw, reason = sla_n, f"SLA: {why}"
        else:
            # a pool that prefills (prefill or aggregated) is sized for queueing up to the TTFT target, so in hybrid mode its
            # queue is no sign of under-sizing (its observed TTFT p90 is)
            queue_signal = cfg.mode == "load" or cfg.hybrid_prefill_queue or po.pool.role == "decode"
            delta, lwhy = load_step(po, ttft, itl, cfg.load, queue_signal)
            if cfg.mode == "load":
                raw, reason = po.replicas + delta, f"load: {lwhy}"
            else:
                k = self._correction.get(po.pool, 0)
                since = now - self._correction_at.get(po.pool, -math.inf)
                settling = now - self._last_up.get(po.pool, -math.inf) < cfg.lookahead_s
                if delta > 0 and sla_n + k <= po.replicas and not settling:
                    # (while replicas asked for are still starting, the signal is the fleet without them: no correction)
                    k += 1
                    self._correction_at[po.pool] = now
                elif delta < 0 and k > 0 and since >= cfg.scale_down_cooldown_s:
                    k -= 1  # at most one step down per cooldown: the model under-sized this pool before
                    self._correction_at[po.pool] = now
                self._correction[po.pool] = k
                raw = sla_n + k
                reason = f"SLA: {why}" + (f"; +{k} load correction ({lwhy})" if k else "")
        return self._guard(now, po, pt, raw, reason, demand, sla_n)

    def _guard(self, now: float, po: PoolObservation, pt: PoolTarget, raw: int, reason: str,
               demand: Demand, sla_n: int | None) -> PoolDecision:
        cur = po.replicas
        n = self._clamp(raw, pt)
        if n != raw:
            reason += f"; clamped {raw} to [{pt.min_replicas}, {pt.max_replicas}]"
        if abs(n - cur) > self.cfg.max_step:
            stepped = cur + self.cfg.max_step * (1 if n > cur else -1)
            reason += f"; limited to {self.cfg.max_step} per tick (wanted {n})"
            n = self._clamp(stepped, pt)
        held = False
        wanted = self._wanted.get(po.pool)
        if wanted is None:  # a planner that just started does not scale down within its first window
            wanted = self._wanted[po.pool] = deque([(now, cur)])
        wanted.append((now, n))
        while wanted and wanted[0][0] < now - self.cfg.scale_down_window_s:
            wanted.popleft()
        if n < cur and cur <= pt.max_replicas and self.cfg.scale_down_window_s > 0:
            floor = max(v for _, v in wanted)
            if floor > n:
                reason += f"; scale-down limited to {min(floor, cur)} (wanted up to {floor} in the last {self.cfg.scale_down_window_s:.0f} s)"
                n = min(floor, cur)
        if n < cur and cur <= pt.max_replicas:
            since = now - self._last_change.get(po.pool, -math.inf)
            if since < self.cfg.scale_down_cooldown_s:
                reason = f"hold scale-down to {n}: cooldown {self.cfg.scale_down_cooldown_s - since:.0f} s left ({reason})"
                n, held = cur, True
        if n == cur and not held:
            reason = f"keep {cur}: {reason}"
        return PoolDecision(po.pool, cur, n, reason, demand, sla_n, held)

    # ---- across pools --------------------------------------------------------------------------
    @staticmethod
    def _apply_budget(decisions: list[PoolDecision], pools: list[PoolTarget], budget: int | None) -> None:
        if budget is None or not decisions:
            return
        g = {PoolKey(p.model, p.role.value): p for p in pools}
        total = sum(d.desired * g[d.pool].gpus_per_replica for d in decisions)
        if total <= budget:
            return
        alloc = {d.pool: g[d.pool].min_replicas for d in decisions}
        left = budget - sum(alloc[d.pool] * g[d.pool].gpus_per_replica for d in decisions)
        want = {d.pool: max(0, d.desired - alloc[d.pool]) for d in decisions}
        want_gpus = sum(want[k] * g[k].gpus_per_replica for k in want)
        share = {k: want[k] * g[k].gpus_per_replica * left / want_gpus if want_gpus else 0.0 for k in want}
        for k in want:
            extra = min(want[k], int(share[k] // g[k].gpus_per_replica))
            alloc[k] += extra
            left -= extra * g[k].gpus_per_replica
        for k in sorted(want, key=lambda k: (share[k] % g[k].gpus_per_replica) / g[k].gpus_per_replica, reverse=True):
            if alloc[k] < want[k] + g[k].min_replicas and g[k].gpus_per_replica <= left:
                alloc[k] += 1
                left -= g[k].gpus_per_replica
        for d in decisions:
            if alloc[d.pool] != d.desired:
                d.reason += f"; GPU budget {budget} (wanted {total} GPUs in all): {d.desired} -> {alloc[d.pool]}"
                d.desired = alloc[d.pool]
