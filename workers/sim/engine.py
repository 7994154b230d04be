"""The async engine loop: drives the engine core (workers/sim/core.py) in (scaled) real time.

    loop:  plan, dt = core.plan()                        scheduler.schedule() priced by the timing model
                                                         (seconds, already divided by --speedup)
           sleep until start + dt                        (deadline-based: no drift from loop overhead)
           result = core.finish(plan, dt)                -> tokens to per-request streams
           metrics; publish the step's KV events as one batch
The replay (orchestrator/replay/engine.py) drives the same EngineCore on a virtual clock instead.

The next step starts at the previous deadline, not at wake-up time, so sleep overshoot and Python
overhead do not accumulate; if the loop falls more than `max_lag_s` behind (an overloaded CPU), it
re-anchors to now instead of bursting. A step that starts an idle engine is anchored at the arrival of
the request that woke it (a GPU would have started right away). Aborts (client disconnect, stop strings) free blocks at once.

P/D hooks (set by the server when disaggregation is on, see workers/sim/disagg.py): `loader(source,
prompt_tokens, local_hit_tokens)` pulls an admitted decode request's KV (a task per request, running
beside the step loop like a connector's async load); `on_held(request_id, num_tokens)` is told when a
prefill finished with its blocks held (False: nobody holds them, free now); `on_ended(request_id,
finish_reason)` when any request ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from workers.sim.core import EngineCore
from workers.sim.hashing import RequestHashes
from workers.sim.kv_manager import KvBlockManager
from workers.sim.metrics import SimMetrics
from workers.kv_publisher import KvEventPublisher
from workers.sim.scheduler import Scheduler, SimRequest, StepPlan
from workers.sim.timing import TimingModel

__all__ = ["RequestStream", "SimEngine"]

log = logging.getLogger(__name__)
COARSE_S = 0.0015  # below this, finish a step's wait with a precise blocking sleep
BEHIND_S = 0.0  # more than this behind the profile clock: run steps back to back (tokens coalesce)
MAX_NO_YIELD_S = 0.005  # when behind schedule, still let HTTP handlers run at least this often
MAX_OVERSHOOT_S = 0.0003  # cap on the learned sleep-lateness compensation


class RequestStream:
    """Tokens of one request as the engine produces them; many per wait when the reader lags."""

    __slots__ = ("req", "tokens", "finish_reason", "arrival", "admitted", "first_token", "last_token", "_waiter")

    def __init__(self, req: SimRequest, arrival: float) -> None:
        self.req = req
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.arrival = arrival
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> tuple[list[int], str | None]:
        """Wait for new tokens (or the end); returns (new tokens, finish_reason or None)."""
        while not self.tokens and self.finish_reason is None:
            fut = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                if self._waiter is fut:  # a cancelled wait() must not clear a newer waiter
                    self._waiter = None
        toks, self.tokens = self.tokens, []
        return toks, self.finish_reason

    @property
    def ready(self) -> bool:
        """`next()` would return at once."""
        return bool(self.tokens) or self.finish_reason is not None

    async def wait(self) -> None:
        """Wait until `ready`, consuming nothing (for a reader of several streams)."""
        while not self.tokens and self.finish_reason is None:
            fut = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                if self._waiter is fut:  # a cancelled wait() must not clear a newer waiter
                    self._waiter = None


class SimEngine:
    def __init__(
        self,
        scheduler: Scheduler,
        timing: TimingModel,
        metrics: SimMetrics | None = None,
        publisher: KvEventPublisher | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_lag_s: float = 0.05,
    ) -> None:
        self.scheduler = scheduler
        self.kv: KvBlockManager = scheduler.kv
        self.timing = timing
        self.core = EngineCore(scheduler, timing)
        self.metrics = metrics
        self.publisher = publisher
        self.clock = clock
        self.max_lag_s = max_lag_s
        self.streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._last_yield = 0.0
        self._first_tokens = False  # the last step produced some request's first token
        self._kick: float | None = None  # arrival of the request that woke the idle engine
        self._overshoot = 0.0  # learned lateness of time.sleep, subtracted from the next sleeps
        self.dropped_time = 0.0  # profile time lost to CPU overload (re-anchoring), seconds wall
        self._last_lag_warning = float("-inf")
        self.loader: Callable[[Any, int, int], Awaitable[bool]] | None = None
        self.on_ended: Callable[[str, str], None] | None = None
        self._loads: dict[str, asyncio.Task[None]] = {}
        self.iteration_stats: Any = None  # flavors.TrtllmIterationStats when the sim plays TRT-LLM

    # ---- intake --------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        token_source: Callable[[int], int],
        *,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        arrival: float | None = None,
        hold_blocks: bool = False,
        remote: Any = None,
        lora: tuple[str, str] | None = None,
        mm_items: Sequence[tuple[str, int, int]] = (),
    ) -> RequestStream:
        """Queue a request; `arrival` (engine clock) defaults to now. Never blocks. `hold_blocks`: a
        prefill whose blocks a remote decode reads; `remote`: a decode whose prompt KV is pulled; `lora`:
        the adapter's (name, path); `mm_items`: the prompt's (identifier, offset, length) multimodal items."""
        keyed = {"block_hashes": RequestHashes(lora, mm_items)} if lora or mm_items else {}
        req = SimRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            token_source=token_source,
            stop_token_ids=frozenset(stop_token_ids),
            min_tokens=min_tokens,
            hold_blocks=hold_blocks,
            remote=remote,
            **keyed,
        )
        idle = not self.scheduler.has_work
        self.scheduler.add_request(req)
        stream = RequestStream(req, self.clock() if arrival is None else arrival)
        self.streams[request_id] = stream
        if idle:  # an idle GPU would start this request's step now, not when the loop gets to it
            self._kick = stream.arrival
            self._wake.set()
        return stream

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request now (disconnect, stop string); its blocks are freed immediately."""
        stream = self.streams.pop(request_id, None)
        load = self._loads.pop(request_id, None)
        if load is not None:
            load.cancel()
        req = self.scheduler.abort(request_id, reason)
        if stream is not None and req is not None:
            stream.finish_reason = req.finish_reason
            self._record_finish(stream, self.clock())
            stream._wake()
        if req is not None and self.on_ended is not None:
            self.on_ended(request_id, req.finish_reason or reason)

    @property
    def steps(self) -> int:
        return self.core.steps

    @property
    def busy_time(self) -> float:
        return self.core.busy_time

    @property
    def on_held(self) -> Callable[[str, int], bool] | None:
        """P/D: told when a prefill finished with its blocks held (False: nobody holds them, free now)."""
        return self.core.on_held

    @on_held.setter
    def on_held(self, hook: Callable[[str, int], bool] | None) -> None:
        self.core.on_held = hook

    def release_held(self, request_id: str) -> bool:
        """Free a finished prefill's held blocks (its KV was read, expired or abandoned)."""
        return self.scheduler.release_held(request_id)

    # ---- remote KV loads (P/D decode side) -----------------------------------------------------
    def _start_load(self, req: SimRequest, hit_tokens: int) -> None:
        task = asyncio.get_running_loop().create_task(self._load(req, hit_tokens))
        self._loads[req.request_id] = task

    async def _load(self, req: SimRequest, hit_tokens: int) -> None:
        ok = False
        try:
            if self.loader is not None:
                ok = await self.loader(req.remote, req.num_prompt_tokens, hit_tokens)
        except asyncio.CancelledError:
            return  # aborted: abort() already cleaned up
        except Exception:  # a bug in a load must fail the request, not the engine
            log.exception("remote KV load of %s failed", req.request_id)
        finally:
            self._loads.pop(req.request_id, None)
        recompute = bool(getattr(req.remote, "recompute_on_failure", False))
        idle = not self.scheduler.has_work
        failed = self.scheduler.finish_remote_load(req.request_id, ok, recompute)
        if failed is not None:
            s = self.streams.pop(req.request_id, None)
            if s is not None:
                s.finish_reason = "error"
                self._record_finish(s, self.clock())
                s._wake()
            if self.on_ended is not None:
                self.on_ended(req.request_id, "error")
        elif idle and self.scheduler.has_work:
            self._kick = self.clock()
            self._wake.set()

    # ---- loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        next_start: float | None = None
        sched = self.scheduler
        core = self.core
        while True:
            if not sched.has_work:
                self._wake.clear()
                await self._wake.wait()
                next_start = self._kick
                continue
            now = self.clock()
            start = now if next_start is None else max(next_start, now - self.max_lag_s)
            if next_start is not None and start > next_start:
                self._fell_behind(now - next_start)
            plan, dt = core.plan()
            for req, hit in plan.remote_loads:
                self._start_load(req, hit)
            if not plan:
                if plan.remote_loads:  # only pulls started: nothing to compute until one lands
                    next_start = None
                    continue
                await asyncio.sleep(0.005)  # nothing fits right now (safety net; startup checks make this rare)
                next_start = None
                continue
            for req in plan.newly_admitted:
                s = self.streams.get(req.request_id)
                if s is not None:
                    s.admitted = now
            deadline = start + dt
            await self._sleep_until(deadline)
            finished = self._finish_step(plan, dt, self.clock())
            if self.iteration_stats is not None:  # TRT-LLM flavor's JSON /metrics
                self.iteration_stats.record(dt * 1000.0, len(plan.prefill_chunks), len(plan.decode_contexts),
                                            sum(n for _, n in plan.prefill_chunks), finished)
            next_start = deadline

    async def _sleep_until(self, deadline: float) -> None:
        """Yield once (HTTP handlers write their chunks), then sleep precisely until `deadline`.

        When the loop is more than `BEHIND_S` behind schedule it runs steps back to back and yields
        only every `MAX_NO_YIELD_S`, so streams pick up several tokens per chunk (as vLLM's API server coalesces
        outputs under load) instead of the CPU going to one tiny write per token per step. A step that
        produced some request's first token is always followed by a yield (TTFT is never coalesced).

        asyncio timers wake up to ~1 ms late (epoll timeouts are rounded up to whole milliseconds),
        which would stretch every sub-millisecond step at high speed-ups; so the loop sleeps on
        asyncio only while more than `COARSE_S` remains and finishes with a short blocking sleep,
        aimed early by the lateness it has observed (an EWMA, at most `MAX_OVERSHOOT_S`).
        """
        now = self.clock()
        if self._first_tokens or deadline > now - BEHIND_S or now - self._last_yield > MAX_NO_YIELD_S:
            self._first_tokens = False
            await asyncio.sleep(0)
            self._last_yield = now = self.clock()
        delay = deadline - now
        if delay > COARSE_S:
            await asyncio.sleep(delay - COARSE_S)
            delay = deadline - self.clock()
        if delay > self._overshoot:
            time.sleep(delay - self._overshoot)
            late = self.clock() - deadline  # learn the OS's wake-up lateness (EWMA), aim that much early
            self._overshoot = min(MAX_OVERSHOOT_S, max(0.0, self._overshoot + 0.1 * late))

    def _fell_behind(self, lag: float) -> None:
        """The CPU cannot keep up with the profile clock: time is being dropped. Warn (rate-limited)."""
        self.dropped_time += lag - self.max_lag_s
        now = self.clock()
        if now - self._last_lag_warning > 30.0:
            self._last_lag_warning = now
            log.warning(
                "sim engine is %.0f ms behind its profile clock (%.2f s dropped so far): the CPU is overloaded; "
                "lower --speedup or the load", lag * 1000, self.dropped_time,
            )

    def _finish_step(self, plan: StepPlan, dt: float, now: float) -> int:
        """Apply a step's results (the core's) to the streams; returns how many requests finished."""
        streams = self.streams
        result = self.core.finish(plan, dt)
        m = self.metrics
        if m is not None:
            m.iteration_tokens.observe(plan.num_tokens)
        for req, toks in result.outputs:
            s = streams.get(req.request_id)
            if s is None:
                continue
            s.tokens.extend(toks)
            if s.first_token is None:
                s.first_token = now
                self._first_tokens = True  # a first token always goes out in its own chunk
                if m is not None:
                    m.ttft.observe(now - s.arrival)
                    m.on_first_token(req.num_prompt_tokens, max(req.num_cached_tokens, 0))
            elif m is not None and s.last_token is not None:
                m.itl.observe(now - s.last_token)
            s.last_token = now
            if m is not None:
                m.generation_tokens += len(toks)
            s._wake()
        for req in result.finished:
            s = streams.pop(req.request_id, None)
            if s is not None:
                s.finish_reason = req.finish_reason
                self._record_finish(s, now)
                s._wake()
            if self.on_ended is not None:
                self.on_ended(req.request_id, req.finish_reason or "stop")
        if self.publisher is not None:
            self.publisher.publish(self.core.take_events())
        else:
            self.core.take_events()
        return len(result.finished)

    def _record_finish(self, s: RequestStream, now: float) -> None:
        if self.metrics is not None:
            req = s.req
            self.metrics.on_finished(
                req.finish_reason or "abort", arrival=s.arrival, admitted=s.admitted, first_token=s.first_token,
                last_token=s.last_token, now=now, n_prompt=req.num_prompt_tokens, n_cached=max(req.num_cached_tokens, 0),
                n_gen=len(req.output_token_ids), max_tokens=req.max_tokens, n_preemptions=req.num_preemptions,
            )

    # ---- state for /metrics and /load ----------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        s = self.scheduler
        return {
            "num_requests_running": float(len(s.running)),
            "num_requests_waiting": float(len(s.waiting)),
            "num_requests_waiting_deferred": float(s.num_loading),
            "external_kv_tokens": float(s.external_tokens),
            "num_held": float(len(s.held)),
            "kv_cache_usage_perc": self.kv.usage,
            "prefix_cache_queries": float(s.prefix_queries),
            "prefix_cache_hits": float(s.prefix_hits),
            "num_preemptions": float(s.num_preemptions),
        }
