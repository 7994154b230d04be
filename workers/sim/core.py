"""One sim engine's step loop without a clock: the code path both the serving engine and the replay run.

    plan, seconds = core.plan()        scheduler.schedule(), priced by the timing model (after --speedup)
    ... the driver lets `seconds` pass: SimEngine (workers/sim/engine.py) sleeps until the step's deadline in
        scaled real time; the replay (orchestrator/replay/engine.py) moves a virtual clock ...
    result = core.finish(plan, seconds)  scheduler.update_from_output(plan): tokens sampled, stop checks, finished
                                         requests' blocks freed, or held for a remote decode (P/D, `on_held`)
    core.take_events()                 the KV events of the steps since the last call (BlockStored / BlockRemoved)

Nothing here knows about time, streams, HTTP or routing: the driver turns `result` into tokens on streams
(serving) or into per-request records and router callbacks (replay). `plan.remote_loads` lists the decode
requests admitted this step whose prompt KV the driver must pull (P/D), finished with
`scheduler.finish_remote_load`. Pure and synchronous.
"""

from __future__ import annotations

from collections.abc import Callable

from router.kv_events import KvEvent
from workers.sim.kv_manager import KvBlockManager
from workers.sim.scheduler import Scheduler, StepPlan, StepResult

__all__ = ["EngineCore", "StepTiming"]


class StepTiming:
    """What prices a step (workers/sim/timing.py TimingModel, workers/sim/mocker_timing.py MockerTiming)."""

    def plan_ms(self, plan: StepPlan, kv: KvBlockManager) -> float:  # pragma: no cover - protocol
        """Wall-clock milliseconds of the planned step, after the speed-up."""
        raise NotImplementedError


class EngineCore:
    """Plans, prices and applies one engine's steps. `on_held(request_id, num_tokens) -> bool` is asked when a
    prefill that holds its blocks for a remote decode finishes: False (or no hook) frees them at once."""

    __slots__ = ("scheduler", "kv", "timing", "steps", "busy_time", "on_held")

    def __init__(self, scheduler: Scheduler, timing) -> None:
        self.scheduler = scheduler
        self.kv: KvBlockManager = scheduler.kv
        self.timing = timing
        self.steps = 0
        self.busy_time = 0.0  # seconds of steps run (after the speed-up)
        self.on_held: Callable[[str, int], bool] | None = None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def plan(self) -> tuple[StepPlan, float]:
        """The next step and its duration in seconds (0.0 for an empty plan: nothing to compute now)."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return plan, 0.0
        return plan, self.timing.plan_ms(plan, self.kv) / 1000.0

    def finish(self, plan: StepPlan, seconds: float) -> StepResult:
        """Apply a step that has run for `seconds`."""
        sched = self.scheduler
        result = sched.update_from_output(plan)
        self.steps += 1
        self.busy_time += seconds
        on_held = self.on_held
        for req in result.finished:
            if req.hold_blocks and (on_held is None or not on_held(req.request_id, req.num_computed_tokens)):
                sched.release_held(req.request_id)
        return result

    def take_events(self) -> list[KvEvent]:
        return self.kv.take_events()
