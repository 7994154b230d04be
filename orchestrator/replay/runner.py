"""The replay: a workload through the frontend's routers to simulated engines, on a virtual clock.

    arrival   the frontend's path (orchestrator/service.py, orchestrator/disagg/coordinator.py) as calls: a
              RouteRequest routed by the same Router objects (orchestrator/routing.py), telemetry recorded as
              the frontend records it, the request submitted to the chosen engine
              P/D: decode routed first (booked in the service's load book), prefill routed on its own book,
              Dynamo's rule decides (orchestrator/disagg/decision.py): local -> the decode engine serves it
              whole; remote -> prefill (max_tokens 1, blocks held) on the prefill engine, then the decode with
              remote KV: admitted by the decode engine, pulled for latency + tokens × bytes / bandwidth, the
              prefill's blocks released at landing (workers/sim/disagg.py's transfer model)
    engines   SimWorker (orchestrator/replay/engine.py): the sim's EngineCore on the clock
    tokens    first token -> router.on_first_token; each gap into the ITL histogram; finish -> on_complete and
              the telemetry record
    KV events each step's events reach the router's prefix index `event_lag_ms` later (the ingestor's
              apply_batch); the index's pending predictions expire every 5 s, as the ingestor's loop does
    scrapes   every scrape_interval_s each endpoint's scraped load (waiting requests, KV usage) is refreshed
    scaling   scale(role, n): new workers are billed from the request and routable startup_s later; removed
              ones take no new requests, are billed until their last request is done, then leave the router
No HTTP, no processes, no sleeps. Pure and synchronous (the in-memory stores' coroutines are stepped inline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.disagg.decision import decide
from orchestrator.replay.clock import VirtualClock
from orchestrator.replay.config import ReplayConfig
from orchestrator.replay.engine import SimWorker, make_scheduler
from orchestrator.replay.results import GapHistogram, RequestRecord
from orchestrator.replay.workload import Workload
from orchestrator.routing import build_phase_routers, build_router
from router.hashing import block_hashes_view
from router.types import Endpoint, RouteRequest
from workers.sim.disagg import KvTransferModel, default_kv_bytes_per_token
from workers.sim.mocker_timing import MockerTiming, is_mocker_npz
from workers.sim.profiles import DEFAULT_PROFILE, load_profile
from workers.sim.scheduler import SimRequest, StepResult
from workers.sim.timing import TimingModel
from workers.types import EngineMetrics, WorkerInfo

__all__ = ["Replay", "make_timing", "run_sync"]

INDEX_EXPIRE_S = 5.0  # router/events.py KvEventIngestor.expire_interval_s
MOCKER_DEFAULT_BLOCKS = 16384  # Dynamo's mocker default num_gpu_blocks


def run_sync(coro):
    """Run a coroutine that never suspends (the in-memory telemetry, targets and connector calls)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a store call suspended: only in-memory stores run on the replay's virtual clock")


def make_timing(spec) -> tuple[object, int, str]:
    """(timing model, default KV blocks per worker, profile name for the planner and KV geometry)."""
    if is_mocker_npz(spec.profile):
        return MockerTiming(spec.profile), MOCKER_DEFAULT_BLOCKS, DEFAULT_PROFILE
    profile = load_profile(spec.profile)
    return TimingModel(profile, 1.0, spec.prefill_pricing), max(2, profile.max_kv_tokens // spec.block_size), spec.profile


@dataclass(slots=True)
class _Handoff:
    rec: RequestRecord
    decode: SimWorker
    tokens: list[int]
    hashes: list[int] | None
    prefill: SimWorker | None = None


class Replay:
    def __init__(self, cfg: ReplayConfig, workload: Workload, progress: Callable[[Replay], None] | None = None) -> None:
        self.cfg, self.wl = cfg, workload
        self.clock = clock = VirtualClock()
        eng = cfg.engine
        self.timing, default_blocks, self.profile_name = make_timing(eng)
        self.num_gpu_blocks = eng.num_gpu_blocks or default_blocks
        fe = cfg.frontend
        self.router = build_router(fe, clock, seed=cfg.seed)
        self.index = self.router.kv_index
        self.decode_router = self.prefill_router = None
        if cfg.disaggregated:
            self.decode_router, self.prefill_router = build_phase_routers(fe.disagg, self.router, fe.router.kv, clock,
                                                                           seed=cfg.seed + 1)
        self.transfer = KvTransferModel(cfg.transfer.bandwidth_gbps, cfg.transfer.bytes_per_token
                                        or default_kv_bytes_per_token(self.profile_name), cfg.transfer.latency_ms)
        self.event_lag = cfg.event_lag_ms / 1000.0
        self.workers: dict[str, SimWorker] = {}
        self.routable: dict[str, list[Endpoint]] = {"both": [], "prefill": [], "decode": []}
        self.records: list[RequestRecord] = []
        self.live: dict[str, RequestRecord] = {}
        self.handoffs: dict[str, _Handoff] = {}
        self.gaps = GapHistogram()
        self._minute, self._hist = -1, {}  # the current minute's gap histogram
        self.fleet_log: list[tuple[float, str, int]] = []  # (time, role, active workers) at every change
        self.telemetry = None  # FrontendTelemetry, set by a planner driver
        self.on_tick: list[Callable[[], None]] = []  # periodic hooks (planner), called every `tick_s`
        self.progress = progress
        self.arrived = 0
        self._ids = 0
        self.wall_s = 0.0
        self.end_time = 0.0
        if cfg.disaggregated:
            for _ in range(cfg.prefill):
                self.add_worker("prefill")
            for _ in range(cfg.decode):
                self.add_worker("decode")
        else:
            for _ in range(cfg.workers):
                self.add_worker("both")

    # ---- the fleet ----------------------------------------------------------------------------------------

    @property
    def roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.cfg.disaggregated else ("both",)

    def active(self, role: str) -> list[SimWorker]:
        """Workers of a role that are starting or ready (not removed)."""
        return [w for w in self.workers.values() if w.role == role and w.removed_at is None]

    def add_worker(self, role: str, startup_s: float = 0.0, billed_before_s: float = 0.0) -> SimWorker:
        """A new worker, routable after `startup_s`, billed from now (less `billed_before_s`: started ahead of time)."""
        eng, now = self.cfg.engine, self.clock.now
        wid = f"{role[0]}{self._ids:05d}"
        self._ids += 1
        sched = make_scheduler(eng.block_size, self.num_gpu_blocks, eng.max_num_seqs, eng.max_num_batched_tokens, eng.max_model_len,
                               eng.enable_prefix_caching, enable_events=self.index is not None)
        w = SimWorker(wid, role, sched, self.timing, self.clock, self, self.cfg.model, eng.gpus_per_replica, now - billed_before_s,
                      now + startup_s)
        if role == "prefill":
            w.core.on_held = _hold  # a prefill's blocks stay until the decode has pulled them
        self.workers[wid] = w
        if startup_s > 0:
            self.clock.at(now + startup_s, self._ready, w)
        else:
            self._ready(w)
        self._log(role)
        return w

    def _ready(self, w: SimWorker) -> None:
        """The worker registered: routable, and its KV events indexed (the ingestor's sync)."""
        if w.removed_at is None:
            self.routable[w.role].append(w.endpoint)
            if self.index is not None:
                self.index.add_worker(w.wid, approximate=False, block_size=w.endpoint.block_size)

    def remove_worker(self, w: SimWorker) -> None:
        """Scale-down: no new requests; billed until drained."""
        if w.removed_at is not None:
            return
        w.removed_at = self.clock.now
        eps = self.routable[w.role]
        if w.endpoint in eps:
            eps.remove(w.endpoint)
        if w.idle:
            self._gone(w)
        self._log(w.role)

    def _gone(self, w: SimWorker) -> None:
        w.gone_at = self.clock.now
        self.router.remove_worker(w.wid)
        if self.prefill_router is not None:
            self.prefill_router.loads.remove_worker(w.wid)  # the frontend's on_worker_left hook

    def scale(self, role: str, n: int, startup_s: float | None = None, billed_before_s: float = 0.0) -> int:
        """Set a pool to n workers (starting + ready); returns the count now in effect. New workers serve after
        `startup_s` (default the config's); an oracle that started them ahead of time passes 0 and bills the start-up
        as `billed_before_s`."""
        act = self.active(role)
        now = self.clock.now
        for _ in range(n - len(act)):
            self.add_worker(role, self.cfg.startup_s if startup_s is None else startup_s, billed_before_s)
        if n < len(act):  # not-yet-ready ones first, then the newest
            for w in sorted(act, key=lambda w: (w.ready_at <= now, -w.billed_from, w.wid))[: len(act) - n]:
                self.remove_worker(w)
        return len(self.active(role))

    def _log(self, role: str) -> None:
        self.fleet_log.append((self.clock.now, role, len(self.active(role))))

    def gpu_seconds(self, end: float | None = None) -> float:
        end = self.end_time if end is None else end
        return sum(((w.gone_at if w.gone_at is not None else end) - w.billed_from) * w.gpus for w in self.workers.values())

    def snapshot(self) -> list[tuple[WorkerInfo, EngineMetrics | None]]:
        """The frontend pool's view for telemetry: registered (ready, not gone) workers and their metrics now."""
        now = self.clock.now
        out = []
        for w in self.workers.values():
            if w.gone_at is not None or w.ready_at > now:
                continue
            s = w.sched
            out.append((w.info, EngineMetrics(num_requests_running=float(len(s.running)), num_requests_waiting=float(len(s.waiting)),
                                              kv_cache_usage=w.kv.usage, prefix_cache_queries=float(s.prefix_queries),
                                              prefix_cache_hits=float(s.prefix_hits), num_preemptions=float(s.num_preemptions),
                                              scraped_at=now)))
        return out

    # ---- running --------------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.arrived < len(self.wl) or bool(self.live) or bool(self.handoffs)

    def run(self) -> Replay:
        t0 = time.perf_counter()
        clock, fe = self.clock, self.cfg.frontend
        if len(self.wl):
            clock.at(self.wl.requests[0].arrival, self._arrive, 0, priority=1)
        self._every(fe.scrape_interval_s, self._scrape)
        if self.index is not None:
            self._every(INDEX_EXPIRE_S, self.index.expire)
        for period, fn in self.on_tick:
            self._every(period, fn)
        clock.run()
        self.end_time = max([r.finish for r in self.records if r.finish is not None] + [r.arrival for r in self.records] + [0.0])
        self.wall_s = time.perf_counter() - t0
        if self.progress is not None:
            self.progress(self)
        return self

    def _every(self, period: float, fn: Callable[[], object]) -> None:
        def tick() -> None:
            fn()
            if self.busy:
                self.clock.after(period, tick, priority=2)

        self.clock.after(period, tick, priority=2)

    def _scrape(self) -> None:
        for role in self.roles:
            for ep in self.routable[role]:
                w = self.workers[ep.worker_id]
                ep.load.engine_waiting = float(len(w.sched.waiting))
                ep.load.engine_kv_usage = w.kv.usage

    # ---- the frontend's request path ---------------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        wl, clock = self.wl, self.clock
        tr = wl.requests[i]
        if i + 1 < len(wl):
            clock.at(wl.requests[i + 1].arrival, self._arrive, i + 1, priority=1)
        self.arrived = i + 1
        rec = RequestRecord(i, clock.now, tr.input_length, tr.output_length)
        self.records.append(rec)
        if self.progress is not None and i % 256 == 0:
            self.progress(self)
        if tr.input_length + 1 > self.cfg.engine.max_model_len:
            rec.status, rec.disagg = "rejected", "context_length"  # the frontend's 400
            return
        tokens = wl.tokens(tr)
        rid = f"r{i}"
        rreq = RouteRequest(rid, self.cfg.model, tokens, tr.output_length)
        hashes = None
        if self.index is not None:  # hash once for the router and the engine (the same chained xxh3)
            bs = self.cfg.engine.block_size
            rreq.block_hashes = block_hashes_view(tokens, bs)
            rreq.hashed_block_size = bs
            hashes = rreq.block_hashes.tolist()
        if self.cfg.disaggregated:
            self._route_pd(rid, rreq, rec, tokens, hashes)
            return
        eps = self.routable["both"]
        if not eps:
            rec.status, rec.disagg = "rejected", "no_worker"  # the frontend's 503
            return
        decision = self.router.route(rreq, eps)
        self._submit(self.workers[decision.ranked[0].worker_id], rid, rec, tokens, hashes)

    def _submit(self, w: SimWorker, rid: str, rec: RequestRecord, tokens: list[int], hashes: list[int] | None, **kw) -> None:
        rec.worker = w.wid
        self.live[rid] = rec
        if self.telemetry is not None and "remote" not in kw:
            self.telemetry.on_arrival(self.cfg.model)
        w.submit(SimRequest(request_id=rid, prompt_token_ids=tokens, max_tokens=rec.osl, all_token_ids=list(tokens),
                            block_hashes=list(hashes) if hashes is not None else [], tag=rec, **kw))

    def _route_pd(self, rid: str, rreq: RouteRequest, rec: RequestRecord, tokens: list[int], hashes: list[int] | None) -> None:
        dec, pre = self.routable["decode"], self.routable["prefill"]
        if not dec:
            rec.status, rec.disagg = "rejected", "no_worker"
            return
        decision = self.decode_router.route(rreq, dec)
        d_ep = decision.ranked[0]
        d = self.workers[d_ep.worker_id]
        if not pre:
            rec.disagg = "no_prefill_worker"
            self._submit(d, rid, rec, tokens, hashes)
            return
        peek = self.prefill_router.loads.peek
        active = {e.worker_id: (ld.prefill_tokens if (ld := peek(e.worker_id)) is not None else 0) for e in pre}
        p_ep = self.prefill_router.route(rreq, pre).ranked[0]
        cached = decision.overlap_of(d_ep) * d_ep.block_size if d_ep.block_size == rreq.hashed_block_size else 0
        verdict = decide(self.cfg.frontend.disagg, rec.isl, cached, active[p_ep.worker_id])
        rec.disagg = verdict.reason
        if not verdict.remote:
            self.prefill_router.on_complete(rid)
            self._submit(d, rid, rec, tokens, hashes)
            return
        p = self.workers[p_ep.worker_id]
        rec.prefill_worker = p.wid
        self.handoffs[rid] = _Handoff(rec, d, tokens, hashes, p)
        if self.telemetry is not None:
            self.telemetry.on_arrival(self.cfg.model)
        p.submit(SimRequest(request_id=rid + "#p", prompt_token_ids=tokens, max_tokens=1, all_token_ids=list(tokens),
                            block_hashes=list(hashes) if hashes is not None else [], hold_blocks=True))

    # ---- what the engines report (EngineSink) ------------------------------------------------------------

    def step(self, w: SimWorker, result: StepResult, events) -> None:
        now = self.clock.now
        if events:
            if self.event_lag > 0:
                self.clock.after(self.event_lag, self._apply_events, w, events)
            else:
                self.index.apply_batch(w.wid, events)
        if w.role == "prefill":
            for req in result.finished:
                self._prefilled(w, req)
        else:
            minute = int(now // 60.0)
            if minute != self._minute:
                self._minute, self._hist = minute, self.gaps.bucket_of(minute)
            hist, scale = self._hist, GapHistogram.SCALE * 1000.0
            for req, toks in result.outputs:
                rec = req.tag
                if rec is None:
                    continue
                last = rec.last
                if last is None:
                    rec.first = now
                    rec.cached = max(req.num_cached_tokens, 0)
                    self.router.on_first_token(req.request_id)
                else:
                    k = int((now - last) * scale)
                    hist[k] = hist.get(k, 0) + 1
                rec.last = now
                rec.tokens += len(toks)
            for req in result.finished:
                rec = self.live.pop(req.request_id, None)
                if rec is not None:
                    self._done(req.request_id, rec, "ok")
        if w.removed_at is not None and w.gone_at is None and w.idle:
            self._gone(w)

    def admitted(self, w: SimWorker, reqs: list[SimRequest]) -> None:
        now = self.clock.now
        for req in reqs:
            rec = req.tag
            if rec is not None and rec.admitted is None:
                rec.admitted = now

    def _apply_events(self, w: SimWorker, events) -> None:
        if w.gone_at is None:
            self.index.apply_batch(w.wid, events)

    def _done(self, rid: str, rec: RequestRecord, status: str) -> None:
        now = self.clock.now
        rec.finish, rec.status = now, status
        self.router.on_complete(rid)
        if self.telemetry is not None:
            ttft = None if rec.first is None else rec.first - rec.arrival
            self.telemetry.on_finish(self.cfg.model, ttft_s=ttft, duration_s=now - rec.arrival, isl=rec.isl, osl=rec.tokens,
                                     ok=status == "ok")

    def _prefilled(self, p: SimWorker, req: SimRequest) -> None:
        rid = req.request_id[:-2]
        h = self.handoffs.get(rid)
        self.prefill_router.on_complete(rid)
        if h is None:
            self.router.on_complete(rid)
            p.sched.release_held(req.request_id)
            return
        self._submit(h.decode, rid, h.rec, h.tokens, h.hashes, remote="prefill")

    def pull(self, w: SimWorker, req: SimRequest, hit_tokens: int) -> None:
        self.clock.after(self.transfer.seconds(req.num_tokens - hit_tokens), self._landed, w, req.request_id)

    def _landed(self, d: SimWorker, rid: str) -> None:
        h = self.handoffs.pop(rid, None)
        d.sched.finish_remote_load(rid, True)
        if h is not None and h.prefill is not None:
            p = h.prefill
            p.sched.release_held(rid + "#p")
            p.kick()
            if p.removed_at is not None and p.gone_at is None and p.idle:
                self._gone(p)
        d.kick()

    def rejected(self, w: SimWorker, req: SimRequest) -> None:
        rid = req.request_id.removesuffix("#p")
        if req.request_id.endswith("#p"):
            self.prefill_router.on_complete(rid)
            h = self.handoffs.pop(rid, None)
            rec = h.rec if h is not None else None
        else:
            rec = self.live.pop(rid, None)
            self.handoffs.pop(rid, None)
        if rec is not None:
            rec.disagg = rec.disagg or "exceeds_kv_cache"
            self._done(rid, rec, "rejected")


def _hold(_request_id: str, _num_tokens: int) -> bool:
    return True
