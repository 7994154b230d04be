"""One simulated GPU of the replay: the sim's own engine core (workers/sim/core.py) on the virtual clock.

    kick():  idle and work queued -> plan, dt = core.plan(); the step ends at now + dt  (SimEngine.run's loop,
             with the clock moved instead of slept on). A request submitted to an idle engine wakes it with a kick
             queued for the same instant after everything else due then (priority KICK), so requests arriving
             together start in one step, as the serving loop plans once it runs. Decode requests admitted this step whose prompt KV comes
             from a prefill worker are handed to the sink to pull (`sink.pull`).
    step end: result = core.finish(plan, dt); its KV events and results go to the sink (the replay's frontend);
             then kick() again.
An engine whose waiting request cannot fit even when it is otherwise empty would wait forever (a prompt larger
than its whole KV cache): that request is rejected (`sink.rejected`), as Dynamo's mocker rejects it.

The engines hash blocks with the router's chained xxh3 (RouterBlockHasher) rather than vLLM's sha256 of pickled
tuples (workers/sim/hashing.py): the same prefix structure (equal ids exactly for equal prefixes) at a fraction
of the cost; the published block ids are then the router's own hashes.
"""

from __future__ import annotations

from typing import Protocol

from router.hashing import block_hashes
from router.types import Endpoint
from workers.sim.core import EngineCore
from workers.sim.kv_manager import KvBlockManager
from workers.sim.scheduler import Scheduler, SimRequest, StepResult
from workers.types import WorkerInfo, WorkerRole

from orchestrator.replay.clock import VirtualClock

__all__ = ["EngineSink", "RouterBlockHasher", "SimWorker"]

KICK = 3  # clock priority of a wake-up: after step ends (0), arrivals (1) and periodic ticks (2) at the same time
RETRY_S = 0.005  # an engine with running requests but nothing schedulable looks again this much later (as SimEngine)


def _identity(h: int) -> int:
    return h


class RouterBlockHasher:
    """The scheduler's hasher (block_size, extend, hash_all) on router.hashing's chained xxh3."""

    __slots__ = ("block_size",)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def extend(self, hashes: list, token_ids) -> list:
        bs = self.block_size
        n_full = len(token_ids) // bs
        start = len(hashes)
        if n_full > start:
            hashes += block_hashes(token_ids[start * bs:n_full * bs], bs, None, hashes[-1] if hashes else None)
        return hashes

    def hash_all(self, token_ids) -> list:
        return self.extend([], token_ids)


class EngineSink(Protocol):
    """What a SimWorker reports to (the replay's frontend)."""

    def step(self, w: SimWorker, result: StepResult, events: list) -> None:
        """A step ended at clock.now: its sampled tokens, finished requests and KV events."""

    def admitted(self, w: SimWorker, reqs: list[SimRequest]) -> None:
        """Requests the step being planned admits (first admissions; clock.now is the step's start)."""

    def pull(self, w: SimWorker, req: SimRequest, hit_tokens: int) -> None:
        """A decode request was admitted with its prompt KV still on a prefill worker: start the transfer."""

    def rejected(self, w: SimWorker, req: SimRequest) -> None:
        """A request that can never fit this engine was dropped from it."""


class SimWorker:
    """A worker: its engine core and what the fleet keeps about it (role, endpoint, lifetime for billing)."""

    __slots__ = ("wid", "role", "core", "sched", "kv", "clock", "sink", "endpoint", "info", "busy", "plan", "dt",
                 "billed_from", "ready_at", "removed_at", "gone_at", "gpus", "retry", "waking")

    def __init__(self, wid: str, role: str, scheduler: Scheduler, timing, clock: VirtualClock, sink: EngineSink,
                 model: str, gpus: int = 1, billed_from: float = 0.0, ready_at: float = 0.0) -> None:
        self.wid = wid
        self.role = role
        self.core = EngineCore(scheduler, timing)
        self.sched = scheduler
        self.kv: KvBlockManager = scheduler.kv
        self.clock = clock
        self.sink = sink
        bs = scheduler.kv.block_size
        self.endpoint = Endpoint(worker_id=wid, url=f"sim://{wid}", model=model, block_size=bs, role=role)
        self.info = WorkerInfo(worker_id=wid, model=model, backend="sim", role=WorkerRole(role), url=f"sim://{wid}",
                               block_size=bs, max_model_len=scheduler.max_model_len, started_at=ready_at)
        self.busy = False
        self.plan = None
        self.dt = 0.0
        self.billed_from = billed_from  # the scale-up request (GPU-seconds count from here)
        self.ready_at = ready_at  # routable from here
        self.removed_at: float | None = None  # scale-down request: no new requests, in-flight ones finish
        self.gone_at: float | None = None  # drained (or never started): billing stops
        self.gpus = gpus
        self.retry = False
        self.waking = False

    @property
    def idle(self) -> bool:
        """Nothing running, queued, loading or held here."""
        s = self.sched
        return not self.busy and not s.requests and not s.held

    def submit(self, req: SimRequest) -> None:
        self.sched.add_request(req)
        if not self.busy and not self.waking:
            self.waking = True
            self.clock.at(self.clock.now, self._wake, priority=KICK)

    def _wake(self) -> None:
        self.waking = False
        self.kick()

    def kick(self) -> None:
        """Start the next step if idle and there is work (its end goes on the clock)."""
        if not self.busy and self._plan_next():
            clock = self.clock
            clock.at(clock.now + self.dt, self._step_end)

    def _plan_next(self) -> bool:
        """Plan the next step into self.plan / self.dt; False when nothing can run now."""
        sched = self.sched
        if not sched.has_work:
            return False
        plan, dt = self.core.plan()
        if plan.newly_admitted:
            self.sink.admitted(self, plan.newly_admitted)
        if plan.remote_loads:
            for req, hit in plan.remote_loads:
                self.sink.pull(self, req, hit)
        if not plan.scheduled:
            if sched.running:
                if not self.retry:
                    self.retry = True
                    self.clock.after(RETRY_S, self._retry)
            elif not sched.held and sched.num_loading == 0 and sched.waiting:
                req = sched.waiting[0]  # alone on an empty engine and still not admitted: it never will be
                sched.abort(req.request_id, "rejected")
                self.sink.rejected(self, req)
                return self._plan_next()
            return False
        self.busy = True
        self.plan = plan
        self.dt = dt
        return True

    def _retry(self) -> None:
        self.retry = False
        self.kick()

    def _step_end(self) -> None:
        """End the step, then start the next. A next step that ends strictly before every other queued event is
        exactly the event the clock would pop next: it runs here, with the clock moved to its end, instead of
        going through the queue (the same order, without the queue's cost)."""
        core, sink, clock = self.core, self.sink, self.clock
        events_on = core.kv.enable_events
        while True:
            plan, dt = self.plan, self.dt
            self.busy = False
            self.plan = None
            result = core.finish(plan, dt)
            sink.step(self, result, core.kv.take_events() if events_on else ())
            if self.busy or not self._plan_next():
                return
            end = clock.now + self.dt
            if not clock.advance(end):
                clock.at(end, self._step_end)
                return


def make_scheduler(block_size: int, num_gpu_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                   enable_prefix_caching: bool = True, enable_events: bool = True) -> Scheduler:
    """The sim's scheduler over a KV block manager that publishes the router's block hashes."""
    kv = KvBlockManager(num_gpu_blocks, block_size, enable_caching=enable_prefix_caching, enable_events=enable_events,
                        external=_identity, coalesce_removals=True)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     hasher=RouterBlockHasher(block_size))
