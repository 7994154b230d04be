"""Serving and replay run one scheduling code path: the sim's EngineCore, driven by SimEngine (scaled real time)
and by the replay's SimWorker (virtual clock). The same requests give the same steps, tokens and times."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.replay.clock import VirtualClock
from orchestrator.replay.engine import SimWorker
from workers.sim.core import EngineCore
from workers.sim.engine import SimEngine
from workers.sim.hashing import BlockHasher
from workers.sim.kv_manager import KvBlockManager
from workers.sim.profiles import DEFAULT_PROFILE, load_profile
from workers.sim.scheduler import Scheduler, SimRequest
from workers.sim.timing import TimingModel

BS = 16
# (request id, prompt, max_tokens): a shared prefix (a cache hit for the later ones), a long prompt that is
# chunked, short ones; a small token budget and KV pool so chunking, batching and admission waits all happen
REQUESTS = [
    ("a", list(range(1, 700)), 9),
    ("b", list(range(1, 500)) + [7] * 80, 5),
    ("c", [3] * 2500, 4),
    ("d", list(range(1, 300)), 12),
    ("e", [5] * 40, 1),
]


def _scheduler() -> Scheduler:
    return Scheduler(KvBlockManager(400, BS), max_num_seqs=3, max_num_batched_tokens=1024, max_model_len=4096, hasher=BlockHasher(BS))


def _timing() -> TimingModel:
    return TimingModel(load_profile(DEFAULT_PROFILE))


class _Calls:
    """Counts EngineCore.plan/finish calls per core (spied on the class, so any driver is seen)."""

    def __init__(self, monkeypatch) -> None:
        self.plan: dict[int, int] = {}
        self.finish: dict[int, int] = {}
        plan, finish = EngineCore.plan, EngineCore.finish

        def spy_plan(core):
            self.plan[id(core)] = self.plan.get(id(core), 0) + 1
            return plan(core)

        def spy_finish(core, p, s):
            self.finish[id(core)] = self.finish.get(id(core), 0) + 1
            return finish(core, p, s)

        monkeypatch.setattr(EngineCore, "plan", spy_plan)
        monkeypatch.setattr(EngineCore, "finish", spy_finish)


async def _serve(monkeypatch) -> tuple[dict, SimEngine]:
    now = [0.0]
    engine = SimEngine(_scheduler(), _timing(), clock=lambda: now[0])

    async def sleep_until(deadline: float) -> None:  # the step "takes" its time at once: the fake clock jumps
        now[0] = deadline
        await asyncio.sleep(0)

    monkeypatch.setattr(engine, "_sleep_until", sleep_until)
    task = asyncio.create_task(engine.run())
    streams = {rid: engine.submit(rid, prompt, mt, lambda k: 0, arrival=0.0) for rid, prompt, mt in REQUESTS}
    out = {}
    for rid, s in streams.items():
        n = 0
        while True:
            toks, fin = await s.next()
            n += len(toks)
            if fin is not None:
                break
        out[rid] = (s.first_token, s.last_token, n)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return out, engine


class _Sink:
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.out: dict[str, list] = {}

    def step(self, w, result, events) -> None:
        for req, toks in result.outputs:
            rec = self.out.setdefault(req.request_id, [self.clock.now, None, 0])
            rec[1] = self.clock.now
            rec[2] += len(toks)

    def admitted(self, w, reqs) -> None:
        pass

    def pull(self, w, req, hit) -> None:  # pragma: no cover - no P/D here
        raise AssertionError

    def rejected(self, w, req) -> None:  # pragma: no cover
        raise AssertionError


def _replay() -> tuple[dict, SimWorker]:
    clock = VirtualClock()
    sink = _Sink(clock)
    w = SimWorker("w0", "both", _scheduler(), _timing(), clock, sink, "m")
    for rid, prompt, mt in REQUESTS:
        w.submit(SimRequest(request_id=rid, prompt_token_ids=list(prompt), max_tokens=mt))
    clock.run()
    return {rid: tuple(v) for rid, v in sink.out.items()}, w


async def test_serving_and_replay_give_the_same_token_times(monkeypatch):
    calls = _Calls(monkeypatch)
    served, engine = await _serve(monkeypatch)
    replayed, worker = _replay()
    assert set(served) == set(replayed) == {r[0] for r in REQUESTS}
    for rid in served:
        f1, l1, n1 = served[rid]
        f2, l2, n2 = replayed[rid]
        assert n1 == n2 == dict((r[0], r[2]) for r in REQUESTS)[rid]
        assert f1 == pytest.approx(f2, abs=1e-12) and l1 == pytest.approx(l2, abs=1e-12), rid
    # one code path: both drivers stepped their EngineCore, the same number of times, and the same work was done
    assert isinstance(engine.core, EngineCore) and isinstance(worker.core, EngineCore)
    assert calls.plan[id(engine.core)] >= engine.core.steps == worker.core.steps == calls.finish[id(worker.core)]
    assert calls.finish[id(engine.core)] == engine.core.steps
    assert engine.core.busy_time == pytest.approx(worker.core.busy_time)
    assert engine.scheduler.prefix_hits == worker.sched.prefix_hits > 0


def test_replay_worker_has_no_step_loop_of_its_own():
    """The replay's engine only moves the clock: planning and applying a step are the core's."""
    import inspect

    from orchestrator.replay import engine as replay_engine

    src = inspect.getsource(replay_engine.SimWorker)
    assert "self.core.plan()" in src and "core.finish(plan, dt)" in src
    assert ".schedule(" not in src and "update_from_output" not in src and "step_ms" not in src
