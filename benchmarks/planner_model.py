"""Offline model of a disaggregated deployment (one prefill pool, one decode pool) on a virtual clock,
timed by the same NPZ profile the planner and the sim engine use (planner.perf_model.PerfModel).

Prefill pool: one shared FCFS queue (JSQ routing); a replica serves one prompt at a time for
    T(eff_isl) ms, eff_isl = isl − cached tokens (prefix hits from a fixed-size LRU of the trace's
    512-token hash_ids, the same for every policy). Exact event order inside each slice.
Decode pool: time slices of `slice_s` (0.25 s). A finished prefill joins the decode replica with the
    lowest KV usage that can hold its context (else it waits: KV full, counted in its TTFT). In a
    slice a replica's ITL is ITL(Σctx/max_kv, mean ctx); each of its sequences gains slice/ITL
    tokens (context grows by as much); a sequence ends at its output length.
TTFT = prefill done − arrival + decode admission wait. ITL samples are token-weighted per slice.
Scaling: a new replica is billed from the request and serves after `startup_s`; a removed one takes
    no new work and is billed until its in-flight work is done (drain).
GPU-seconds = Σ over replicas of billed time × gpus per replica. Pure; no asyncio.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from planner.perf_model import PerfModel

__all__ = ["Requests", "SimConfig", "DisaggSim", "cached_tokens"]


@dataclass
class Requests:
    t: np.ndarray  # arrival, seconds, sorted
    isl: np.ndarray
    osl: np.ndarray
    cached: np.ndarray  # prefix-cache hit tokens

    def __len__(self) -> int:
        return len(self.t)


def cached_tokens(isl: list[int], hash_ids: list[list[int]], capacity_blocks: int, block: int = 512) -> np.ndarray:
    """Leading hash_ids already in an LRU of `capacity_blocks` blocks (KV-aware routing's ideal)."""
    lru: OrderedDict[int, None] = OrderedDict()
    out = np.zeros(len(isl))
    for i, (n, hs) in enumerate(zip(isl, hash_ids)):
        k = 0
        for h in hs:
            if h in lru:
                k += 1
            else:
                break
        out[i] = min(k * block, max(n - 1, 0))
        for h in hs:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return out


@dataclass
class SimConfig:
    slice_s: float = 0.25
    startup_s: float = 60.0
    max_num_seqs: int = 256
    gpus_per_replica: int = 1


@dataclass
class _Rep:
    billed_from: float
    ready_at: float
    free_at: float = 0.0
    retired_at: float | None = None
    hits: float = 0.0
    queries: float = 0.0


@dataclass
class MinuteStats:
    ttft: list = field(default_factory=list)
    itl: list = field(default_factory=list)  # (itl_ms, tokens)


class DisaggSim:
    def __init__(self, perf: PerfModel, reqs: Requests, cfg: SimConfig, prefill: int, decode: int) -> None:
        self.perf, self.r, self.cfg = perf, reqs, cfg
        self.now = 0.0
        self.next_arrival = 0
        self.queue: deque[int] = deque()  # prefill FCFS
        self.pre = [_Rep(0.0, 0.0) for _ in range(prefill)]
        self.dec = [_Rep(0.0, 0.0) for _ in range(decode)]
        self.prefilled: list[tuple[float, int]] = []  # heap (done time, request)
        self.admit: deque[tuple[float, int]] = deque()  # (prefill done time, request) waiting for KV
        self.seq_rep = np.zeros(0, dtype=np.int64)
        self.seq_ctx = np.zeros(0)
        self.seq_left = np.zeros(0)
        self.seq_req = np.zeros(0, dtype=np.int64)
        self.gpu_s = 0.0
        self.minutes: dict[int, MinuteStats] = {}
        self.events: list[tuple] | None = []  # ("arrive"|"prefilled"|"admit"|"done", pool, request, time[, ttft]); None: off
        self.decode_gen = 0.0

    # ---- scaling ---------------------------------------------------------------------------------
    def _active(self, reps: list[_Rep]) -> list[_Rep]:
        return [r for r in reps if r.retired_at is None]

    def replicas(self) -> tuple[int, int]:
        return len(self._active(self.pre)), len(self._active(self.dec))

    def scale(self, prefill: int, decode: int, startup_s: float | None = None) -> None:
        startup = self.cfg.startup_s if startup_s is None else startup_s
        for reps, n in ((self.pre, prefill), (self.dec, decode)):
            act = self._active(reps)
            for _ in range(n - len(act)):
                reps.append(_Rep(self.now, self.now + startup, self.now + startup))
            if n < len(act):  # retire not-yet-ready ones first, then the newest
                for rep in sorted(act, key=lambda r: (r.ready_at <= self.now, -r.billed_from))[: len(act) - n]:
                    rep.retired_at = self.now
                    if rep.ready_at > self.now:
                        rep.free_at = self.now  # never started: nothing to drain

    def _event(self, ev: tuple) -> None:
        if self.events is not None:
            self.events.append(ev)

    # ---- stepping --------------------------------------------------------------------------------
    def _minute(self, t: float) -> MinuteStats:
        m = int(t // 60)
        if m not in self.minutes:
            self.minutes[m] = MinuteStats()
        return self.minutes[m]

    def _prefill(self, t_end: float) -> None:
        r, perf = self.r, self.perf
        while self.next_arrival < len(r) and r.t[self.next_arrival] < t_end:
            self.queue.append(self.next_arrival)
            self._event(("arrive", "prefill", self.next_arrival, float(r.t[self.next_arrival])))
            self.next_arrival += 1
        heap = [(max(rep.free_at, rep.ready_at), i) for i, rep in enumerate(self.pre) if rep.retired_at is None]
        heapq.heapify(heap)
        while self.queue and heap:
            free, i = heapq.heappop(heap)
            q = self.queue[0]
            start = max(free, float(r.t[q]))
            if start >= t_end:
                break
            self.queue.popleft()
            done = start + perf.prefill_ms(r.isl[q] - r.cached[q]) / 1000.0
            rep = self.pre[i]
            rep.free_at = done
            rep.hits += r.cached[q]
            rep.queries += r.isl[q]
            heapq.heappush(self.prefilled, (done, q))
            heapq.heappush(heap, (done, i))

    def _admit(self, t_end: float) -> None:
        while self.prefilled and self.prefilled[0][0] < t_end:
            done, q = heapq.heappop(self.prefilled)
            self.admit.append((done, q))
            self._event(("prefilled", "prefill", q, done))
        ready = [i for i, rep in enumerate(self.dec) if rep.retired_at is None and rep.ready_at <= self.now]
        if not ready or not self.admit:
            return
        kv = np.bincount(self.seq_rep, weights=self.seq_ctx, minlength=len(self.dec))
        nseq = np.bincount(self.seq_rep, minlength=len(self.dec))
        new_rep, new_ctx, new_left, new_req = [], [], [], []
        while self.admit:
            done, q = self.admit[0]
            ctx = float(self.r.isl[q])
            i = min(ready, key=lambda j: kv[j])
            if kv[i] + ctx > self.perf.max_kv_tokens or nseq[i] >= self.cfg.max_num_seqs:
                if kv[i] == 0:  # longer than a whole replica's KV: admit alone
                    pass
                else:
                    break
            self.admit.popleft()
            kv[i] += ctx
            nseq[i] += 1
            start = max(done, self.now)
            ttft = start - float(self.r.t[q])
            self._minute(start).ttft.append(ttft)
            self._event(("admit", "decode", q, start, ttft))
            new_rep.append(i)
            new_ctx.append(ctx)
            new_left.append(max(float(self.r.osl[q]) - 1.0, 0.0))
            new_req.append(q)
        if new_rep:
            self.seq_rep = np.concatenate([self.seq_rep, np.array(new_rep, dtype=np.int64)])
            self.seq_ctx = np.concatenate([self.seq_ctx, new_ctx])
            self.seq_left = np.concatenate([self.seq_left, new_left])
            self.seq_req = np.concatenate([self.seq_req, np.array(new_req, dtype=np.int64)])

    def _decode(self, dt: float) -> None:
        if not len(self.seq_rep):
            return
        n = len(self.dec)
        kv = np.bincount(self.seq_rep, weights=self.seq_ctx, minlength=n)
        cnt = np.bincount(self.seq_rep, minlength=n)
        m = self._minute(self.now)
        itl = np.zeros(n)
        for i in np.nonzero(cnt)[0]:
            itl[i] = self.perf.itl_ms(kv[i] / self.perf.max_kv_tokens, kv[i] / cnt[i])
            m.itl.append((itl[i], cnt[i] * dt * 1000.0 / itl[i]))
        gain = dt * 1000.0 / itl[self.seq_rep]
        step = np.minimum(gain, self.seq_left)
        self.decode_gen += float(step.sum())
        self.seq_left -= step
        self.seq_ctx += step
        fin = self.seq_left <= 1e-9
        if fin.any():
            for q in self.seq_req[fin]:
                self._event(("done", "decode", int(q), self.now + dt))
            keep = ~fin
            self.seq_rep, self.seq_ctx = self.seq_rep[keep], self.seq_ctx[keep]
            self.seq_left, self.seq_req = self.seq_left[keep], self.seq_req[keep]

    def _bill(self, dt: float) -> None:
        busy_dec = set(np.unique(self.seq_rep).tolist())
        for reps, pool in ((self.pre, "p"), (self.dec, "d")):
            for i, rep in enumerate(reps):
                if rep.retired_at is None:
                    self.gpu_s += dt * self.cfg.gpus_per_replica
                elif pool == "p" and rep.free_at > self.now:
                    self.gpu_s += min(dt, rep.free_at - self.now) * self.cfg.gpus_per_replica
                elif pool == "d" and i in busy_dec:
                    self.gpu_s += dt * self.cfg.gpus_per_replica

    def step(self) -> None:
        """Advance one slice."""
        dt = self.cfg.slice_s
        t_end = self.now + dt
        self._prefill(t_end)
        self._admit(t_end)
        self._decode(dt)
        self._bill(dt)
        self.now = t_end

    # ---- what the telemetry sees -----------------------------------------------------------------
    def gauges(self) -> tuple[list[dict], list[dict]]:
        """Per ready replica: waiting, running, kv usage, prefix counters (for EngineMetrics)."""
        pre_ready = [r for r in self.pre if r.retired_at is None and r.ready_at <= self.now]
        waiting = len(self.queue) / max(len(pre_ready), 1)
        pre = [dict(waiting=waiting, running=1.0 if r.free_at > self.now else 0.0, kv=0.0, hits=r.hits, queries=r.queries)
               for r in pre_ready]
        kv = np.bincount(self.seq_rep, weights=self.seq_ctx, minlength=len(self.dec))
        cnt = np.bincount(self.seq_rep, minlength=len(self.dec))
        dec_ready = [i for i, r in enumerate(self.dec) if r.retired_at is None and r.ready_at <= self.now]
        dwait = len(self.admit) / max(len(dec_ready), 1)
        dec = [dict(waiting=dwait, running=float(cnt[i]), kv=min(kv[i] / self.perf.max_kv_tokens, 1.0), hits=0.0, queries=0.0)
               for i in dec_ready]
        return pre, dec

    def waiting(self) -> tuple[int, int]:
        return len(self.queue), len(self.admit)

    def minute_ok(self, m: int, ttft_ms: float, itl_ms: float) -> tuple[bool, float | None, float | None]:
        s = self.minutes.get(m)
        if s is None:
            return True, None, None
        t90 = float(np.quantile(s.ttft, 0.9)) * 1000.0 if s.ttft else None
        i90 = None
        if s.itl:
            arr = np.array(s.itl)
            order = np.argsort(arr[:, 0])
            cw = np.cumsum(arr[order, 1])
            i90 = float(arr[order, 0][np.searchsorted(cw, 0.9 * cw[-1])])
        ok = (t90 is None or t90 <= ttft_ms) and (i90 is None or i90 <= itl_ms)
        return ok, t90, i90


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b - 1e-9))
